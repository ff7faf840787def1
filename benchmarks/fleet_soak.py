"""Fleet soak: many concurrent generated jobs through the whole pipeline, for a bounded time.

    .venv/bin/python benchmarks/fleet_soak.py [--jobs 1000] [--minutes 30] [--session-every-s 600]

Embedded services (Tansu, the chDB store behind its daemon, a local Ray with
the configured shard actors). ``--jobs`` generated jobs of 128 to 8,192 GPUs
(log-uniform, mixed straggler causes) each publish one profiling session
(a window of 3 steps) every ``--session-every-s`` seconds on average,
NDTimeline-like, as Poisson arrivals from the start, until ``--minutes`` have passed. Every
straggling window raises an alert (cool-down 0 here, so each one counts).

Reported every 30 s and at the end: windows published and stored, consumer
lag, window latency (last record sent -> window row stored) and alert latency
(last record sent -> alert row stored) as p50/p99, and the memory of the whole
machine in use (MemTotal - MemAvailable), which must stay flat.
Target (issue 4): alert latency p99 <= 5 s; flat memory; bounded lag.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import heapq
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

WARMUP_S = 120.0
"""Windows sent in the first two minutes meet a pipeline that is still starting (reported apart at the end)."""

# First match wins: the specific needles before the catch-all "ray" (raylet, GCS, idle workers, agents).
ROLES = (("shards", "ray::ShardActor"), ("analysis", "ray::analyze_window"), ("store", "-m storage.daemon"),
         ("broker", "tansu"), ("ray", "/ray/"), ("ray", "ray::"))


def rss_by_role_mb() -> dict[str, float]:
    """Resident memory of our processes by role (from /proc), to say which one grows."""
    import os

    out = {role: 0.0 for role, _ in ROLES}
    out["soak"] = 0.0
    me = os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            continue
        if int(pid) == me:
            out["soak"] += rss / 1024
            continue
        for role, needle in ROLES:
            if needle in cmd:
                out[role] += rss / 1024
                break
    return out


def mem_used_mb() -> float:
    info = {}
    for line in open("/proc/meminfo"):
        k, v = line.split(":")
        info[k] = int(v.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def latencies(sent_at: dict, stored_at: dict, since_ns: int = 0) -> list[float]:
    """Seconds from each window's last record sent to its row stored, for windows sent since ``since_ns``."""
    return [(ts - sent_at[k]) / 1e9 for k, ts in stored_at.items() if sent_at.get(k, -1) >= since_ns]


def alert_windows(alerts: dict[str, int]) -> dict[tuple, int]:
    """{(job, attempt, window): alert time} from alert ids ``job/attempt/rule/window``."""
    out = {}
    for aid, ts in alerts.items():
        job, att, _, wid = aid.split("/")
        out[(job, int(att), int(wid))] = ts
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--session-every-s", type=float, default=600.0)
    ap.add_argument("--store", default="", help="store URL (default: a fresh chDB store in a temp dir)")
    ap.add_argument("--gpus", default="128,8192", metavar="MIN,MAX",
                    help="job sizes, log-uniform between MIN and MAX GPUs (powers of two; TP 8 from 64 GPUs up)")
    args = ap.parse_args()

    import tempfile

    from core.config import Config
    from core.layout import JobLayout
    from generators.fleetgen import generate_window, make_fleet
    from ingest.producer import TelemetryProducer
    from stragglerscope.service import start_services

    tmp = tempfile.mkdtemp(prefix="ss-soak-")
    cfg = Config().replace(store={"url": args.store or f"chdb://{tmp}/store"},
                           alerts={"cooldown_s": 0.0}, pipeline={"metrics_port": -1},
                           # The soak's own progress reads list every window: more rows than an analyst's query.
                           sql={"max_result_rows": 10_000_000, "max_execution_time_s": 300.0})
    rng = np.random.default_rng(0)
    lo, hi = (int(x) for x in args.gpus.split(","))
    causes = make_fleet(args.jobs, seed=11, min_gpus=lo, max_gpus=hi)
    jobs = []
    for i, spec in enumerate(causes):
        n = int(2 ** rng.uniform(np.log2(lo), np.log2(hi)))
        n = 1 << int(round(np.log2(n)))
        # The default sizes draw exactly as before (TP 8, PP 2-8); small jobs get what fits.
        tp = 8 if n >= 64 else max(1, n // 4)
        pp = int(rng.choice([p for p in (2, 4, 8) if tp * p <= n] or [1]))
        dp = max(1, n // (tp * pp))
        jobs.append(dataclasses.replace(spec, job_id=f"soak-{i:04d}", layout=JobLayout(dp, pp, tp),
                                        num_microbatches=2 * pp, cause_dp=int(rng.integers(dp)),
                                        cause_pp=int(rng.integers(pp))))
    t_end = time.monotonic() + args.minutes * 60
    warm_ns = time.time_ns() + int(WARMUP_S * 1e9)  # windows sent before this meet a pipeline still starting
    sent_at: dict[tuple, int] = {}
    # Sessions of a job are a Poisson process (exponential gaps), and so is its first one: a steady fleet
    # from the first second. (A uniform first phase over one mean gap, as before 2026-11-23, doubled the
    # rate in minutes 5-10: every job's first session plus the second of those that started early.)
    next_session = [(time.monotonic() + float(rng.exponential(args.session_every_s)), j) for j in range(len(jobs))]
    heapq.heapify(next_session)
    window_of = [0] * len(jobs)
    mem0 = mem_used_mb()
    print(f"{len(jobs)} jobs, {sum(j.n_gpus for j in jobs):,} GPUs, sizes {min(j.n_gpus for j in jobs)}-"
          f"{max(j.n_gpus for j in jobs)}; one session per job every {args.session_every_s:.0f} s on average; "
          f"{args.minutes:.0f} min", flush=True)
    with contextlib.ExitStack() as stack:
        svc = start_services(cfg, stack)
        prod = stack.enter_context(TelemetryProducer(svc.cfg.kafka.bootstrap, client_id="soak",
                                                     max_queue_bytes=512 << 20))
        for j in jobs:
            prod.send(j.registration(time.time_ns(), 3))
        last_report = time.monotonic()
        seen_windows: dict[tuple, int] = {}
        seen_alerts: dict[str, int] = {}
        published = ops_sent = 0
        mem_samples = []
        while time.monotonic() < t_end:
            now = time.monotonic()
            while next_session and next_session[0][0] <= now:
                _, j = heapq.heappop(next_session)
                spec = jobs[j]
                wid = window_of[j]
                window_of[j] += 100
                table = generate_window(spec, wid, 3, time.time_ns())
                prod.send(table)
                sent_at[(spec.job_id, 0, wid)] = time.time_ns()
                published += 1
                ops_sent += table.num_rows
                heapq.heappush(next_session, (now + float(rng.exponential(args.session_every_s)), j))
            if now - last_report >= 30 or now >= t_end:
                last_report = now
                w = svc.store.query("SELECT job_id, attempt, window_id, analyzed_ns FROM windows "
                                    "WHERE startsWith(job_id, 'soak-')")
                for k0, k1, k2, ts in zip(*(w[c].to_pylist() for c in w.column_names)):
                    seen_windows.setdefault((k0, k1, k2), ts)
                a = svc.store.query("SELECT alert_id, job_id, ts_ns FROM alerts WHERE rule = 'slowdown' "
                                    "AND startsWith(job_id, 'soak-')")
                for aid, ts in zip(a["alert_id"].to_pylist(), a["ts_ns"].to_pylist()):
                    seen_alerts.setdefault(aid, ts)
                wl = latencies(sent_at, seen_windows)
                recent = latencies(sent_at, seen_windows, since_ns=time.time_ns() - 60 * 10**9)
                al = latencies(sent_at, alert_windows(seen_alerts))
                status = svc.pipeline.status()
                lag = sum(s.get("lag", 0) for s in status)
                loop_max = max((s.get("loop_seconds_max", 0.0) for s in status), default=0.0)
                mem = mem_used_mb()
                rss = rss_by_role_mb()
                mem_samples.append(mem)
                print(f"t={args.minutes * 60 - (t_end - now):6.0f}s published={published} ({ops_sent:,} ops) "
                      f"stored={len(seen_windows)} lag={lag} window p50/p99={pct(wl, 50):.2f}/{pct(wl, 99):.2f}s "
                      f"(last 60 s: {pct(recent, 50):.2f}/{pct(recent, 99):.2f}s) "
                      f"alerts={len(al)} p50/p99={pct(al, 50):.2f}/{pct(al, 99):.2f}s "
                      f"mem={mem:,.0f} MB (+{mem - mem0:,.0f}) longest loop {loop_max:.1f}s "
                      f"rss MB " + " ".join(f"{k}={v:,.0f}" for k, v in rss.items()), flush=True)
            time.sleep(0.05)
        half = len(mem_samples) // 2
        if half:
            print(f"memory: first half median {np.median(mem_samples[:half]):,.0f} MB, second half median "
                  f"{np.median(mem_samples[half:]):,.0f} MB")
        # Whole-run percentiles include the start-up backlog (Ray workers starting, first imports): also
        # give them for windows sent after the warm-up.
        wl = latencies(sent_at, seen_windows, since_ns=warm_ns)
        al = latencies(sent_at, alert_windows(seen_alerts), since_ns=warm_ns)
        print(f"sent after the first {WARMUP_S:.0f} s: {len(wl)} windows p50/p99={pct(wl, 50):.2f}/{pct(wl, 99):.2f}s, "
              f"{len(al)} alerts p50/p99={pct(al, 50):.2f}/{pct(al, 99):.2f}s")
        print(f"dropped by the producer: {prod.stats.records_dropped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
