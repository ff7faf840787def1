"""The unit tier's own guard (tests/conftest.py): it must catch a project sleep, a process and an IP socket in
the test thread."""
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT, UnitTierViolation, sleep_guard


def _guard():
    slept = []
    return sleep_guard(slept.append, threading.current_thread(), ROOT), slept


def test_a_sleep_from_project_code_in_the_test_thread_raises():
    no_sleep, slept = _guard()
    with pytest.raises(UnitTierViolation, match="injected clock"):
        no_sleep(0.5)
    assert slept == []


def test_a_sleep_from_another_thread_or_from_outside_the_project_passes():
    no_sleep, slept = _guard()
    t = threading.Thread(target=no_sleep, args=(0.25,))
    t.start()
    t.join()
    outside = compile("sleep(0.125)", "/usr/lib/python3/somewhere.py", "exec")
    exec(outside, {"sleep": no_sleep})
    assert slept == [0.25, 0.125]


def test_the_fixture_is_active_in_this_unit_test():
    with pytest.raises(UnitTierViolation):
        time.sleep(0)
    with pytest.raises(UnitTierViolation, match="started a process"):
        subprocess.run([sys.executable, "-c", "pass"], timeout=30)
    with socket.socket() as s, pytest.raises(UnitTierViolation, match="fake the network"):
        s.bind(("127.0.0.1", 0))
    with socket.socket() as s, pytest.raises(UnitTierViolation, match="fake the network"):
        s.connect_ex(("127.0.0.1", 9))
    # Unix socket pairs (an event loop's wake-up) are no network; another thread is the code under test's.
    a, b = socket.socketpair()
    a.close(), b.close()
    done = []
    t = threading.Thread(target=lambda: done.append(subprocess.run([sys.executable, "-c", "pass"]).returncode))
    t.start()
    t.join()
    assert done == [0]
