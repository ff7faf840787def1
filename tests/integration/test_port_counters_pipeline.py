"""A host's port counters through the real path: the exporter reads a fake sysfs tree laid out as on a host with
two NICs, sends through the real producer to the broker, a shard reads the heartbeats topic, sums the rows and
stores them in chDB, where the console's named query and the fabric verdict find the flapping link."""
from __future__ import annotations

import time
import uuid

import pytest

from analyzers.fabric import host_verdicts
from core import topics
from core.config import Config
from core.kafka_admin import ensure_topics
from ingest.exporter import RankExporter
from ingest.port_counters import PortCounterSampler
from ingest.producer import TelemetryProducer
from ray_jobs.pipeline import result_sink
from ray_jobs.shard import ShardWorker
from tests.fakes import ManualClock
from tests.unit.test_port_counters import host_tree

pytestmark = pytest.mark.integration


def test_port_counters_go_from_the_exporter_to_the_store(tmp_path):
    from services.broker import LocalBroker

    # A broker of its own: the session's broker holds every earlier test's records (160,000 in CI), which a new
    # shard reads from the start; 60 s did not reach this test's four rows there.
    with LocalBroker() as broker:
        _through_the_pipeline(broker, tmp_path)


def _through_the_pipeline(broker, tmp_path):
    from storage import open_store

    ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
    job = f"ports-{uuid.uuid4().hex[:8]}"
    root = str(tmp_path / "ib")
    host_tree(root)
    sampler = PortCounterSampler(root)

    def next_heartbeat():  # the sampler reads again once its duty cycle allows (a heartbeat is 2 s apart)
        while time.monotonic_ns() < sampler._next_ns:
            time.sleep(0.02)

    with TelemetryProducer(broker.bootstrap) as producer:
        exp = RankExporter(job, 0, 0, 0, producer.send, heartbeat_s=3600, use_cuda=False, tcp_flows=False,
                           nvml=False, host="node-7", port_counters=sampler)
        exp._beat()
        next_heartbeat()
        host_tree(root, link_downed=2, link_error_recovery=5, symbol_error=300)
        exp._beat()
        next_heartbeat()
        host_tree(root, link_downed=3, link_error_recovery=5, symbol_error=340, port_xmit_data=10**6)
        exp.close()
        assert producer.flush(30)
    assert exp.stats.port_counters == 4 and exp.stats.errors == 0

    url = f"chdb://{tmp_path / 'store'}"
    cfg = Config().replace(kafka={"bootstrap": broker.bootstrap}, store={"url": url},
                           pipeline={"commit_interval_s": 0.0, "state_interval_s": 0.0,
                                     "state_dir": str(tmp_path / "state")})
    clock = ManualClock()
    worker = ShardWorker(0, [0, 1], cfg, f"src-{job}", sink_factory=result_sink(cfg, open_store), clock=clock)
    worker.setup()
    try:
        deadline = time.monotonic() + 60
        while worker.stats.port_counters < 4 and time.monotonic() < deadline:
            worker.step(poll_timeout_ms=200)
        assert worker.stats.port_counters == 4, worker.stats
        clock.t += 120  # the minute's sums are due
        worker.step(poll_timeout_ms=0)
    finally:
        worker.stop()
    store = open_store(url)
    try:
        got = store.run_named("job_port_counters", {"job_id": job}).to_pylist()
    finally:
        store.close()
    assert [(r["host"], r["device"], r["port"]) for r in got] == [("node-7", "mlx5_0", 1), ("node-7", "mlx5_1", 1)]
    bad = got[0]
    assert (bad["link_downed"], bad["link_error_recovery"], bad["symbol_errors"]) == (3, 5, 340)
    assert bad["xmit_bytes"] == 4 * 10**6 and bad["reset"] == 0  # port_xmit_data counts 4-octet words
    assert bad["samples"] == 1 and bad["elapsed_ns"] > 0  # the shard stored the rows of its minute as one sum
    verdict = host_verdicts(got)["node-7"]
    assert verdict.problem and verdict.sentence.startswith(
        "port mlx5_0/1 of host node-7: link downed 3 times, 5 link recoveries, 340 symbol errors"), verdict
