#!/usr/bin/env python3
"""`stragglerscope whatif` side by side with the paper's published what-if implementation, on the same traces.

usage: .venv/bin/python benchmarks/whatif_artifact.py --artifact DIR --artifact-python PATH
                                                     [--factors 16,64] [--repeat 1]

The published implementation is the artifact of "Understanding Stragglers in
Large Model Training Using What-if Analysis" (GitHub ByteDance-Seed/StragglerAnalysis);
the golden traces are in its format. It needs pandas < 3 and its own Python:

    fetch ByteDance-Seed/StragglerAnalysis (the search tool's `fetch`), then
    git clone <the bare git dir it returns> /tmp/artifact
    python3 -m venv /tmp/artifact-venv
    /tmp/artifact-venv/bin/pip install "pandas<3" scipy tqdm numpy ujson seaborn pyarrow pyyaml

For each factor, builds (once, cached under bench_data/) the AR golden trace
tiled along DP with the helper of benchmarks/whatif.py, then runs, alternating
and each in a fresh process, ``--repeat`` times:
- the artifact: analyzer/wia.py --metadata META --trace TRACE --dump-dir TMP
  (its default settings, no --root: it dumps no intermediate parquets);
- ours: stragglerscope whatif TRACE --meta META --json TMP.
Prints for each the median wall seconds and the largest peak RSS (ru_maxrss
of the process, os.wait4), the speed ratio (artifact time / ours), and S
(the slowdown, Eq. 1) of both: "blocking_slowdown" of the artifact's result
JSON and "slowdown" of ours, with their relative difference.

Both run once on the golden trace first, untimed: ours compiles its kernels
there if this checkout has not yet (numba cache), and both warm the file cache.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ROOT / ".venv" / "bin" / "stragglerscope"
S_TOL = 1e-4
"""Relative difference of S above which the two are reported as disagreeing. On the golden traces they agree
to 1e-9; the tiled traces differ by about 6e-5: tile_trace.py scales durations but not starts, which leaves
tens of thousands of transfers slightly below 0 (none in the real traces). The analyzer sets those to 0
(and warns), the artifact keeps them down to -10 ms."""

_spec = importlib.util.spec_from_file_location("bench_whatif", Path(__file__).resolve().parent / "whatif.py")
_bench_whatif = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench_whatif)
tiled = _bench_whatif.tiled

HOW_TO_GET = """how to get the artifact:
  1. fetch the repository ByteDance-Seed/StragglerAnalysis (the search tool's `fetch`, or
     git clone https://github.com/ByteDance-Seed/StragglerAnalysis) and check it out, e.g.
     git clone <the bare git dir fetch returned> /tmp/artifact
  2. python3 -m venv /tmp/artifact-venv
  3. /tmp/artifact-venv/bin/pip install "pandas<3" scipy tqdm numpy ujson seaborn pyarrow pyyaml
then: .venv/bin/python benchmarks/whatif_artifact.py --artifact /tmp/artifact \\
          --artifact-python /tmp/artifact-venv/bin/python"""

# Imports wia.py as running it does: the checkout on PYTHONPATH (its README) and analyzer/ first on sys.path
# (the script's own folder; analyzer/timers.py imports a sibling module by its bare name).
CHECK = ("import sys; sys.path.insert(0, 'analyzer'); import pandas, pyarrow, analyzer.wia; "
         "print(sys.version.split()[0], pandas.__version__, pyarrow.__version__); "
         "sys.exit(0 if int(pandas.__version__.split('.')[0]) < 3 else 3)")


class Failed(Exception):
    """A run that did not produce a result; the message says why, in one or a few lines."""


def _env(artifact: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(artifact) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _check_artifact(artifact: Path, python: Path) -> str:
    """A line describing the artifact and its Python; exits with how to get it if either is missing or broken."""
    if not (artifact / "analyzer" / "wia.py").is_file():
        sys.exit(f"no artifact at {artifact} (analyzer/wia.py missing)\n{HOW_TO_GET}")
    if not (python.is_file() and os.access(python, os.X_OK)):
        sys.exit(f"no Python at {python} for the artifact\n{HOW_TO_GET}")
    out = subprocess.run([str(python), "-c", CHECK], cwd=artifact, env=_env(artifact), capture_output=True, text=True)
    if out.returncode == 3:
        sys.exit(f"the artifact needs pandas < 3; {python} has pandas {out.stdout.split()[1]}\n{HOW_TO_GET}")
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"the artifact cannot be imported with {python}: {last}\n{HOW_TO_GET}")
    py, pandas, pyarrow = out.stdout.split()
    rev = subprocess.run(["git", "-C", str(artifact), "log", "-1", "--format=%h %cs"], capture_output=True, text=True)
    commit = rev.stdout.strip() if rev.returncode == 0 else "no git"
    return f"artifact {artifact} ({commit}), Python {py}, pandas {pandas}, pyarrow {pyarrow}"


def _timed(argv: list[str], log: Path, **kw) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one process, its output to ``log``; Failed if it exits non-zero."""
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kw)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    if code:
        lines = log.read_text(errors="replace").strip().splitlines()
        why = f"killed by signal {-code}" + (" (out of memory?)" if code == -9 else "") if code < 0 else f"exit {code}"
        raise Failed(f"{why}; last output: {lines[-1][:300] if lines else '(none)'}")
    return wall, usage.ru_maxrss / 1024


def _artifact(artifact: Path, python: Path, trace: Path, meta: Path) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MB) and S of one run of the artifact's wia.py in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="wia-artifact-") as tmp:
        dump = Path(tmp) / "result"
        wall, rss = _timed([str(python), str(artifact / "analyzer" / "wia.py"), "--metadata", str(meta),
                            "--trace", str(trace), "--dump-dir", str(dump)], Path(tmp) / "log",
                           cwd=tmp, env=_env(artifact))
        results = list(dump.glob("*.json"))
        if len(results) != 1:
            raise Failed(f"expected one result JSON in its --dump-dir, found {len(results)}")
        try:
            S = float(json.loads(results[0].read_text())["blocking_slowdown"])
        except (ValueError, KeyError, TypeError) as e:
            raise Failed(f"no blocking_slowdown in its result {results[0].name}: {e!r}") from None
    return wall, rss, S


def _ours(trace: Path, meta: Path) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MB) and S of one `stragglerscope whatif` in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="wia-ours-") as tmp:
        out = Path(tmp) / "result.json"
        wall, rss = _timed([str(OURS), "whatif", str(trace), "--meta", str(meta), "--json", str(out)],
                           Path(tmp) / "log")
        S = float(json.loads(out.read_text())["slowdown"])
    return wall, rss, S


def _runs(runs: list[tuple[float, float, float]]) -> str:
    walls = [w for w, _, _ in runs]
    return (f"median {statistics.median(walls):7.2f} s (runs {', '.join(f'{w:.2f}' for w in walls)})"
            f"  peak RSS {max(r for _, r, _ in runs):7,.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog=HOW_TO_GET, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, required=True, help="checkout of ByteDance-Seed/StragglerAnalysis")
    ap.add_argument("--artifact-python", type=Path, required=True,
                    help="python of a venv with the artifact's requirements and pandas < 3")
    ap.add_argument("--factors", default="16,64", help="comma-separated tiling factors (1 = the golden trace)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of each per factor (median reported)")
    args = ap.parse_args()
    artifact, python = args.artifact.resolve(), args.artifact_python.absolute()
    factors = [int(f) for f in args.factors.split(",") if f]
    if not OURS.is_file():
        sys.exit(f"{OURS} missing: install the project into .venv first")
    print(_check_artifact(artifact, python), flush=True)

    golden = tiled(1)
    try:  # warm-up, untimed
        _ours(*golden)
    except Failed as e:
        sys.exit(f"stragglerscope whatif failed on the golden trace: {e}")
    try:
        _artifact(artifact, python, *golden)
    except Failed as e:
        sys.exit(f"the artifact could not be run on the golden trace {golden[0]}: {e}")

    failed = False
    for f in factors:
        trace, meta = tiled(f)
        theirs, ours, art_err = [], [], None
        for _ in range(args.repeat):
            if art_err is None:
                try:
                    theirs.append(_artifact(artifact, python, trace, meta))
                except Failed as e:
                    art_err = str(e)
            try:
                ours.append(_ours(trace, meta))
            except Failed as e:
                sys.exit(f"stragglerscope whatif failed on {trace}: {e}")
        print(f"AR x{f:<3d} {f * 64:>6,d} GPUs", flush=True)
        print(f"    ours      {_runs(ours)}", flush=True)
        if art_err is not None:
            failed = True
            print(f"    artifact  COULD NOT BE RUN on {trace.name}: {art_err}", flush=True)
            continue
        print(f"    artifact  {_runs(theirs)}", flush=True)
        s_art, s_ours = theirs[-1][2], ours[-1][2]
        rel = abs(s_ours - s_art) / abs(s_art)
        print(f"    S: artifact {s_art:.9f}  ours {s_ours:.9f}  relative difference {rel:.1e} "
              f"({'agree' if rel <= S_TOL else 'DIFFER'}, tolerance {S_TOL:.0e})", flush=True)
        t_art, t_ours = (statistics.median(w for w, _, _ in r) for r in (theirs, ours))
        r_art, r_ours = (max(m for _, m, _ in r) for r in (theirs, ours))
        print(f"AR x{f}: artifact {t_art:.2f} s, {r_art:,.0f} MB | ours {t_ours:.2f} s, {r_ours:,.0f} MB | "
              f"speed ratio (artifact / ours) {t_art / t_ours:.1f}x, peak RSS ratio {r_art / r_ours:.1f}x", flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
