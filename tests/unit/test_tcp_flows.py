"""The exporter reads its process's TCP connections over each profiled step (ingest/tcp_flows.py)."""
from __future__ import annotations

import socket
import struct
import threading

import pytest

from core import schema as S
from ingest.tcp_flows import TcpFlowSampler, delta, endpoint, parse_tcp_info


class _Drained:
    """Bytes the server end has read so far; ``wait_for(n)`` blocks until it has read n (no sleeping)."""

    def __init__(self):
        self.n = 0
        self.cond = threading.Condition()

    def add(self, k: int) -> None:
        with self.cond:
            self.n += k
            self.cond.notify_all()

    def wait_for(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.n >= n, timeout=30), (self.n, n)


def _pair():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    client = socket.create_connection(srv.getsockname())
    server, _ = srv.accept()
    srv.close()
    drained = _Drained()

    def drain():
        try:
            while True:
                got = server.recv(1 << 20)
                if not got:
                    return
                drained.add(len(got))
        except OSError:  # closed by the test
            pass
    threading.Thread(target=drain, daemon=True).start()
    return client, server, drained


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_a_reading_has_every_connection_by_its_two_ends_and_their_counters():
    client, server, drained = _pair()
    try:
        sampler = TcpFlowSampler(rescan_s=0.0)
        before = sampler.read()
        ends = (endpoint(client.getsockname()), endpoint(client.getpeername()))
        assert ends in before and (ends[1], ends[0]) in before  # both ends live in this process
        client.sendall(b"x" * (2 << 20))
        drained.wait_for(2 << 20)  # read by the other end, so acknowledged
        after = sampler.read()
        rows = {(r["local"], r["remote"]): r for r in delta(before, after)}
        mine = rows[ends]
        assert mine["bytes_acked"] >= 1 << 20 and mine["elapsed_ns"] > 0 and mine["rtt_us"] >= 0
        assert rows[(ends[1], ends[0])]["bytes_received"] >= 1 << 20
        # Every field but the identity, and "probe" (the path probe's rows set it; these are the job's own).
        assert set(mine) | {"job_id", "attempt", "rank", "window_id", "step", "probe"} == set(S.TCP_FLOW.names)
    finally:
        client.close()
        server.close()


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_idle_connections_and_a_short_answer_give_nothing():
    assert parse_tcp_info(b"\x01" + bytes(100)) is None  # a kernel without the busy times
    assert parse_tcp_info(bytes(232)) is None            # not established
    info = bytearray(232)
    info[0] = 1
    struct.pack_into("<Q", info, 120, 5000)
    assert parse_tcp_info(bytes(info))["bytes_acked"] == 5000
    client, server, _ = _pair()
    try:
        s = TcpFlowSampler(rescan_s=0.0)
        a = s.read()
        assert delta(a, s.read()) == []  # nothing sent since: an idle connection is no evidence
    finally:
        client.close()
        server.close()


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_the_path_probes_connections_are_not_read_as_the_jobs():
    """The probe (ingest/path_probe.py) measures its own transfers and marks them: the sampler leaves out every
    connection with an end in ``ignore`` (its listener, the peer listener it sends to), both directions."""
    client, server, drained = _pair()
    try:
        sampler = TcpFlowSampler(rescan_s=0)
        ends = (endpoint(client.getsockname()), endpoint(client.getpeername()))
        assert ends in sampler.read()
        sampler.ignore = frozenset({ends[1]})  # the listening side's address, as the probe's listener would be
        assert ends not in sampler.read() and (ends[1], ends[0]) not in sampler.read()
    finally:
        client.close()
        server.close()
