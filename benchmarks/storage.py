"""Storage benchmark: a year of a 3,000-job fleet through the Store API, on chDB and on the server.

    .venv/bin/python benchmarks/storage.py                      # both backends, 10.5M windows
    .venv/bin/python benchmarks/storage.py --backends chdb --windows 2000000 --repeat 3

Data (synthetic, vectorised numpy, fixed seed): ``--windows`` window results
of ``--jobs`` jobs spread over 365 days, written month by month as the
pipeline would (op-type rows of a sample of windows and their waste rows
first, then the windows: ``insert`` checks keys). Then every named
query runs ``--repeat`` times after one warm-up run; the table shows the
median. Data lives in a temporary directory that is removed at the end.

Targets (chDB): insert at least 1M window rows/s, every named query at most 1 s.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzers.whatif.gpu_hours import wasted_gpu_hours  # noqa: E402
from core import schema as S  # noqa: E402
from storage import NAMED_QUERIES, open_store  # noqa: E402

YEAR_START_NS = 1_704_067_200 * 10**9  # 2024-01-01T00:00:00Z
DAY_NS = 86_400 * 10**9
OPTYPES = ("forward-compute", "backward-compute", "optimizer", "forward-pp-comm", "backward-pp-comm",
           "grads-reduce-scatter")
VERDICTS = ("", "worker", "stage", "sequence_imbalance", "gc", "communication")


def _strings(values: np.ndarray, idx: np.ndarray) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(idx.astype(np.int32)), pa.array(values)).cast(pa.string())


class Fleet:
    """The jobs of the fleet: owner, model, size and how much each one straggles."""

    def __init__(self, n_jobs: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.n = n_jobs
        self.rng = rng
        self.names = np.array([f"job-{i:05d}" for i in range(n_jobs)], dtype=object)
        self.team = rng.integers(0, 30, n_jobs)
        self.model = rng.integers(0, 20, n_jobs)
        self.gpus = (2 ** rng.integers(3, 12, n_jobs)).astype(np.int32)
        self.base_s = 1.0 + rng.gamma(1.2, 0.08, n_jobs)
        self.teams = np.array([f"team-{i:02d}" for i in range(30)], dtype=object)
        self.models = np.array([f"model-{i:02d}" for i in range(20)], dtype=object)

    def windows(self, first_index: int, n: int, t0_ns: int, t1_ns: int) -> pa.Table:
        rng = self.rng
        job = rng.integers(0, self.n, n)
        analyzed = np.sort(rng.integers(t0_ns, t1_ns, n)).astype(np.int64)
        wid = (np.arange(first_index, first_index + n, dtype=np.int64)) * 10
        steps = np.full(n, 10, np.int32)
        s = self.base_s[job] * (1.0 + rng.exponential(0.02, n))
        ideal = rng.uniform(0.5, 5.0, n)
        sim = ideal * s
        actual = sim * rng.uniform(1.0, 1.05, n)
        wall_h = actual * steps / 3600.0
        gpu_h = wall_h * self.gpus[job]
        waste = 1.0 - 1.0 / s
        verdict = np.where(s > 1.1, rng.integers(1, len(VERDICTS), n), 0)
        cols = {
            "job_id": _strings(self.names, job), "attempt": pa.array(np.zeros(n, np.int32)), "window_id": wid,
            "first_step": wid, "last_step": wid + 9, "n_steps": steps,
            "start_ns": analyzed - (actual * steps * 1e9).astype(np.int64) - 60 * 10**9,
            "end_ns": analyzed - 60 * 10**9, "analyzed_ns": analyzed,
            "team": _strings(self.teams, self.team[job]), "model": _strings(self.models, self.model[job]),
            "n_gpus": self.gpus[job], "dp_size": self.gpus[job] // 8, "pp_size": np.full(n, 8, np.int32),
            "slowdown": s, "launch_slowdown": actual / sim, "waste_fraction": waste, "step_time_actual": actual,
            "step_time_sim": sim, "step_time_ideal": ideal, "gpu_hours": gpu_h, "wasted_gpu_hours": gpu_h * waste,
            "m_w": rng.uniform(0, 1, n), "m_s": rng.uniform(0, 1, n),
            "verdict": _strings(np.array(VERDICTS, dtype=object), verdict),
            "verdicts_json": _strings(np.array(["[]", '[{"kind":"worker"}]'], dtype=object), (verdict > 0) * 1),
            "complete": rng.random(n) > 0.02, "note": _strings(np.array([""], dtype=object), np.zeros(n, int)),
            "n_ops": (self.gpus[job].astype(np.int64) * 400),
            "mfu": rng.uniform(0.2, 0.5, n) / s * s, "mfu_ideal": rng.uniform(0.2, 0.5, n),
        }
        cols["mfu"] = cols["mfu_ideal"] / s
        arrays = [pa.array(cols[f.name]).cast(f.type) if not isinstance(cols[f.name], pa.Array)
                  else cols[f.name].cast(f.type) for f in S.WINDOW]
        return pa.Table.from_arrays(arrays, schema=S.WINDOW)

    def optypes(self, windows: pa.Table, fraction: float) -> pa.Table:
        rng = self.rng
        pick = np.flatnonzero(rng.random(windows.num_rows) < fraction)
        k = len(OPTYPES)
        take = np.repeat(pick, k)
        base = windows.column("slowdown").to_numpy()[take]
        s_t = 1.0 + (base - 1.0) * rng.uniform(0.0, 1.0, len(take))
        return pa.Table.from_arrays([
            windows.column("job_id").take(pa.array(take)), windows.column("attempt").take(pa.array(take)),
            windows.column("window_id").take(pa.array(take)), pa.array(np.full(len(take), -1, np.int64)),
            _strings(np.array(OPTYPES, dtype=object), np.tile(np.arange(k), len(pick))), pa.array(s_t),
        ], schema=S.OPTYPE_SLOWDOWN)


    @staticmethod
    def waste(windows: pa.Table, optypes: pa.Table) -> pa.Table:
        """The OPTYPE_WASTE rows the analysis writes with each window (``analyzers.window.optype_waste``),
        vectorised: each op-type row with its window's GPU-hours and owner."""
        key = ["job_id", "attempt", "window_id"]
        owner = windows.select(key + ["analyzed_ns", "team", "model", "n_gpus", "gpu_hours"])
        j = optypes.join(owner, keys=key, join_type="inner", use_threads=False)
        wasted = wasted_gpu_hours(j["gpu_hours"].to_numpy(), j["slowdown"].to_numpy())
        return pa.Table.from_arrays([j[f.name] if f.name != "wasted_gpu_hours" else pa.array(wasted)
                                     for f in S.OPTYPE_WASTE], schema=S.OPTYPE_WASTE)


class Phases:
    """Seconds spent in each part of ``Store.insert`` (it wraps the store's own steps; a benchmark may peek)."""

    def __init__(self, store) -> None:
        self.s = {"engine insert": 0.0, "key check": 0.0}
        self.window_engine_s = 0.0
        for attr, phase in (("_insert", "engine insert"), ("_drop_stored", "key check")):
            setattr(store, attr, self._timed(getattr(store, attr), phase))

    def _timed(self, fn, phase):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t
                self.s[phase] += dt
                if phase == "engine insert" and a and a[0] == "windows_data":
                    self.window_engine_s += dt
        return timed


def load(store, fleet: Fleet, n_windows: int, batches: int, optype_fraction: float) -> dict:
    phases = Phases(store)
    per = -(-n_windows // batches)
    span = 365 * DAY_NS // batches
    t_win = t_ops = 0.0
    n_ops = done = 0
    for b in range(batches):
        n = min(per, n_windows - done)
        if n <= 0:
            break
        w = fleet.windows(done, n, YEAR_START_NS + b * span, YEAR_START_NS + (b + 1) * span)
        o = fleet.optypes(w, optype_fraction)
        waste = Fleet.waste(w, o)
        t = time.perf_counter()
        store.insert("optype_slowdown", o)
        store.insert("optype_waste", waste)
        t_ops += time.perf_counter() - t
        t = time.perf_counter()
        store.insert("window", w)
        t_win += time.perf_counter() - t
        done += n
        n_ops += o.num_rows
        print(f"  batch {b + 1}/{batches}: {done:,} windows, {n_ops:,} op-type rows", file=sys.stderr, flush=True)
    return {"windows": done, "optype_rows": n_ops, "window_rows_per_s": done / t_win,
            "window_engine_rows_per_s": done / phases.window_engine_s if phases.window_engine_s else 0.0,
            "phases_s": dict(phases.s),
            "optype_rows_per_s": n_ops / t_ops if t_ops else 0.0,
            "all_rows_per_s": (done + n_ops) / (t_win + t_ops)}


def query_params(name: str) -> dict:
    q = NAMED_QUERIES[name]
    params = {}
    for p in q.params:
        if p.default is None:
            params[p.name] = "job-00042" if p.name == "job_id" else 420
    if name == "job_workers":
        params["window_id"] = 0
    return params


def time_queries(store, repeat: int) -> dict[str, dict]:
    out = {}
    for name in sorted(NAMED_QUERIES):
        params = query_params(name)
        rows = store.run_named(name, params).num_rows  # warm-up
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            store.run_named(name, params)
            times.append(time.perf_counter() - t)
        out[name] = {"median_s": statistics.median(times), "rows": rows}
    return out


def wait_for_merges(store, limit_s: float) -> float:
    """Let background merges of the bulk load settle (at most ``limit_s``): queries are timed in steady state."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        # System tables are outside free SQL's sandbox: ask the engine directly.
        busy = store._select("SELECT count() AS n FROM system.merges WHERE database = currentDatabase()")
        if not busy.column("n")[0].as_py():
            break
        time.sleep(0.5)
    return time.perf_counter() - t0


def run_backend(kind: str, args, workdir: Path) -> dict:
    fleet = Fleet(args.jobs, args.seed)
    n_windows = args.windows if kind == "chdb" else args.server_windows
    server = None
    if kind == "chdb":
        url = f"chdb://{workdir / 'chdb'}"
    else:
        from services.clickhouse_server import ClickHouseServer, find_server_binary

        if not find_server_binary():
            return {"skipped": "clickhouse-server is not installed"}
        server = ClickHouseServer(data_dir=workdir / "server").start()
        url = server.store_url("bench")
    try:
        store = open_store(url)
        store.setup()
        version = getattr(store, "caps", None)
        print(f"{kind}: loading {n_windows:,} windows ({version.label if version else url})", file=sys.stderr)
        result = {"engine": version.label if version else "", **load(store, fleet, n_windows, args.batches,
                                                                   args.optype_fraction)}
        result["merge_wait_s"] = wait_for_merges(store, args.merge_wait)
        print(f"{kind}: timing {len(NAMED_QUERIES)} queries x {args.repeat}", file=sys.stderr)
        result["queries"] = time_queries(store, args.repeat)
        stored = store.query("SELECT count() AS n FROM windows").column("n")[0].as_py()
        result["stored_windows"] = stored
        store.close()
        return result
    finally:
        if server is not None:
            server.stop()


def report(results: dict) -> str:
    kinds = [k for k in results if "queries" in results[k]]
    lines = ["", "insert (Store.insert through the public API, key check included; op-type rows: S_t and waste rows)"]
    lines.append(f"{'backend':<10}{'engine':<18}{'windows':>12}{'op-type rows':>14}{'window rows/s':>16}"
                 f"{'op-type rows/s':>16}")
    for k in kinds:
        r = results[k]
        lines.append(f"{k:<10}{r['engine']:<18}{r['windows']:>12,}{r['optype_rows']:>14,}"
                     f"{r['window_rows_per_s']:>16,.0f}{r['optype_rows_per_s']:>16,.0f}")
    lines.append("all rows (windows and op-type rows over both tables' insert time): " + ", ".join(
        f"{k} {results[k]['all_rows_per_s']:,.0f} rows/s" for k in kinds))
    lines.append("of which (seconds, both tables): " + "; ".join(
        f"{k} " + ", ".join(f"{p} {v:.1f}" for p, v in results[k]["phases_s"].items()) for k in kinds))
    lines.append("the engine's own insert of window rows alone: " + ", ".join(
        f"{k} {results[k]['window_engine_rows_per_s']:,.0f} rows/s" for k in kinds))
    lines.append("merges settled after loading: " + ", ".join(f"{k} {results[k]['merge_wait_s']:.1f} s" for k in kinds))
    lines += ["", "named queries, median seconds (rows returned)"]
    lines.append(f"{'query':<20}" + "".join(f"{k:>20}" for k in kinds))
    for name in sorted(NAMED_QUERIES):
        cells = "".join(f"{results[k]['queries'][name]['median_s']:>12.3f} ({results[k]['queries'][name]['rows']:>5})"
                        for k in kinds)
        lines.append(f"{name:<20}{cells}")
    lines.append(f"{'max':<20}" + "".join(
        f"{max(q['median_s'] for q in results[k]['queries'].values()):>20.3f}" for k in kinds))
    for k, r in results.items():
        if "skipped" in r:
            lines.append(f"{k}: skipped ({r['skipped']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="chdb,server", help="comma-separated: chdb, server")
    p.add_argument("--jobs", type=int, default=3000)
    p.add_argument("--windows", type=int, default=10_500_000, help="window results over the year (chDB)")
    p.add_argument("--server-windows", type=int, default=1_000_000,
                   help="window results on the server (the 18.16 server reads FINAL across all partitions: "
                        "a full year there takes many minutes)")
    p.add_argument("--batches", type=int, default=12, help="inserts per table (one per month)")
    p.add_argument("--optype-fraction", type=float, default=0.1, help="share of windows with op-type rows")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per query (after a warm-up)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--merge-wait", type=float, default=60.0, help="at most this long for merges after loading")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--tmp", help="parent directory for the data (default: the system temp dir)")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="ss-bench-", dir=args.tmp))
    results = {}
    try:
        for kind in [k.strip() for k in args.backends.split(",") if k.strip()]:
            if kind not in ("chdb", "server"):
                p.error(f"unknown backend {kind!r}")
            results[kind] = run_backend(kind, args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
