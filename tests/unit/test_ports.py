"""Ports told to a process in advance come from outside the kernel's ephemeral range (services/ports.py)."""
import socket

import pytest

from services.ports import RAY_WORKER_PORTS, _ephemeral_low, free_fixed_port


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_a_fixed_port_is_free_and_outside_the_ranges_others_bind_into():
    for _ in range(20):
        port = free_fixed_port()
        assert RAY_WORKER_PORTS[1] < port < _ephemeral_low(), port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binds


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_a_taken_port_is_not_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        picks = iter([busy, busy, busy + 1 if busy + 1 < 65536 else busy - 1])
        monkeypatch.setattr("services.ports.random.randint", lambda lo, hi: next(picks))
        monkeypatch.setattr("services.ports._ephemeral_low", lambda: 65535)
        assert free_fixed_port() != busy
