#!/usr/bin/env python3
"""Speed of the what-if analyzer on the AR golden trace tiled along DP.

usage: .venv/bin/python benchmarks/whatif.py [--factors 16,64] [--repeat 3]

For each factor, builds (once, cached under bench_data/) the tiled trace with
../shared/tools/tile_trace.py, loads it into an OP_SPAN table, then times the
full analysis (every scenario: T, T_ideal, S_t, S_pp, S_dp, M_W, M_S,
verdicts) in a fresh subprocess per factor so the peak RSS is that of one
analysis. Prints median seconds, peak RSS and the time ratio of the last to
the first factor.

Targets (2-core machine): AR x64 (4,096 GPUs, 7.5M ops) <= 4 s and <= 1.5 GB
peak; x64/x16 time ratio <= 4.5. The published implementation took 82 s at x64.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
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


def _child(trace: str, meta: str, repeat: int) -> None:
    sys.path.insert(0, str(ROOT))
    from analyzers.whatif import analyze
    from core.golden import load_golden

    t0 = time.perf_counter()
    table, layout = load_golden(trace, meta)
    load_s = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        analyze(table, layout)  # the result (and its graphs) is dropped before the next run
        times.append(time.perf_counter() - t0)
    print(json.dumps({"ops": table.num_rows, "load_s": load_s, "times": times,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--factors", default="16,64", help="comma-separated tiling factors (1 = the golden trace)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per factor (median reported)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.repeat)
        return
    factors = [int(f) for f in args.factors.split(",") if f]
    rows = []
    for f in factors:
        trace, meta = tiled(f)
        out = subprocess.run([sys.executable, __file__, "--repeat", str(args.repeat), "--child", str(trace), str(meta)],
                             capture_output=True, text=True, check=False, env=dict(os.environ, PYTHONHASHSEED="0"))
        if out.returncode:
            sys.exit(f"factor {f} failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        med = statistics.median(r["times"])
        rows.append((f, r["ops"], med, r["peak_rss_mb"]))
        print(f"AR x{f:<3d} {r['ops']:>9,d} ops  {f * 64:>6,d} GPUs  analyze median {med:6.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in r['times'])})  load {r['load_s']:.2f} s  "
              f"peak RSS {r['peak_rss_mb']:,.0f} MB", flush=True)
    if len(rows) > 1:
        (f0, n0, t0, _), (f1, n1, t1, _) = rows[0], rows[-1]
        print(f"x{f1}/x{f0}: time ratio {t1 / t0:.2f} for {n1 / n0:.2f}x the ops")


if __name__ == "__main__":
    main()
