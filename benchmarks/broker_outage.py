"""A broker outage of a minute: nothing lost, nothing twice, and no time taken from training.

    .venv/bin/python benchmarks/broker_outage.py [--outage-s 60] [--step-ms 50]

A training-like loop (a fixed numpy matmul per "forward" and "backward" of
every microbatch, about ``--step-ms`` per step) runs under a real
``RankExporter`` + ``TelemetryProducer`` that profiles every step (the worst
case: a batch per step) against the local Tansu broker. After a warm phase
the broker is stopped for ``--outage-s`` seconds and started again on the
same port (Tansu keeps data in memory, so it comes back empty: exactly the
batches produced during the outage must then arrive, once each, oldest first).

Within every phase, blocks of 10 steps alternate between exporter on and
off (bare loop), so each phase has its own baseline taken at the same time
and under the same machine load. Prints per phase the medians of both and
their ratio, what the producer sent, spooled and dropped, and whether the
consumer saw every outage step exactly once in order. One BLAS thread, as a
training process pinned to its core would have.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from core import (
    codec,  # noqa: E402
    topics,
)
from core.kafka_admin import ensure_topics  # noqa: E402
from ingest.exporter import RankExporter, Sampling  # noqa: E402
from ingest.producer import TelemetryProducer  # noqa: E402
from ray_jobs.kafka_source import KafkaSource  # noqa: E402
from services.broker import LocalBroker

MICROBATCHES = 4


def _work(a: np.ndarray, n: int) -> None:
    for _ in range(n):
        a @ a


def calibrate(step_ms: float, a: np.ndarray) -> int:
    """Matmuls per op so that a step (2 x MICROBATCHES ops) takes about ``step_ms``."""
    t0 = time.perf_counter()
    _work(a, 20)
    per = (time.perf_counter() - t0) / 20
    return max(1, round(step_ms / 1e3 / (2 * MICROBATCHES) / per))


def train_steps(exp: RankExporter, first: int, until: float, a: np.ndarray, n: int,
                block: int = 10) -> tuple[list[float], list[float], int]:
    """Steps until the monotonic deadline, alternating blocks with the exporter on and off.

    Returns the durations of exporter-on steps, of bare steps, and the next
    step number (only exporter-on steps are numbered: they are what is sent).
    """
    on, off, step, i = [], [], first, 0
    while time.monotonic() < until:
        t0 = time.perf_counter()
        if (i // block) % 2:
            for _ in range(2 * MICROBATCHES):
                _work(a, n)
            off.append(time.perf_counter() - t0)
        else:
            with exp.step(step):
                for mb in range(MICROBATCHES):
                    with exp.op("forward-compute", mb_id=mb):
                        _work(a, n)
                for mb in range(MICROBATCHES):
                    with exp.op("backward-compute", mb_id=mb):
                        _work(a, n)
            on.append(time.perf_counter() - t0)
            step += 1
        i += 1
    return on, off, step


def consumed_steps(bootstrap: str, job: str, want: int, timeout_s: float = 60.0) -> list[int]:
    src = KafkaSource(bootstrap, [topics.TOPIC_OPS], range(2))
    src.seek({})
    steps: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(steps) < want:
        for m in src.poll(300):
            _, t = codec.decode(m.value)
            if t["job_id"][0].as_py() == job:
                steps.extend(sorted(set(t["step"].to_pylist())))
    src.close()
    return steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outage-s", type=float, default=60.0, help="how long the broker is down")
    p.add_argument("--phase-s", type=float, default=20.0, help="length of the phases before and after the outage")
    p.add_argument("--step-ms", type=float, default=50.0, help="target step time of the loop")
    args = p.parse_args(argv)

    a = np.random.default_rng(0).standard_normal((96, 96)).astype(np.float32)
    n = calibrate(args.step_ms, a)
    job = f"outage-bench-{uuid.uuid4().hex[:6]}"
    broker = LocalBroker().start()
    port = broker.port
    spool = tempfile.mkdtemp(prefix="ss-outage-spool-")
    try:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        prod = TelemetryProducer(broker.bootstrap, spool_dir=spool, retry_s=1.0, delivery_timeout_s=5.0)
        exp = RankExporter(job, 0, 0, 0, prod.send, sampling=Sampling(1, 1), heartbeat_s=1.0, use_cuda=False)
        phases = {}
        phases["broker up"] = train_steps(exp, 0, time.monotonic() + args.phase_s, a, n)
        step = phases["broker up"][2]
        prod.flush(30)
        print(f"broker stopped for {args.outage_s:.0f} s ...", file=sys.stderr)
        broker.stop()
        first_outage = step
        phases[f"broker down {args.outage_s:.0f} s"] = train_steps(exp, step, time.monotonic() + args.outage_s, a, n)
        step = phases[f"broker down {args.outage_s:.0f} s"][2]
        broker = LocalBroker(port=port).start()
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        print("broker back; training goes on while the spool replays ...", file=sys.stderr)
        phases["broker back (replaying)"] = train_steps(exp, step, time.monotonic() + args.phase_s, a, n)
        step = phases["broker back (replaying)"][2]
        sent_steps = list(range(first_outage, step))
        exp.close()
        t_drain = time.monotonic()
        prod.close(120)
        drain_s = time.monotonic() - t_drain
        got = consumed_steps(broker.bootstrap, job, len(sent_steps))
        st = prod.stats
    finally:
        broker.stop()

    def med(x: list[float]) -> float:
        return statistics.median(x) * 1e3

    print(f"\nloop: {2 * MICROBATCHES} ops of {n} matmuls (96x96) per step, every exporter-on step profiled "
          "(a batch per step), blocks of 10 steps alternating on/off")
    print(f"{'phase':<26}{'on steps':>9}{'on ms':>8}{'off steps':>10}{'off ms':>8}{'on/off':>8}")
    for name, (on, off, _) in phases.items():
        print(f"{name:<26}{len(on):>9}{med(on):>8.2f}{len(off):>10}{med(off):>8.2f}{med(on) / med(off):>8.3f}")
    lost = sorted(set(sent_steps) - set(got))
    twice = len(got) - len(set(got))
    in_order = got == sorted(got)
    print(f"\nproducer: {st.batches_sent} batches sent, {st.batches_spooled} spooled, "
          f"{st.records_dropped} records dropped; close() drained in {drain_s:.1f} s")
    print(f"consumer after the outage: {len(got)} step batches, missing {len(lost)}, duplicated {twice}, "
          f"oldest first: {in_order}")
    return 0 if not lost and not twice and in_order and st.records_dropped == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
