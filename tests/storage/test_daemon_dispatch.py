"""The daemon serves the Store API, all of it and nothing else: ``wire.REMOTE`` against the ``Store`` class.

No daemon runs here: the client's calls go through the wire's framing to the
server's ``dispatch`` and back in this process, to a store that records them.
"""
from __future__ import annotations

import datetime as dt
import inspect

import numpy as np
import pyarrow as pa
import pytest

from actions.alerts import acknowledge
from storage import StoreError
from storage.daemon import HttpStore
from storage.daemon.server import dispatch
from storage.daemon.wire import LOCAL, REMOTE, decode, encode
from storage.sandbox import SQLLimits
from storage.store import Store


def test_the_daemon_serves_every_abstract_store_method_and_nothing_else():
    abstract = set(Store.__abstractmethods__)
    unserved = abstract - set(REMOTE) - set(LOCAL)
    assert not unserved, f"Store methods the daemon does not serve (declare them in storage.daemon.wire): {unserved}"
    not_store = set(REMOTE) - abstract
    assert not not_store, f"the daemon serves names that are not abstract Store methods: {not_store}"
    assert set(LOCAL) <= abstract and not set(LOCAL) & set(REMOTE)
    assert "ping" not in REMOTE  # the daemon's own call, answered without the store
    for name, remote in REMOTE.items():
        params = list(inspect.signature(getattr(Store, name)).parameters)[1:]
        assert list(remote.args) == params, name
        assert remote.name == name and (remote.table is None or remote.table in params)


def test_http_store_has_the_store_api_signatures():
    assert not HttpStore.__abstractmethods__
    for name in REMOTE:
        assert inspect.signature(getattr(HttpStore, name)) == inspect.signature(getattr(Store, name)), name


class _Recording(Store):
    """A store that records its calls and answers with canned results."""

    url = "fake://"

    def __init__(self):
        self.calls = []

    def _record(self, name, *args):
        self.calls.append((name, args))

    def setup(self, target_version=None):
        self._record("setup", target_version)

    def insert(self, kind, table):
        self._record("insert", kind, table)

    def query(self, sql, params=None, limits=None):
        self._record("query", sql, params, limits)
        return pa.table({"n": [1, 2]})

    def run_named(self, name, params=None):
        self._record("run_named", name, params)
        return pa.table({"q": ["a"]})

    def window_stored(self, key):
        self._record("window_stored", key)
        return np.bool_(True)

    def load_offsets(self, source_id, topics, partitions):
        self._record("load_offsets", source_id, topics, partitions)
        return {("t", 0): 5, ("t", 1): 7, ("u", 0): 9}

    def store_offsets(self, source_id, offsets, log_ids=None):
        self._record("store_offsets", source_id, offsets, log_ids)

    def load_offset_logs(self, source_id, topics, partitions):
        self._record("load_offset_logs", source_id, topics, partitions)
        return {("t", 0): "id-a", ("u", 0): ""}

    def store_state(self, source_id, shard, fmt, state):
        self._record("store_state", source_id, shard, fmt, state)

    def load_state(self, source_id, shard):
        self._record("load_state", source_id, shard)
        return (3, bytes(range(256))) if shard == "p0/2" else None

    def load_jobs(self):
        self._record("load_jobs")
        return [{"job_id": "j", "attempt": 0}]

    def enforce_retention(self, now_ns=None):
        self._record("enforce_retention", now_ns)
        return ["2024-01-01"]

    def close(self):
        self._record("close")


class _Loopback(HttpStore):
    """HttpStore whose calls reach ``dispatch`` through the wire's framing, without HTTP."""

    def __init__(self, store, ceiling):  # no URL, no token, no ping
        self.store, self.ceiling, self.sent = store, ceiling, []

    def _call(self, method, args, table=None, timeout=None):
        self.sent.append(method)
        envelope, table = decode(encode(args, table))
        answer = encode(*dispatch(self.store, method, envelope, table, self.ceiling))
        return decode(answer)


@pytest.fixture
def loop():
    return _Loopback(_Recording(), SQLLimits(10.0, 100, 1000))


def test_every_remote_call_round_trips(loop):
    store = loop.store
    assert loop.setup(3) is None and store.calls[-1] == ("setup", (3,))
    rows = pa.table({"a": [1, 2]})
    for sent in (rows, rows.to_batches()[0]):  # a RecordBatch travels as a table
        loop.insert("window", sent)
        name, (kind, table) = store.calls[-1]
        assert (name, kind) == ("insert", "window") and table.equals(rows)
    assert loop.query("SELECT {d:Date}", {"d": dt.date(2024, 1, 2)}).to_pylist() == [{"n": 1}, {"n": 2}]
    assert store.calls[-1] == ("query", ("SELECT {d:Date}", {"d": "2024-01-02"}, SQLLimits(10.0, 100, 1000)))
    assert loop.run_named("fleet", {"team": "llm"}).column_names == ["q"]
    assert store.calls[-1] == ("run_named", ("fleet", {"team": "llm"}))
    assert loop.window_stored(("j", np.int64(1), 2)) is True
    assert store.calls[-1] == ("window_stored", (("j", 1, 2),))
    assert loop.load_offsets("src", ["t"], [0, 1]) == {("t", 0): 5, ("t", 1): 7}  # the client filters too
    assert store.calls[-1] == ("load_offsets", ("src", ["t"], [0, 1]))
    loop.store_offsets("src", {("t", np.int32(0)): np.int64(6)})
    assert store.calls[-1] == ("store_offsets", ("src", {("t", 0): 6}, {}))
    loop.store_offsets("src", {("t", 0): 6}, {("t", np.int64(0)): "id-b"})
    assert store.calls[-1] == ("store_offsets", ("src", {("t", 0): 6}, {("t", 0): "id-b"}))
    assert loop.load_offset_logs("src", ["t"], None) == {("t", 0): "id-a"}
    assert store.calls[-1] == ("load_offset_logs", ("src", ["t"], None))
    loop.store_state("src", "p0/2", 3, b"\x00\xffstate")
    assert store.calls[-1] == ("store_state", ("src", "p0/2", 3, b"\x00\xffstate"))
    assert loop.load_state("src", "p0/2") == (3, bytes(range(256)))
    assert loop.load_state("src", "p1/2") is None
    assert loop.load_jobs() == [{"job_id": "j", "attempt": 0}]
    assert loop.enforce_retention(123) == ["2024-01-01"]
    assert store.calls[-1] == ("enforce_retention", (123,))
    assert acknowledge(loop, ["a1"], by="me", now_ns=5) == 1  # actions.alerts, over the client's insert
    assert store.calls[-1][1][0] == "alert_ack"


def test_the_client_sends_nothing_for_empty_writes_and_refuses_what_is_not_a_table(loop):
    loop.insert("window", pa.table({"a": pa.array([], pa.int64())}))
    loop.store_offsets("src", {})
    assert loop.sent == [] and loop.store.calls == []
    with pytest.raises(StoreError, match=r"insert\('window'\) needs a pyarrow Table, got list"):
        loop.insert("window", [1, 2])
    with pytest.raises(TypeError):
        loop.load_offsets("src")  # a missing argument fails as it would on any Store


def test_a_client_may_lower_the_sql_limits_not_raise_them(loop):
    loop.query("SELECT 1", limits={"max_execution_time_s": 5, "max_memory_mb": 10**6, "max_result_rows": 10})
    assert loop.store.calls[-1][1][2] == SQLLimits(5.0, 100, 10)
    loop.query("SELECT 1")
    assert loop.store.calls[-1][1][2] == SQLLimits(10.0, 100, 1000)


@pytest.mark.parametrize("name", ["close", "acknowledge", "optimize", "_execute", "__init__", "__class__", "nope",
                                  "", "setup/../close", "Setup"])
def test_the_server_refuses_every_other_name(name):
    store = _Recording()
    with pytest.raises(StoreError, match="unknown store method"):
        dispatch(store, name, {}, None)
    assert store.calls == []


def test_broken_requests_run_nothing():
    store = _Recording()
    with pytest.raises(StoreError, match="insert needs an Arrow table"):
        dispatch(store, "insert", {"kind": "window"}, None)
    with pytest.raises(KeyError):
        dispatch(store, "store_offsets", {"offsets": [["t", 0, 1]]}, None)
    with pytest.raises(KeyError):
        dispatch(store, "window_stored", {}, None)
    assert store.calls == []
    envelope, table = dispatch(store, "ping", {}, None)
    assert envelope["ok"] and envelope["store"] == "fake://" and table is None and store.calls == []
