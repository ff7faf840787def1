#!/usr/bin/env python3
"""Speed of `stragglerscope whatif` on the AR golden trace tiled along DP, end to end, and where its time goes.

usage: .venv/bin/python benchmarks/whatif.py [--factors 16,64,256] [--repeat 3]

For each factor, builds (once, cached under bench_data/) the tiled trace with
../shared/tools/tile_trace.py, then
- runs the command itself (load, analysis, JSON out) ``--repeat`` times, each
  in a fresh process: median wall seconds and the largest peak RSS;
- runs it once more in-process under cProfile and prints the seconds of each
  phase: reading the trace, preparing (validate, sort), the graph, measuring
  durations and delays, the main pass (T, replay, T_ideal, S_t, S_pp, M_S),
  the pair pass (S_dp) and the top-worker pass (M_W) together (they run on
  threads, core/parallel.py), the summary and the JSON.
Prints the time ratio of the last to the first factor.

A fresh checkout compiles the analyzer's kernels on first use (numba, cached in
analyzers/whatif/__pycache__): one analysis of the golden trace runs first so
that no timed run pays for it.

Targets (issue 23, 2-core machine): AR x256 (16,384 GPUs, 30M ops) <= 8 s and
<= 3 GB peak; AR x64 <= 1.5 s; x256/x64 time ratio <= 4.5.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT.parent / "shared" / "golden" / "whatif" / "AR"
TILE = ROOT.parent / "shared" / "tools" / "tile_trace.py"
DATA = ROOT / "bench_data"


def tiled(factor: int) -> tuple[Path, Path]:
    """Paths of the AR trace tiled ``factor`` times, built if missing."""
    if factor == 1:
        return GOLDEN / "trace-AR.parquet", GOLDEN / "meta-AR.yaml"
    DATA.mkdir(exist_ok=True)
    trace, meta = DATA / f"trace-ARx{factor}.parquet", DATA / f"meta-ARx{factor}.yaml"
    if not (trace.exists() and meta.exists()):
        subprocess.run([sys.executable, str(TILE), str(GOLDEN / "trace-AR.parquet"), str(GOLDEN / "meta-AR.yaml"),
                        str(factor), str(trace), str(meta)], check=True, stdout=subprocess.DEVNULL)
    return trace, meta


PHASES = (  # (label, file, function whose cumulative time it is, its callers or None), in the order they run
    ("read", "core/golden.py", "load_golden", None),
    ("prepare", "analyzers/whatif/load.py", "prepare_ops_taking", None),
    ("graph", "analyzers/whatif/graph.py", "build_graph", None),
    ("measure", "analyzers/whatif/graph.py", "measure", None),
    # The passes run on threads (core/parallel.py): their wall time is that of the calling thread
    # in map_slices, which runs one slice itself and waits for the others.
    ("passes", "core/parallel.py", "map_slices", ("run_scenarios", "column_pass")),
    ("summary", "analyzers/whatif/api.py", "summarise", None),
    ("json", "json/__init__.py", "dumps", None),
)


def _phases(trace: Path, meta: Path) -> None:
    """One in-process run of the command under cProfile: seconds per phase, as JSON on stdout."""
    sys.path.insert(0, str(ROOT))
    from actions.whatif_files import whatif_files
    from core.memory import small_pages

    small_pages()  # as the command does (stragglerscope.cli.main)

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(whatif_files, trace, meta, os.devnull)
    total = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    out = {}
    for label, file, name, caller in PHASES:
        out[label] = sum(
            v[3] if caller is None else sum(c[3] for (_, _, cn), c in v[4].items() if cn in caller)
            for (f, _, n), v in stats.items() if n == name and f.endswith(file))
    out["total"] = total
    print(json.dumps(out))


def _command(trace: Path, meta: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one `stragglerscope whatif` in a fresh process."""
    exe = Path(sys.executable).parent / "stragglerscope"
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(exe), "whatif", str(trace), "--meta", str(meta), "--json", os.devnull],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    if proc.returncode:
        sys.exit(f"stragglerscope whatif {trace} failed ({proc.returncode}):\n{err[-3000:]}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--factors", default="16,64,256", help="comma-separated tiling factors (1 = the golden trace)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of the command per factor (median reported)")
    ap.add_argument("--phases-of", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phases_of:
        _phases(Path(args.phases_of[0]), Path(args.phases_of[1]))
        return
    factors = [int(f) for f in args.factors.split(",") if f]
    _command(*tiled(1))  # compiles the kernels if this checkout has not yet
    rows = []
    for f in factors:
        trace, meta = tiled(f)
        runs = [_command(trace, meta) for _ in range(args.repeat)]
        med = statistics.median(w for w, _ in runs)
        rss = max(r for _, r in runs)
        out = subprocess.run([sys.executable, __file__, "--phases-of", str(trace), str(meta)], capture_output=True,
                             text=True, check=False)
        if out.returncode:
            sys.exit(f"factor {f} failed:\n{out.stderr[-3000:]}")
        ph = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((f, med))
        print(f"AR x{f:<3d} {f * 64:>6,d} GPUs  whatif median {med:6.2f} s (runs "
              f"{', '.join(f'{w:.2f}' for w, _ in runs)})  peak RSS {rss:,.0f} MB", flush=True)
        print("    phases (one profiled run, {:.2f} s): ".format(ph.pop("total"))
              + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()), flush=True)
    if len(rows) > 1:
        (f0, t0), (f1, t1) = rows[0], rows[-1]
        print(f"x{f1}/x{f0}: time ratio {t1 / t0:.2f} for {f1 / f0:.0f}x the ops")


if __name__ == "__main__":
    main()
