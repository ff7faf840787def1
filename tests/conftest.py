"""Fixtures for the real services: the Tansu broker (one per test module), a local Ray on 127.0.0.1 (one per session).

Integration tests start real components (docs/architecture.md, "The real components"): a mock of a
service we integrate with is not a test of that integration. Each fixture listens on 127.0.0.1 only and
is stopped at the end of its scope.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Ray binds the machine's external address unless this is set (loopback only).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="module")
def broker():
    """A Tansu broker per test module (it starts in 0.1 s). It was one for the whole session: every pipeline a
    test starts reads its topics from the start, so each analysed again the records of every module before it
    (the two-node Ray test and the kill -9 test ran minutes on them), and the traced-job fleets paged those
    long-finished jobs as node losses."""
    from services.broker import LocalBroker

    with LocalBroker() as b:
        yield b


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray on 127.0.0.1 shared by the integration tests (about 3 s to start)."""
    import ray

    from core.config import Config
    from ray_jobs.ray_connect import init_ray

    init_ray(Config())
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    d = ROOT / "tests" / "artifacts"
    d.mkdir(parents=True, exist_ok=True)
    return d


class UnitTierViolation(AssertionError):
    """A unit test did what only an integration test may (docs/architecture.md, "Conventions" 8)."""


def sleep_guard(real_sleep, test_thread, root: Path):
    """A ``time.sleep`` that raises when this project's code calls it in the test's own thread."""
    import threading

    project, venv = str(root), str(root / ".venv")

    def no_sleep(seconds):
        # Only this project's code is held to it: the standard library's own polling (subprocess
        # waiting for a child with a timeout) is not a sleep the test chose.
        caller = sys._getframe(1).f_code.co_filename
        if (threading.current_thread() is test_thread and caller.startswith(project)
                and not caller.startswith(venv)):
            raise UnitTierViolation(f"time.sleep({seconds}) in a unit test: drive an injected clock or "
                                    "wait on an event, or mark the test integration")
        real_sleep(seconds)

    return no_sleep


def network_guard(real, test_thread, what: str):
    """A socket method (``connect``, ``bind``) that raises when the test's own thread uses it on an IP socket:
    a unit test opens no network connection and listens on no port. Unix sockets (the socket pairs event
    loops wake themselves with) are not the network."""
    import socket
    import threading

    def guarded(sock, *args, **kwargs):
        if threading.current_thread() is test_thread and sock.family in (socket.AF_INET, socket.AF_INET6):
            raise UnitTierViolation(f"socket.{what}{args[:1]!r} in a unit test: fake the network, or mark the "
                                    "test integration")
        return real(sock, *args, **kwargs)
    return guarded


def process_guard(real, test_thread):
    """A ``subprocess.Popen.__init__`` that raises in the test's own thread: a unit test starts no process."""
    import threading

    def guarded(popen, args, *rest, **kwargs):
        if threading.current_thread() is test_thread:
            raise UnitTierViolation(f"a unit test started a process ({str(args)[:80]}): mark it integration")
        return real(popen, args, *rest, **kwargs)
    return guarded


@pytest.fixture(autouse=True)
def unit_tier(request, monkeypatch):
    """Unit tests start no Ray, no process, open no IP socket and do not sleep in the test's own thread;
    integration tests may.

    A unit test that waits on the wall clock is slow and flaky on a loaded CI machine: it
    should drive an injected clock instead (``tests.fakes.ManualClock``) or wait on an event.
    Background threads of the code under test (a producer's sender) and library code are
    not the test's sleeps and are left alone. A test marked ``integration`` is not checked.
    """
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    if "ray_local" in request.fixturenames:
        raise UnitTierViolation(f"{request.node.nodeid} starts Ray: mark it integration")
    import threading
    import time

    import socket
    import subprocess

    me = threading.current_thread()
    monkeypatch.setattr(time, "sleep", sleep_guard(time.sleep, me, ROOT))
    for what in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, what, network_guard(getattr(socket.socket, what), me, what))
    monkeypatch.setattr(subprocess.Popen, "__init__", process_guard(subprocess.Popen.__init__, me))
    ray = sys.modules.get("ray")
    ray_was_up = ray is not None and ray.is_initialized()
    yield
    ray = sys.modules.get("ray")
    if ray is not None and not ray_was_up and ray.is_initialized():
        ray.shutdown()
        raise UnitTierViolation(f"{request.node.nodeid} started Ray: mark it integration")


# chDB's global context is torn down by the interpreter's exit, after every test has run and
# pytest has printed its summary. That teardown has printed "Exception in global_context->
# shutdown()" in most full runs and once segfaulted, turning a green run (1136 passed) into
# exit code 139. The session's own result is known by then: exit with it, skipping only the
# native teardown of a process that is about to end anyway.
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _EXIT_STATUS and "chdb" in sys.modules and not hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
