"""Fleet soak: many concurrent generated jobs through the whole pipeline, for a bounded time.

    .venv/bin/python benchmarks/fleet_soak.py [--jobs 1000] [--minutes 30] [--session-every-s 600]
        [--gpus MIN,MAX] [--cluster RAY_NODES,CH_SHARDS,CH_REPLICAS]

Embedded services (Tansu, the chDB store behind its daemon, a local Ray with
the configured shard actors); with ``--cluster``, a multi-node Ray cluster on
127.0.0.1 (``services/ray_cluster.py``) and a ClickHouse cluster of real
servers (replicated through a local ZooKeeper when it has replicas) instead.
``--jobs`` generated jobs of 128 to 8,192 GPUs (``--gpus``; log-uniform,
mixed straggler causes) each publish one profiling session (a window of 3
steps) every ``--session-every-s`` seconds on average, NDTimeline-like, as
Poisson arrivals from the start, until ``--minutes`` have passed (counted
from when the services are up). Every
straggling window raises an alert (cool-down 0 here, so each one counts).

Reported every 30 s and at the end: windows published and stored, consumer
lag, window latency (last record sent -> window row stored) and alert latency
(last record sent -> alert row stored) as p50/p99, and the memory of the whole
machine in use (MemTotal - MemAvailable), which must stay flat.
Target (issue 4): alert latency p99 <= 5 s; flat memory; bounded lag.

Also reported, for the capacity model (infra/CAPACITY.md): CPU seconds by
role (generator, broker, shards, analysis, store, Ray) per stored window, and
on a ClickHouse server store, data parts written per second (blocks inserted
into MergeTree tables, replica fetches apart) and active parts.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import heapq
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

WARMUP_S = 120.0
"""Windows sent in the first two minutes meet a pipeline that is still starting (reported apart at the end)."""
LOOKBACK_S = 300.0
"""Each report reads the windows and alerts stamped from this long before the newest one seen."""

# First match wins. A Ray worker's title says what it runs now (ray::analyze_window, ray::IDLE): every worker
# that is not a shard counts as analysis, so one pid keeps one role. "ray" is Ray itself (GCS, raylets, agents).
ROLES = (("shards", "ray::ShardActor"), ("analysis", "ray::"), ("store", "-m storage.daemon"),
         ("broker", "tansu"), ("store", "clickhouse"), ("zookeeper", "zookeeper"), ("ray", "/ray/"))


def _proc_table() -> list[tuple[int, str, float, float]]:
    """(pid, command line, resident MB, CPU seconds) of every process we can read: one scan of /proc."""
    out = []
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
            # utime and stime are fields 14 and 15; the command name (field 2) may hold spaces, so split after it.
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        out.append((int(pid), cmd, rss / 1024, (int(stat[11]) + int(stat[12])) / tick))
    return out


def role_of(pid: int, cmd: str) -> str | None:
    if pid == os.getpid():
        return "soak"
    return next((role for role, needle in ROLES if needle in cmd), None)


class CpuByRole:
    """CPU seconds used by each role since the first sample. Processes that exit between samples (Ray's idle
    workers come and go) keep what they had used at their last sample: a small undercount, never an overcount."""

    def __init__(self):
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self.sample(_proc_table())
        self._first = {pid: cpu for pid, (_, cpu) in self._last.items()}

    def sample(self, procs) -> dict[str, float]:
        for pid, cmd, _rss, cpu in procs:
            role = role_of(pid, cmd)
            if role:
                self._last[pid] = (role, cpu)
        out: dict[str, float] = {}
        for pid, (role, cpu) in self._last.items():
            out[role] = out.get(role, 0.0) + cpu - self._first.get(pid, 0.0)
        return out


class ServerParts:
    """Data parts written by the ClickHouse servers of a cluster store: blocks inserted into MergeTree tables
    (each one a new part of level 0), replica fetches (a replica copying a part written on another), and the
    active parts now (merges keeping up keep it bounded)."""

    def __init__(self, servers):
        from clickhouse_driver import Client

        self._clients = [Client("127.0.0.1", port=s.tcp_port, user=s.user, password=s.password) for s in servers]
        self.start = self.counts()

    def counts(self) -> tuple[int, int, int]:
        written = fetched = active = 0
        for c in self._clients:
            ev = dict(c.execute("SELECT event, value FROM system.events WHERE event IN "
                                "('MergeTreeDataWriterBlocks', 'ReplicatedPartFetches')"))
            written += ev.get("MergeTreeDataWriterBlocks", 0)
            fetched += ev.get("ReplicatedPartFetches", 0)
            active += c.execute("SELECT count() FROM system.parts WHERE active AND database NOT IN ('system')")[0][0]
        return written, fetched, active


def rss_by_role_mb(procs) -> dict[str, float]:
    """Resident memory of our processes by role (``_proc_table``), to say which one grows."""
    out = dict.fromkeys([role for role, _ in ROLES] + ["soak"], 0.0)
    for pid, cmd, rss, _cpu in procs:
        role = role_of(pid, cmd)
        if role:
            out[role] += rss
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
    ap.add_argument("--cluster", default="", metavar="RAY_NODES,CH_SHARDS,CH_REPLICAS",
                    help="run on a multi-node Ray cluster on 127.0.0.1 (2 CPUs per node) and a ClickHouse cluster "
                         "of real servers (e.g. 2,2,2), instead of the local Ray and chDB")
    args = ap.parse_args()

    import tempfile

    from core.config import load
    from core.layout import JobLayout
    from generators.fleetgen import generate_window, make_fleet
    from ingest.producer import TelemetryProducer
    from stragglerscope.service import start_services

    tmp = tempfile.mkdtemp(prefix="ss-soak-")
    # Settings from STRAGGLERSCOPE_<SECTION>_<KEY> apply (e.g. STRAGGLERSCOPE_PIPELINE_MAX_INFLIGHT=8).
    cfg = load().replace(store={"url": args.store or f"chdb://{tmp}/store"},
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
    sent_at: dict[tuple, int] = {}
    window_of = [0] * len(jobs)
    mem0 = mem_used_mb()
    cluster_stack = contextlib.ExitStack()
    parts = None
    if args.cluster:
        nodes, ch_shards, ch_replicas = (int(x) for x in args.cluster.split(","))
        cfg, parts = start_clusters(cfg, cluster_stack, nodes, ch_shards, ch_replicas)
    cpu = CpuByRole()
    print(f"{len(jobs)} jobs, {sum(j.n_gpus for j in jobs):,} GPUs, sizes {min(j.n_gpus for j in jobs)}-"
          f"{max(j.n_gpus for j in jobs)}; one session per job every {args.session_every_s:.0f} s on average; "
          f"{args.minutes:.0f} min", flush=True)
    with cluster_stack, contextlib.ExitStack() as stack:
        svc = start_services(cfg, stack)
        prod = stack.enter_context(TelemetryProducer(svc.cfg.kafka.conn(), client_id="soak",
                                                     max_queue_bytes=512 << 20))
        for j in jobs:
            prod.send(j.registration(time.time_ns(), 3))
        # The clock starts once the services are up (a cluster takes a minute to start): --minutes of load.
        t_end = time.monotonic() + args.minutes * 60
        warm_ns = time.time_ns() + int(WARMUP_S * 1e9)  # windows sent before this meet a pipeline still starting
        # Sessions of a job are a Poisson process (exponential gaps), and so is its first one: a steady fleet
        # from the first second. (A uniform first phase over one mean gap, as before 2026-11-23, doubled the
        # rate in minutes 5-10: every job's first session plus the second of those that started early.)
        next_session = [(time.monotonic() + float(rng.exponential(args.session_every_s)), j)
                        for j in range(len(jobs))]
        heapq.heapify(next_session)
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
                # Only recent rows: the soak's own reads stay small, so the store's CPU below is the
                # pipeline's, not this report's. A window is stored a commit or two after its analysis, and
                # shards commit independently, so the look-back reaches well before the newest row seen.
                since = max(seen_windows.values(), default=0) - int(LOOKBACK_S * 1e9)
                w = svc.store.query("SELECT job_id, attempt, window_id, analyzed_ns FROM windows "
                                    "WHERE startsWith(job_id, 'soak-') AND analyzed_ns >= {t:Int64}", {"t": since})
                for k0, k1, k2, ts in zip(*(w[c].to_pylist() for c in w.column_names)):
                    seen_windows.setdefault((k0, k1, k2), ts)
                a = svc.store.query("SELECT alert_id, job_id, ts_ns FROM alerts WHERE rule = 'slowdown' "
                                    "AND startsWith(job_id, 'soak-') AND ts_ns >= {t:Int64}",
                                    {"t": max(seen_alerts.values(), default=0) - int(LOOKBACK_S * 1e9)})
                for aid, ts in zip(a["alert_id"].to_pylist(), a["ts_ns"].to_pylist()):
                    seen_alerts.setdefault(aid, ts)
                wl = latencies(sent_at, seen_windows)
                recent = latencies(sent_at, seen_windows, since_ns=time.time_ns() - 60 * 10**9)
                al = latencies(sent_at, alert_windows(seen_alerts))
                status = svc.pipeline.status()
                lag = sum(s.get("lag", 0) for s in status)
                loop_max = max((s.get("loop_seconds_max", 0.0) for s in status), default=0.0)
                mem = mem_used_mb()
                procs = _proc_table()
                rss = rss_by_role_mb(procs)
                mem_samples.append(mem)
                by_role = cpu.sample(procs)
                store_parts = ""
                if parts:
                    written, fetched, active = parts.counts()
                    elapsed = args.minutes * 60 - (t_end - now)
                    store_parts = (f"parts written {(written - parts.start[0]) / elapsed:.1f}/s, fetched "
                                   f"{(fetched - parts.start[1]) / elapsed:.1f}/s, active {active} ")
                print(f"t={args.minutes * 60 - (t_end - now):6.0f}s published={published} ({ops_sent:,} ops) "
                      f"stored={len(seen_windows)} lag={lag} window p50/p99={pct(wl, 50):.2f}/{pct(wl, 99):.2f}s "
                      f"(last 60 s: {pct(recent, 50):.2f}/{pct(recent, 99):.2f}s) "
                      f"alerts={len(al)} p50/p99={pct(al, 50):.2f}/{pct(al, 99):.2f}s "
                      f"mem={mem:,.0f} MB (+{mem - mem0:,.0f}) longest loop {loop_max:.1f}s {store_parts}"
                      "cpu s " + " ".join(f"{k}={v:,.0f}" for k, v in sorted(by_role.items())) + " "
                      "rss MB " + " ".join(f"{k}={v:,.0f}" for k, v in rss.items())
                      + (f" topic generations deleted {len(svc.generations.deleted)}" if svc.generations else ""),
                      flush=True)
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
        by_role = cpu.sample(_proc_table())
        n = max(1, len(seen_windows))
        print(f"CPU seconds per stored window ({len(seen_windows)} windows): "
              + ", ".join(f"{k} {v / n:.3f}" for k, v in sorted(by_role.items(), key=lambda kv: -kv[1]))
              + f"; all {sum(by_role.values()) / n:.3f}")
    return 0


def start_clusters(cfg, stack: contextlib.ExitStack, nodes: int, ch_shards: int, ch_replicas: int):
    """A Ray cluster of ``nodes`` two-CPU nodes and a ClickHouse cluster (with a ZooKeeper when replicated), all
    on 127.0.0.1; ``cfg`` pointed at them, and the parts counter of the ClickHouse servers."""
    from services.clickhouse_server import ClickHouseCluster, find_server_binary
    from services.ray_cluster import LocalRayCluster
    from services.zookeeper import LocalZooKeeper, zookeeper_installed

    if not find_server_binary() or (ch_replicas > 1 and not zookeeper_installed()):
        sys.exit("--cluster needs clickhouse-server (and zookeeper for replicas): make setup-test installs both")
    zk_port = stack.enter_context(LocalZooKeeper()).port if ch_replicas > 1 else None
    ch = stack.enter_context(ClickHouseCluster(shards=ch_shards, replicas=ch_replicas, zookeeper_port=zk_port))
    ray_cluster = stack.enter_context(LocalRayCluster(nodes=nodes, cpus_per_node=2, object_store_mb=300))
    print(f"Ray cluster of {nodes} nodes x 2 CPUs at {ray_cluster.address}; ClickHouse cluster of {ch_shards} "
          f"shards x {ch_replicas} replicas at {ch.url}", flush=True)
    return cfg.replace(ray={"address": ray_cluster.address}, store={"url": ch.url}), ServerParts(ch.servers)


if __name__ == "__main__":
    sys.exit(main())
