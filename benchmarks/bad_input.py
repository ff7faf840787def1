"""The bad-input campaign of issue 18: what happens to each kind of bad input, and what it costs.

    .venv/bin/python benchmarks/bad_input.py [--markdown]

Runs every case of ``tests/unit/test_bad_input.CASES`` through one shard (real
decode, checks and what-if analysis, in process) beside a good job, and
prints per case its outcome: the dead letter's reason, a flagged window, or a
corrected clock. Then whether the good job's S is exact, and the cost of the
boundary on a large batch: decode with full Arrow validation, and the
semantic checks, per 1,000 rows (medians of 30).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyarrow as pa  # noqa: E402

from core import (
    codec,  # noqa: E402
    topics,
)
from core.config import ValidationConfig  # noqa: E402
from core.layout import JobLayout
from generators.fleetgen import JobSpec, generate_window  # noqa: E402
from ray_jobs.boundary import check_op_spans  # noqa: E402
from tests.unit.test_bad_input import CASES, GOOD, T0, letter_of, raw, run_shard, spec  # noqa: E402


def outcomes() -> tuple[list[tuple[str, str]], bool]:
    entries = list(GOOD) + [(topics.TOPIC_JOBS, "skewed", raw(spec("skewed").registration(T0, 2)))]
    entries += [(topic, key, payload) for _, topic, key, payload, _ in CASES]
    w, sink = run_shard(entries)
    _, alone = run_shard(GOOD)
    letters = sink.rows.get("dead_letter", [])
    windows = {r["job_id"]: r for r in sink.rows["window"]}
    out = []
    for name, topic, key, _payload, want in CASES:
        if isinstance(want, str):
            got = letter_of(letters, topic, key, _payload)
            out.append((name, f"dead letter: {got[:110]}" if got and want in got else f"NOT AS EXPECTED: {got}"))
        elif want[0] == "window":
            r = windows.get(key)
            out.append((name, f"window stored as {r['verdict']}, kept out of fleet statistics" if r else "NO WINDOW"))
        else:
            out.append((name, f"clock corrected ({w.stats.clock_corrected_rows} rows in the run)"))
    good = windows["good"]
    exact = good["slowdown"] == alone.rows["window"][0]["slowdown"] and good["n_ops"] == alone.rows[
        "window"][0]["n_ops"]
    return out, exact and not w.stats.error


def median_ms(f, n: int = 30) -> float:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", action="store_true", help="print the outcomes as a Markdown table")
    args = ap.parse_args()
    rows, exact = outcomes()
    if args.markdown:
        print("| bad input | outcome |\n|---|---|")
        for name, what in rows:
            print(f"| {name} | {what.replace('|', '/')} |")
    else:
        for name, what in rows:
            print(f"{name:55s} {what}")
    bad = [n for n, w in rows if w.startswith(("NOT", "NO "))]
    print(f"\n{len(rows)} kinds of bad input, {len(rows) - len(bad)} handled; the good job's S exact: {exact}")
    t = generate_window(JobSpec("a", JobLayout(32, 8), num_microbatches=16), 0, 4, T0)
    payload = codec.encode(t)

    def read_only():
        with pa.ipc.open_stream(pa.py_buffer(payload)) as r:
            r.read_all()

    k = t.num_rows / 1000
    base, full = median_ms(read_only), median_ms(lambda: codec.decode(payload))
    checks = median_ms(lambda: check_op_spans(t, "a", JobLayout(32, 8), ValidationConfig()))
    print(f"boundary cost on one {t.num_rows}-row op batch: IPC read {base / k * 1e3:.1f} us/1k rows, "
          f"decode with full validation {full / k * 1e3:.1f} us/1k rows (x{full / base:.2f}), "
          f"semantic checks {checks / k * 1e3:.1f} us/1k rows")


if __name__ == "__main__":
    main()
