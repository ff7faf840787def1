"""The exporter reads its process's TCP connections at each profiled step, on a thread of its own (real
sockets, real threads: a step's compute is a sleep, during which that thread takes its reading)."""
from __future__ import annotations

import time

import pytest

from core import schema as S
from ingest.exporter import RankExporter, Sampling
from tests.unit.test_tcp_flows import _pair

pytestmark = pytest.mark.integration


def test_the_exporter_sends_each_profiled_steps_connections_off_the_training_thread():
    client, server, _ = _pair()
    got = []
    try:
        exp = RankExporter("j", 0, 0, 0, got.append, sampling=Sampling(3, 4), heartbeat_s=3600)
        for step in range(4):  # steps 0-2 profiled, 3 not
            with exp.step(step):
                time.sleep(0.1)  # a step's compute: the flows' thread reads the start meanwhile
                client.sendall(b"y" * (1 << 20))
                time.sleep(0.1)
        exp.close()
    finally:
        client.close()
        server.close()
    flows = [t for t in got if S.kind_of(t.schema) == "tcp_flow"]
    assert flows and exp.stats.tcp_flows == sum(t.num_rows for t in flows)
    steps = {s for t in flows for s in t.column("step").to_pylist()}
    assert steps <= {0, 1, 2} and {t.column("window_id")[0].as_py() for t in flows} == {0}
    assert sum(r["bytes_acked"] for t in flows for r in t.to_pylist()) >= 2 << 20
