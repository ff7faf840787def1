"""The path probe: one rank's burst to another over its own connection, measured at both ends, paired as a flow."""
from __future__ import annotations

import socket
import time

import pytest

from analyzers.links.tcp import flows
from core import codec
from core import schema as S
from ingest.path_probe import PathProbe, job_host, peer_of
from ingest.tcp_flows import TcpFlowSampler

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(TcpFlowSampler().unavailable), reason="TCP_INFO or /proc not available")]


def test_peers_are_half_the_world_away_and_never_a_ring_neighbour():
    assert peer_of(0, 2) is None and peer_of(1, 1) is None
    for world in (3, 4, 8, 9, 1024):
        for r in range(world):
            p = peer_of(r, world)
            assert p != r and 0 <= p < world
            if world > 3:
                assert p not in ((r + 1) % world, (r - 1) % world)


def _wait_rows(probes, want, timeout=10.0):
    rows = {id(p): [] for p in probes}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sum(map(len, rows.values())) < want:
        for p in probes:
            rows[id(p)] += p.take_rows()
        time.sleep(0.02)
    return [rows[id(p)] for p in probes]


def test_three_ranks_probe_each_other_and_the_analysis_pairs_each_probe_into_a_flow():
    probes = [PathProbe("127.0.0.1", nbytes=300_000) for _ in range(3)]
    try:
        for r, p in enumerate(probes):
            assert p.address.startswith("127.0.0.1:")
            p.aim(probes[peer_of(r, 3)].address)
        for p in probes:
            p.fire(window=6, step=7)
        per_rank = _wait_rows(probes, 6)
        assert all(p.errors == 0 and p.sent == 1 and p.received == 1 for p in probes)
        table = codec.from_rows(S.TCP_FLOW, [dict(job_id="j", attempt=0, rank=r, **row)
                                             for r, rows in enumerate(per_rank) for row in rows])
        assert table["probe"].to_pylist() == [True] * 6 and set(table["window_id"].to_pylist()) == {6}
        got = {(f.src, f.dst): f for f in flows(table, probe=True)}
        assert set(got) == {(0, 1), (1, 2), (2, 0)}
        assert all(f.bytes >= 300_000 and f.busy_s > 0 for f in got.values())
        assert flows(table) == []  # the job's own flows leave the probes out
    finally:
        for p in probes:
            p.close()


def test_a_peer_that_is_gone_costs_a_counted_error_not_an_exception():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: connection refused
    p = PathProbe("127.0.0.1", timeout_s=1.0)
    try:
        p.aim(dead)
        p.fire(0, 0)
        deadline = time.monotonic() + 5
        while p.errors == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p.errors == 1 and p.sent == 0 and p.take_rows() == []
    finally:
        p.close()


def test_a_stranger_sending_garbage_is_dropped_and_the_probe_keeps_working():
    a, b = PathProbe("127.0.0.1", nbytes=100_000), PathProbe("127.0.0.1", nbytes=100_000)
    try:
        host, port = b.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"\xff" * 64)  # a length no probe has
            s.settimeout(2)
            assert s.recv(1) == b""  # closed by the receiver
        a.aim(b.address)
        a.fire(0, 1)
        (ra, rb) = _wait_rows([a, b], 2)
        assert len(ra) == 1 and len(rb) == 1 and b.errors == 1 and a.errors == 0
    finally:
        a.close()
        b.close()


def test_the_job_host_is_the_address_of_this_process_connections():
    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    try:
        assert job_host() == "127.0.0.1"
    finally:
        for s in (c, conn, srv):
            s.close()
