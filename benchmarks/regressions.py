"""How well a job's own history tells its regressions from jitter (analyzers/regression.py), on a generated fleet.

    .venv/bin/python benchmarks/regressions.py [--jobs 400] [--windows 200] [--jitter 0.05] [--window-s 300]

Each job: a step time and its op types (compute, gradient all-reduce,
optimizer, host), ``--windows`` windows ``--window-s`` apart, every window's
step time multiplied by a jitter whose 95% lie within +-``--jitter`` (normal
noise of sigma jitter/2 on the log). A third of the jobs get one whole-job
regression at a random window: a change of 5 to 30% of the step in one kind
(compute on every rank, communication, host-side), lasting to the end; a
sixth a slowly degrading worker (+1% of its step per window up to +30%, while
the job's other workers hold); the rest nothing.

Scored, each against the truth:
- regressions: a change of at least 12% must be found (recall), within how
  many windows of its onset; a job with no change or one under 8% must get
  none (precision counts every regression found where there was none of 8%
  or more). 8-12% is the detector's threshold band: found or not, neither
  counts (a 10% threshold cannot be exact to a percent under jitter);
- what moved: the top op type of a found regression is the changed kind's;
- false alarms per 1,000 job-hours: regressions found in jobs without any
  change;
- degrading workers: the worker named, and how far it had degraded when it was.
Targets (issue 41): found within 3 windows, precision >= 0.95, recall >= 0.9,
at most 1 false alarm per 1,000 job-hours at 5% jitter.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzers.regression import RegressionDetector, RegressionParams, WindowPoint  # noqa: E402

KINDS = {"compute": ("forward-compute", "backward-compute"), "communication": ("grads-reduce-scatter",),
         "host": ("other",)}
BASE = {"forward-compute": 0.30, "backward-compute": 0.60, "grads-reduce-scatter": 0.06, "optimizer": 0.02,
        "other": 0.02}


def job(rng, windows: int, jitter: float, workers: int = 8):
    """(points, truth): truth is ('regression', onset, change, kind), ('degrading', onset, worker) or ('none',)."""
    scale = float(rng.uniform(0.2, 5.0))
    r = rng.random()
    if r < 1 / 3:
        onset, change, kind = int(rng.integers(20, windows - 10)), float(rng.uniform(0.05, 0.30)), \
            str(rng.choice(list(KINDS)))
        truth = ("regression", onset, change, kind)
    elif r < 0.5:
        truth = ("degrading", int(rng.integers(20, windows - 40)), int(rng.integers(0, workers)))
    else:
        truth = ("none",)
    points = []
    for i in range(windows):
        ops = {k: v * scale for k, v in BASE.items()}
        if truth[0] == "regression" and i >= truth[1]:
            names = KINDS[truth[3]]
            extra = truth[2] * sum(ops.values()) / sum(ops[n] for n in names)
            for n in names:
                ops[n] *= 1 + extra
        noise = float(np.exp(rng.normal(0, jitter / 2)))
        ops = {k: v * noise for k, v in ops.items()}
        step = sum(ops.values())
        ws = {}
        for w in range(workers):
            t = step * float(np.exp(rng.normal(0, jitter / 4)))
            if truth[0] == "degrading" and w == truth[2] and i >= truth[1]:
                t *= 1 + min(0.30, 0.01 * (i - truth[1] + 1))
            ws[(w, 0)] = t
        points.append(WindowPoint(i, i * 100, i, step, ops, ws))
    return points, truth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--jitter", type=float, default=0.05, help="95%% of windows within +- this (default 0.05)")
    ap.add_argument("--window-s", type=float, default=300.0, help="seconds between a job's windows (job-hours)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    found = missed = false_found = gray = 0
    delays, wrong_kind, quiet_hours, quiet_alarms = [], 0, 0.0, 0
    deg_found, deg_total, deg_at, deg_false = 0, 0, [], 0
    windows = 0
    for _ in range(args.jobs):
        points, truth = job(rng, args.windows, args.jitter)
        det = RegressionDetector(RegressionParams())
        events = [e for p in points for e in det.add(p)]
        windows += len(points)
        regs = [e for e in events if e.kind == "regression"]
        if truth[0] == "regression" and truth[2] >= 0.12:
            hit = [e for e in regs if e.window_id >= truth[1]]
            if hit:
                found += 1
                delays.append(hit[0].window_id - truth[1] + 1)
                top = max(hit[0].optypes, key=hit[0].optypes.get) if hit[0].optypes else ""
                wrong_kind += top not in KINDS[truth[3]]
                false_found += len([e for e in regs if e.window_id < truth[1]])
            else:
                missed += 1
        elif truth[0] == "regression" and truth[2] > 0.08:
            gray += 1
        else:
            false_found += len(regs)
            if truth[0] == "none":
                quiet_hours += len(points) * args.window_s / 3600
                quiet_alarms += len(regs)
        degs = [e for e in events if e.kind == "degraded_worker"]
        if truth[0] == "degrading":
            deg_total += 1
            named = [e for e in degs if e.scope == f"dp{truth[2]}/pp0"]
            if named:
                deg_found += 1
                deg_at.append(min(0.30, 0.01 * (named[0].window_id - truth[1] + 1)))
            deg_false += len([e for e in degs if e.scope != f"dp{truth[2]}/pp0"])
        else:
            deg_false += len(degs)
    p = found / max(1, found + false_found)
    r = found / max(1, found + missed)
    print(f"{args.jobs} jobs x {args.windows} windows ({windows:,} windows, jitter +-{100 * args.jitter:.0f}%), "
          f"scored in {time.perf_counter() - t0:.1f} s")
    print(f"regressions >= 12%: {found + missed}; found {found} (recall {r:.3f}), precision {p:.3f}; "
          f"8-12% band: {gray} jobs, not scored")
    if delays:
        print(f"  windows from onset to the alert: median {statistics.median(delays):.0f}, "
              f"90th percentile {np.percentile(delays, 90):.0f}, max {max(delays)}; "
              f"within 3 windows: {sum(d <= 3 for d in delays) / len(delays):.3f}")
    print(f"  what moved: the top op type was the changed kind's in {found - wrong_kind} of {found}")
    print(f"false alarms in jobs without any change: {quiet_alarms} in {quiet_hours:,.0f} job-hours "
          f"({1000 * quiet_alarms / max(quiet_hours, 1e-9):.2f} per 1,000 job-hours)")
    print(f"degrading workers: {deg_found} of {deg_total} named"
          + (f", at a median of +{100 * statistics.median(deg_at):.0f}% over their best" if deg_at else "")
          + f"; {deg_false} other workers named")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
