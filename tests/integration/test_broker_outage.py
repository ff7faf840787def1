"""A broker outage loses nothing and costs the caller nothing: spool, then replay in order.

The real Tansu broker is stopped mid-stream and started again on the same port
(it keeps data in memory, so the new one starts empty: exactly the records
sent during the outage must then arrive, once each, oldest first). Meanwhile
``send()`` must return at once every time.
"""
import time
import uuid

import pyarrow as pa
import pytest

from core import codec, topics
from core.kafka_admin import ensure_topics
from core.layout import JobLayout
from generators.fleetgen import JobSpec, generate_window
from ingest.producer import TelemetryProducer
from ray_jobs.kafka_source import KafkaSource
from services.broker import LocalBroker

pytestmark = pytest.mark.integration

OUTAGE_S = 8.0  # the benchmark-sized minute is too long for CI; the path is the same


def _batch(job, i):
    t = generate_window(JobSpec(job, JobLayout(2, 2), 4), 0, 1, 0)
    return t.set_column(t.schema.get_field_index("step"), "step", pa.array([i] * t.num_rows, pa.int64()))


def _consume(bootstrap, job, want, timeout_s=30):
    src = KafkaSource(bootstrap, [topics.TOPIC_OPS], range(2))
    src.seek({})
    steps = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(steps) < want:
        for m in src.poll(300):
            _, t = codec.decode(m.value)
            if t["job_id"][0].as_py() == job:
                steps.append(t["step"][0].as_py())
    src.close()
    return steps


def test_outage_is_spooled_and_replayed_exactly_once(tmp_path):
    job = f"outage-{uuid.uuid4().hex[:6]}"
    broker = LocalBroker().start()
    port = broker.port
    try:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        prod = TelemetryProducer(broker.bootstrap, spool_dir=str(tmp_path / "spool"), retry_s=0.5,
                                 delivery_timeout_s=3.0)
        for i in range(5):
            prod.send(_batch(job, i))
        assert prod.flush(30)
        assert _consume(broker.bootstrap, job, 5) == [0, 1, 2, 3, 4]

        broker.stop()
        send_times = []
        t_end = time.monotonic() + OUTAGE_S
        i = 5
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            prod.send(_batch(job, i))
            send_times.append(time.perf_counter() - t0)
            i += 1
            time.sleep(0.5)
        sent_during_outage = list(range(5, i))

        broker = LocalBroker(port=port).start()
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        deadline = time.monotonic() + 60
        while (prod.spooled or prod.stats.batches_sent < i) and time.monotonic() < deadline:
            time.sleep(0.2)
        prod.close(30)
        assert prod.stats.records_dropped == 0, prod.stats
        assert prod.stats.batches_spooled >= 1, "the outage was long enough to spool"
        got = _consume(broker.bootstrap, job, len(sent_during_outage))
        assert got == sent_during_outage, "nothing lost, nothing twice, oldest first"
        # send() encodes on the caller's thread (milliseconds) and never waits for the broker,
        # whose timeouts are seconds; a loaded 2-core machine can still stretch one call.
        assert sorted(send_times)[len(send_times) // 2] < 0.02, f"send() median {sorted(send_times)}"
        assert max(send_times) < 0.5, f"send() blocked: {max(send_times):.3f} s"
    finally:
        broker.stop()


def test_a_client_that_stopped_delivering_is_replaced_and_nothing_is_lost(tmp_path):
    """kafka-python 3.0.12's idempotent producer can stop for good: when a batch it already retried expires
    (a partition leader killed: the brokers left hold acks=all writes until the dead follower leaves the
    in-sync set), it forgets its producer id but stays READY, the one state from which it never asks for
    a new one; from then on it sends nothing and expires nothing, and every future waits forever. Seen in
    the three-broker failover (``benchmarks/kafka_failover.py``: a flush stalled past 120 s). Here the
    call the client makes on that path puts a real client, on a real broker, in that state."""
    job = f"wedged-{uuid.uuid4().hex[:6]}"
    broker = LocalBroker().start()
    try:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        prod = TelemetryProducer(broker.bootstrap, spool_dir=str(tmp_path / "spool"), retry_s=0.5,
                                 delivery_timeout_s=2.0)
        prod.send(_batch(job, 0))
        assert prod.flush(30)
        prod._client._transaction_manager.reset_producer_id()  # what an expired, retried batch does
        for i in range(1, 6):
            prod.send(_batch(job, i))
        t0 = time.monotonic()
        assert prod.flush(60), "the flush never ended: the wedged client was waited on"
        took = time.monotonic() - t0
        prod.close(30)
        # It waited the client's own delivery timeout (about 5 s) and the margin before replacing it.
        assert took < 30, f"flush took {took:.1f} s"
        assert prod.stats.records_dropped == 0, prod.stats
        assert sorted(set(_consume(broker.bootstrap, job, 6))) == [0, 1, 2, 3, 4, 5], "nothing lost"
    finally:
        broker.stop()
