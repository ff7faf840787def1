"""The real Kafka path on Tansu: producer -> topics -> manually assigned source, with resume."""
import uuid

import pytest

from core import codec, topics
from core.kafka_admin import BrokerError, check_reachable, ensure_topics
from core.layout import JobLayout
from generators.fleetgen import JobSpec, generate_window
from ingest.producer import TelemetryProducer
from ray_jobs.kafka_source import KafkaSource

pytestmark = pytest.mark.integration


def test_produce_consume_and_resume(broker):
    ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 4)
    specs = [JobSpec(f"kafka-{uuid.uuid4().hex[:6]}-{i}", JobLayout(2, 2), 4) for i in range(6)]
    tables = [generate_window(s, 0, 2, 0) for s in specs]
    with TelemetryProducer(broker.bootstrap) as p:
        for t in tables:
            p.send(t)
        assert p.flush(30)
    assert p.stats.records_sent == sum(t.num_rows for t in tables)
    assert p.stats.records_dropped == 0

    src = KafkaSource(broker.bootstrap, [topics.TOPIC_OPS], range(4))
    src.setup()
    src.seek({})
    seen = {}
    handled = set()
    for _ in range(50):
        for m in src.poll(500):
            kind, t = codec.decode(m.value)
            job = t["job_id"][0].as_py()
            seen.setdefault(job, set()).add(m.partition)
            handled.add((m.topic, m.partition, m.offset))
            src.advance((m.topic, m.partition), m.offset + 1)
        if all(s.job_id in seen for s in specs):
            break
    assert all(s.job_id in seen for s in specs)
    assert all(len(parts) == 1 for parts in seen.values()), "a job's records stay in one partition"
    positions = src.positions()
    src.close()

    # Resume from the stored positions: nothing already handled comes again, and each partition goes on
    # exactly where it stopped. (The module's broker is shared: records other tests left behind the
    # stopping point, which this test never handled, may follow.)
    src2 = KafkaSource(broker.bootstrap, [topics.TOPIC_OPS], range(4))
    src2.seek(positions)
    again = [m for _ in range(3) for m in src2.poll(1000)]
    src2.close()
    assert not [m for m in again if (m.topic, m.partition, m.offset) in handled]
    first = {}
    for m in again:
        first.setdefault((m.topic, m.partition), m.offset)
    assert all(off == positions[tp] for tp, off in first.items() if tp in positions), (first, positions)


def test_unreachable_broker_is_a_one_line_error():
    with pytest.raises(BrokerError, match="no Kafka broker reachable at 127.0.0.1:1"):
        check_reachable("127.0.0.1:1", timeout_s=1)
