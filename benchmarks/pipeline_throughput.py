"""Pipeline throughput: op records per second per core, from Kafka bytes to open windows.

    .venv/bin/python benchmarks/pipeline_throughput.py [--records 2000000] [--repeats 3]

(a) decode + route: Arrow IPC payloads (as they sit in Kafka) decoded,
    validated and routed into per-job windows by the shard's WindowTracker,
    in one process; records/s per core of process CPU time.
(b) end to end with the local broker: payloads produced to Tansu, then
    consumed by the shard's KafkaSource (manual assignment), decoded and
    routed; records/s of wall time from the first poll to the last record.
Targets (issue 4): (a) at least 1M records/s, (b) at least 300k records/s.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa  # noqa: E402

from core import (
    codec,  # noqa: E402
    topics,
)
from core.kafka_admin import ensure_topics  # noqa: E402
from core.layout import JobLayout
from generators.fleetgen import JobSpec, generate_window  # noqa: E402
from ingest.producer import TelemetryProducer, split_for_wire  # noqa: E402
from ray_jobs.kafka_source import KafkaSource  # noqa: E402
from ray_jobs.windows import WindowTracker  # noqa: E402
from services.broker import LocalBroker


def make_payloads(n_records: int) -> tuple[list[pa.Table], list[bytes], int]:
    spec = JobSpec("bench", JobLayout(dp_size=32, pp_size=4, tp_size=4), num_microbatches=8)
    one = generate_window(spec, 0, 1, 1_700_000_000_000_000_000)
    tables, total, i = [], 0, 0
    while total < n_records:
        tables.append(one.set_column(one.schema.get_field_index("job_id"), "job_id",
                                     pa.array([f"bench-{i % 256}"] * one.num_rows)))
        total += one.num_rows
        i += 1
    payloads = [p for t in tables for p in split_for_wire(t)]
    return tables, payloads, total


def decode_route(payloads: list[bytes]) -> None:
    tr = WindowTracker(idle_timeout_s=1e9)
    for i, p in enumerate(payloads):
        kind, t = codec.decode(p)
        good, _, _ = codec.validate_op_spans(t)
        tr.add_ops(good, (topics.TOPIC_OPS, 0), i, 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tables, payloads, n = make_payloads(args.records)
    print(f"{n:,} op records in {len(payloads)} Kafka messages")
    cpu = []
    for _ in range(args.repeats):
        c0 = time.process_time()
        decode_route(payloads)
        cpu.append(time.process_time() - c0)
    print(f"(a) decode + validate + route: {n / statistics.median(cpu):,.0f} records/s per core "
          f"(median of {args.repeats}; target >= 1,000,000)")

    with LocalBroker() as broker:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 8)
        with TelemetryProducer(broker.bootstrap, max_queue_bytes=1 << 30) as p:
            for t in tables:
                p.send(t)
            assert p.flush(300)
        walls = []
        for _ in range(args.repeats):
            src = KafkaSource(broker.bootstrap, [topics.TOPIC_OPS], range(8), max_poll_records=2000)
            src.seek({})
            tr = WindowTracker(idle_timeout_s=1e9)
            seen = 0
            w0 = time.perf_counter()
            while seen < n:
                for m in src.poll(500):
                    kind, t = codec.decode(m.value)
                    good, _, _ = codec.validate_op_spans(t)
                    tr.add_ops(good, (m.topic, m.partition), m.offset, 0.0)
                    seen += t.num_rows
            walls.append(time.perf_counter() - w0)
            src.close()
        print(f"(b) Kafka -> decode -> windows, one consumer: {n / statistics.median(walls):,.0f} records/s wall "
              f"(median of {args.repeats}; target >= 300,000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
