"""What the automatic instrumentation costs a training step (issue 17, item 6).

    .venv/bin/python benchmarks/trace_overhead.py [--pairs 3] [--steps 80]

The CPU pipelining job of the tests (torch.distributed.pipelining, 1F1B, DP2 x
PP2, 4 ranks, simulated accelerator time by sleeps) runs with torchrun, bare
and armed as `stragglerscope trace` arms it (exporting to a local Tansu
broker), alternating bare / 10% sampling / 100% sampling / 100% without the
path probe (``--probe-kb 0``), ``--pairs`` times. At 100% every step is a
window, so the probe sends its 256 KB every step: its worst case (at the
default 10/100, once in 100 steps).
Prints the median step time of each (rank 0, steps after the first 10 of
every run: at least 30 steps each) and the ratios to bare, and rank 0's median
CPU time per step (every thread of the process: steadier than wall time on a
shared machine, and what the instrumentation adds whether or not it delays the
step). Target: at most 1% wall at the default 10% sampling.
"""
from __future__ import annotations

import argparse
import statistics
import uuid

from traced_runs import run

from core import topics
from core.kafka_admin import ensure_topics
from services.broker import LocalBroker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="rounds of bare / 10%% / 100%% / 100%% without the probe")
    p.add_argument("--steps", type=int, default=80, help="steps per run (the first 10 are dropped)")
    p.add_argument("--gpu-ms", type=float, default=10.0)
    a = p.parse_args()
    args = ["--steps", str(a.steps), "--gpu-ms", str(a.gpu_ms)]
    configs = (("bare", None, 0), ("10%", "10/100", 256), ("100%", "1/1", 256), ("100%-np", "1/1", 0))
    times: dict[str, list[float]] = {name: [] for name, *_ in configs}
    cpu: dict[str, list[float]] = {name: [] for name, *_ in configs}
    with LocalBroker() as b:
        ensure_topics(b.bootstrap, topics.INPUT_TOPICS, 4)
        for i in range(a.pairs):
            for name, sample, probe_kb in configs:
                kw = {} if sample is None else dict(bootstrap=b.bootstrap, job_id=f"ovh-{uuid.uuid4().hex[:6]}",
                                                    sample=sample, probe_kb=probe_kb)
                out = run("pipelining", 4, args, **kw)
                st, ct = out["step_times"][10:], out["cpu_times"][10:]
                times[name] += st
                cpu[name] += ct
                print(f"round {i + 1} {name:>7}: median step {statistics.median(st) * 1e3:.2f} ms, "
                      f"CPU {statistics.median(ct) * 1e3:.2f} ms over {len(st)} steps", flush=True)
    base, cbase = statistics.median(times["bare"]), statistics.median(cpu["bare"])
    print(f"\n{'run':>7} {'steps':>6} {'median ms':>10} {'vs bare':>8} {'CPU ms':>7} {'CPU vs bare':>12}")
    for name, st in times.items():
        m, c = statistics.median(st), statistics.median(cpu[name])
        print(f"{name:>7} {len(st):>6} {m * 1e3:>10.2f} {m / base - 1:>+8.2%} {c * 1e3:>7.2f} {(c - cbase) * 1e3:>+9.2f} ms")


if __name__ == "__main__":
    main()
