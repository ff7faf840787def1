"""GC pauses -> a planned garbage-collection interval (every rank collects in the same step).

Why: Python's automatic collector pauses a rank whenever its allocation
counters say so; ranks pause at different steps, and since every step ends
in collectives, each pause of any rank stalls all of them. Disabling the
automatic collector and collecting on every rank in the same step every N
steps (Megatron-LM: ``--manual-gc --manual-gc-interval N``) turns many
unsynchronised stalls into one shared pause per N steps (the paper: +12.6%).

How, from the trace's own ``gc`` ops:
- the collection rate h = the share of (step, worker) with a pause, and the
  pause length P = the 90th percentile of the pauses (a planned pause waits
  for the slowest rank, so a high quantile, not the mean);
- N = round(1 / h): each rank collects as often as it does now, so memory
  does not grow (``interval`` overrides it);
- the gain: simulate the window with no pause anywhere (T0) and with every
  worker pausing P (T1); a planned step every N costs (T1 - T0) / N on
  average, so the predicted step time is mean(T0) + (mean(T1) - mean(T0)) / N.
  Worker-steps without a ``gc`` op take P on their optimizer instead (a
  slightly pessimistic place: after the last synchronisation).
"""
from __future__ import annotations

import numpy as np

from analyzers.whatif import opcodes as T

from .model import JobFacts, Remedy
from .resim import Cells, TraceCells, gain

PAUSE_NS = 100_000
"""A ``gc`` op shorter than this (0.1 ms) is no collection."""
PAUSE_QUANTILE = 0.9


def advise_gc(tc: TraceCells, facts: JobFacts, verdict: str = "gc", interval: int | None = None) -> Remedy | None:
    lay = tc.layout
    gc = tc.values(lambda c: c.code == T.GC)
    steps = tc.steps()
    worker_steps = len(steps) * lay.n_workers
    pauses = gc[gc >= PAUSE_NS]
    if len(pauses) == 0 or worker_steps == 0:
        return None
    h = min(1.0, len(pauses) / worker_steps)
    P = float(np.quantile(pauses, PAUSE_QUANTILE))
    N = int(interval) if interval else max(1, round(1.0 / h))

    # Worker-steps that have a gc op: the planned pause goes there; the others pay it on their optimizer.
    have = set()
    for c in tc.cells:
        g = c.code == T.GC
        have.update(zip(c.step[g].tolist(), c.dp[g].tolist(), c.pp[g].tolist()))

    def no_gc(c: Cells) -> np.ndarray:
        return np.where(c.code == T.GC, 0.0, c.dur)

    def all_gc(c: Cells) -> np.ndarray:
        out = np.where(c.code == T.GC, P, c.dur)
        opt = np.flatnonzero((c.code == T.OPT).ravel())
        if len(have) < worker_steps and len(opt):
            s, d, x = c.step.ravel()[opt], c.dp.ravel()[opt], c.pp.ravel()[opt]
            miss = np.array([(a, b, e) not in have for a, b, e in zip(s.tolist(), d.tolist(), x.tolist())])
            flat = out.reshape(-1)
            flat[opt[miss]] += P
        return out

    before = tc.mean_step_time()
    t0, t1 = tc.mean_step_time(no_gc), tc.mean_step_time(all_gc)
    after = t0 + (t1 - t0) / N
    action = (f"disable automatic GC and collect on every rank every {N} steps "
              f"(Megatron-LM: --manual-gc --manual-gc-interval {N}): today {100 * h:.0f}% of worker-steps pause "
              f"(p90 {P / 1e6:.0f} ms) at random ranks and stall all of them")
    details = {
        "interval_steps": N, "pause_rate": h, "pause_p90_ms": P / 1e6, "pause_mean_ms": float(pauses.mean() / 1e6),
        "pauses": len(pauses), "worker_steps": int(worker_steps),
        "step_time_no_gc_s": t0, "step_time_planned_gc_step_s": t1,
        "megatron_args": f"--manual-gc --manual-gc-interval {N}",
        "model": "mean(T no pauses) + (mean(T every worker pauses p90) - mean(T no pauses)) / interval",
    }
    return Remedy(kind="gc_interval", verdict=verdict, action=action, predicted_gain=gain(before, after),
                  step_time_before_s=before, step_time_after_s=after, details=details)
