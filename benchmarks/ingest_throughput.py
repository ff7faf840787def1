"""Ingest throughput: op records encoded and sent to the local Tansu broker, per core.

    .venv/bin/python benchmarks/ingest_throughput.py [--records 2000000] [--repeats 3]

Builds realistic op-span batches with the fleet generator (one profiled step
of a 512-GPU job per batch), then times (a) Arrow IPC + zstd encoding alone
and (b) encode + send through TelemetryProducer to a local broker until every
message is acknowledged. Reports records/s per core (process CPU time) and
wall-clock, and bytes per record on the wire. Targets (issue 10): at least
500k op records/s per core, at most 40 bytes per record.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa  # noqa: E402

from core import topics
from core.kafka_admin import ensure_topics  # noqa: E402
from core.layout import JobLayout  # noqa: E402
from generators.fleetgen import JobSpec, generate_window  # noqa: E402
from ingest.producer import TelemetryProducer, split_for_wire  # noqa: E402
from services.broker import LocalBroker


def batches(n_records: int) -> list[pa.Table]:
    spec = JobSpec("bench", JobLayout(dp_size=32, pp_size=4, tp_size=4), num_microbatches=8)
    one = generate_window(spec, 0, 1, 1_700_000_000_000_000_000)
    out, total = [], 0
    i = 0
    while total < n_records:
        t = one.set_column(one.schema.get_field_index("job_id"), "job_id",
                           pa.array([f"bench-{i % 64}"] * one.num_rows))
        out.append(t)
        total += t.num_rows
        i += 1
    return out


def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    data = batches(args.records)
    n = sum(t.num_rows for t in data)
    print(f"{n:,} op records in {len(data)} batches of {data[0].num_rows:,}")

    sizes = []
    enc = [timed(lambda: sizes.extend(len(p) for t in data for p in split_for_wire(t))) for _ in range(args.repeats)]
    wire = sum(sizes[: len(sizes) // args.repeats])
    print(f"encode  wall {statistics.median(w for w, _ in enc):.3f} s  "
          f"-> {n / statistics.median(c for _, c in enc):,.0f} records/s per core; "
          f"{wire / n:.1f} bytes per record on the wire (target <= 40)")

    with LocalBroker() as broker:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 8)
        runs = []
        for _ in range(args.repeats):
            def send_all():
                with TelemetryProducer(broker.bootstrap, max_queue_bytes=1 << 30) as p:
                    for t in data:
                        p.send(t)
                    assert p.flush(300), "broker did not acknowledge"
                    assert p.stats.records_dropped == 0
            runs.append(timed(send_all))
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"send    wall {wall:.3f} s -> {n / wall:,.0f} records/s wall, {n / cpu:,.0f} records/s per core "
              f"of the producing process (target >= 500,000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
