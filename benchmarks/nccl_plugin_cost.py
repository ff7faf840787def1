"""What our NCCL profiler plugin costs NCCL's threads, per call and per collective (issue 53).

    .venv/bin/python benchmarks/nccl_plugin_cost.py [--collectives 2000] [--repeats 21]

Builds the plugin (``ingest.nccl_profiler``) and a small C driver (``nccl_plugin_cost.c``) that calls it
through ``ncclProfiler_v5`` as NCCL does for one rank of a ring all-reduce on 2 channels: the collective,
then per channel a send and a receive proxy op with 8 steps of 3 states each (174 calls). Timed from C,
the real clock on, records going to a temporary folder through the plugin's queue and writer thread.
Prints the median (and spread) over the repeats of the ns per collective and per call, wall clock and
the calling thread's CPU time (on a shared machine the wall clock also holds other processes' turns).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collectives", type=int, default=2000, help="collectives per repeat (at most 4096)")
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    from ingest.nccl_profiler import CFLAGS, build, compiler

    lib = build()
    with tempfile.TemporaryDirectory(prefix="ss-nccl-bench-") as tmp:
        exe = Path(tmp) / "driver"
        subprocess.run([compiler(), "-O2", "-std=c11", "-o", str(exe), str(Path(__file__).with_suffix(".c")), "-ldl"],
                       check=True)
        env = dict(os.environ, STRAGGLERSCOPE_NCCL_PEERS_DIR=str(Path(tmp) / "peers"))
        out = subprocess.run([str(exe), str(lib), str(args.collectives), str(args.repeats)], env=env, check=True,
                             capture_output=True, text=True).stdout
        size = sum(f.stat().st_size for f in (Path(tmp) / "peers").glob("*.bin"))
    got = json.loads(out)
    per = got["ns_per_collective"]
    calls = got["calls_per_collective"]
    med = statistics.median(per)
    print(f"plugin built with: gcc {' '.join(CFLAGS)}")
    print(f"{args.repeats} repeats of {args.collectives} collectives ({calls} plugin calls each: 2 proxy ops x "
          f"2 channels x 8 steps)")
    cpu = got["cpu_ns_per_collective"]
    cmed = statistics.median(cpu)
    print(f"per collective: median {med:,.0f} ns wall (min {per[0]:,.0f}, max {per[-1]:,.0f}); "
          f"median {cmed:,.0f} ns of the calling thread's CPU (min {cpu[0]:,.0f}, max {cpu[-1]:,.0f})")
    print(f"per call:       median {med / calls:,.1f} ns wall, {cmed / calls:,.1f} ns CPU")
    print(f"records queued {got['records']:,}, written {got['written']:,} ({size / 1e6:.1f} MB), "
          f"dropped {got['dropped']:,}")


if __name__ == "__main__":
    main()
