"""The shard's transports, real and fake, implement every member of ``ray_jobs.transports``' protocols with the
parameters the shard passes: the shard calls them without probing, so a missing one would fail in
production, not here."""
from __future__ import annotations

import inspect

import pytest

from core.control_topic import ControlReader
from ray_jobs.kafka_source import KafkaSource
from ray_jobs.result_writer import ResultWriter
from ray_jobs.transports import READER_ROLES, WRITER_ROLES, ControlFeed, RecordSource, ResultSink
from tests.fakes import FakeControls, FakeSink, FakeSource


def _members(protocol) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if callable(fn) and not name.startswith("_")}


def _accepts(impl: inspect.Signature, wanted: inspect.Signature) -> list[str]:
    """The protocol's parameters (by name, or by position for positional ones) the implementation lacks."""
    params = list(impl.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    names = {p.name for p in params}
    missing = [p.name for p in wanted.parameters.values() if p.name != "self" and p.name not in names]
    # A parameter the protocol gives a default must have one here too (the shard may leave it out).
    for p in wanted.parameters.values():
        if p.default is not p.empty and p.name in names and impl.parameters[p.name].default is p.empty:
            missing.append(f"{p.name} (no default)")
    # And nothing more that the shard would have to pass.
    extra = [p.name for p in params if p.name != "self" and p.name not in wanted.parameters
             and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return missing + [f"{n} (required, not in the protocol)" for n in extra]


CASES = [(impl, role) for impls, roles in (((KafkaSource, FakeSource), READER_ROLES),
                                            ((ResultWriter, FakeSink), WRITER_ROLES),
                                            ((ControlReader, FakeControls), (ControlFeed,)))
         for impl in impls for role in roles]


@pytest.mark.parametrize("impl, protocol", CASES, ids=[f"{i.__name__}-{r.__name__}" for i, r in CASES])
def test_a_transport_has_every_member_the_shard_calls(impl, protocol):
    for name, wanted in _members(protocol).items():
        fn = getattr(impl, name, None)
        assert callable(fn), f"{impl.__name__} has no {name}"
        assert not _accepts(inspect.signature(fn), wanted), (impl.__name__, name, _accepts(inspect.signature(fn),
                                                                                             wanted))


def test_built_transports_are_instances_of_the_protocols():
    # No client is made before setup/seek: building them touches no broker and no store.
    for reader in (KafkaSource("127.0.0.1:1", ["ss.ops"], [0]), FakeSource([])):
        assert all(isinstance(reader, role) for role in READER_ROLES)
    for writer in (ResultWriter("chdb://nowhere"), FakeSink()):
        assert all(isinstance(writer, role) for role in WRITER_ROLES)
    assert not isinstance(object(), RecordSource) and not isinstance(FakeSource([]), ResultSink)


def test_each_role_is_small_and_no_member_is_in_two_roles():
    """The point of the roles: a part of the shard that holds one sees a few members, each with one home."""
    seen: dict[str, str] = {}
    for role in READER_ROLES + WRITER_ROLES:
        names = set(_members(role)) | set(getattr(role, "__annotations__", {}))
        assert len(names) <= 8, (role.__name__, sorted(names))
        for name in names - {"close", "setup"}:  # each client is opened and closed once, by its first role
            assert name not in seen, f"{name} is in {seen[name]} and {role.__name__}"
            seen[name] = role.__name__


def test_the_check_fails_on_a_transport_that_lacks_a_member_or_a_parameter():
    class Narrow(FakeSource):
        def seek(self, stored):  # no stored_logs: the shard passes them
            pass

    wanted = _members(RecordSource)["seek"]
    assert _accepts(inspect.signature(Narrow.seek), wanted) == ["stored_logs", "by"]
    assert _accepts(inspect.signature(FakeSource.seek), wanted) == []
