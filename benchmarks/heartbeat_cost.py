"""What heartbeats every 2 s cost, on the rank and in the pipeline (issue 55: "heartbeats as often as that
needs, cost measured").

    .venv/bin/python benchmarks/heartbeat_cost.py [--ranks 8192] [--beats 2000]

- the rank: CPU time of one heartbeat on the exporter's heartbeat thread (the row, its Arrow IPC
  encoding, and the line handed to the watch), and the watch process's memory and CPU while it listens;
- the pipeline: a shard's hang monitor taking the heartbeats of ``--ranks`` ranks (one job of that size, in
  tables of 256 rows as the producer batches them) and evaluating the job.
Figures are medians of repeated runs in one process; divide by the period for a share of a core.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rank_side(beats: int) -> None:
    from core import codec
    from ingest.exporter import RankExporter
    from ingest.rank_watch import RankWatch

    sent = []
    exp = RankExporter("bench", 0, 0, 0, sent.append, heartbeat_s=3600, use_cuda=False, tcp_flows=False, nvml=False)
    times = []
    for _ in range(beats):
        t0 = time.thread_time_ns()
        codec.encode(exp.heartbeat())
        times.append(time.thread_time_ns() - t0)
    beat_us = statistics.median(times) / 1e3
    print(f"rank: one heartbeat (row + Arrow IPC) {beat_us:.0f} us of CPU: {beat_us / 2e6 * 100:.4f}% of a core "
          f"at one every 2 s (was every 5 s: {beat_us / 5e6 * 100:.4f}%)")
    watch = RankWatch.start(bootstrap="127.0.0.1:9", period_s=2.0, out=os.devnull)
    hb = exp.heartbeat()
    time.sleep(1.0)
    c0 = cpu_s(watch.proc.pid)
    times = []
    for _ in range(beats):
        t0 = time.thread_time_ns()
        watch.beat(hb)
        times.append(time.thread_time_ns() - t0)
    time.sleep(2.0)
    c1 = cpu_s(watch.proc.pid)
    hand_us = statistics.median(times) / 1e3
    print(f"rank: handing a heartbeat to its watch {hand_us:.0f} us of CPU; the watch process holds "
          f"{rss_kb(watch.proc.pid) / 1024:.1f} MB and took {(c1 - c0) * 1e3 / beats:.3f} ms of CPU per heartbeat "
          f"({beats} heartbeats at once; {watch.dropped} dropped for a full pipe)")
    idle0 = cpu_s(watch.proc.pid)
    time.sleep(10)
    print(f"rank: the watch idle (no heartbeats) used {(cpu_s(watch.proc.pid) - idle0) * 1e3:.1f} ms of CPU in 10 s")
    watch.close()
    exp.close()


def pipeline_side(ranks: int) -> None:
    import pyarrow as pa

    from core import codec
    from core import schema as S
    from ray_jobs.hang_monitor import HangReducer

    now = time.time_ns()
    rows = [dict(job_id="big", attempt=0, rank=r, host=f"node-{r // 8:04d}", pid=r, ts_ns=now, step=100,
                 last_op="optimizer", last_op_end_ns=now - 10**8, inflight_op="forward-compute", inflight_group="",
                 inflight_seq=-1, inflight_since_ns=now - 10**7, clock_offset_ns=0, stack="", step_done=99,
                 step_done_ns=now - 10**8, heartbeat_s=2.0, quiet_ns=4 * 10**8) for r in range(ranks)]
    table = codec.from_rows(S.HEARTBEAT, rows)
    batches = [table.slice(i, 256) for i in range(0, ranks, 256)]
    adds, evals = [], []
    for k in range(5):
        mon = HangReducer(every_s=0.0)
        t0 = time.perf_counter()
        for b in batches:
            mon.add_heartbeats(b, float(k))
        adds.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mon.evaluate(float(k) + 1, now + 10**9)
        evals.append(time.perf_counter() - t0)
    add_s, eval_s = statistics.median(adds), statistics.median(evals)
    print(f"pipeline: {ranks} ranks' heartbeats taken in {add_s * 1e3:.0f} ms ({add_s / ranks * 1e6:.1f} us each), "
          f"the job evaluated in {eval_s * 1e3:.1f} ms; at one heartbeat per rank every 2 s that is "
          f"{add_s / 2 * 100:.1f}% of a shard's core for {ranks} GPUs (every 5 s: {add_s / 5 * 100:.1f}%)")
    del pa


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8192)
    p.add_argument("--beats", type=int, default=2000)
    a = p.parse_args()
    rank_side(a.beats)
    pipeline_side(a.ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
