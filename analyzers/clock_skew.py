"""Workers of a window whose clocks are hours off the others': found from the op spans alone.

A worker whose clock is wrong stretches its window's wall span, and the
GPU-hours and the slowdown with it. The analysis of a window
(``analyzers.window``) flags such a window instead of analysing it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclasses.dataclass(frozen=True)
class ClockSkew:
    """Workers of an op-span window whose clocks sit implausibly far from the other workers' clocks."""

    workers: tuple[tuple[tuple[int, int], float], ...]
    """((dp_rank, pp_rank), offset in s to the reference workers) of each shifted worker, in worker order."""
    threshold_s: float
    """Offsets beyond this are implausible: two median step times, at least one second."""

    def describe(self, most: int = 8) -> str:
        """'dp1/pp0 +10800.0 s, dp1/pp1 +10800.0 s off the other workers' (the window's note), ``most`` named."""
        named = [f"dp{dp}/pp{pp} {off:+.1f} s" for (dp, pp), off in self.workers[:most]]
        if len(self.workers) > most:
            named.append(f"{len(self.workers) - most} more workers")
        return ", ".join(named) + " off the other workers"


def worker_clock_skew(ops: pa.Table) -> ClockSkew | None:
    """The workers whose clocks are implausibly far off the others' in an op-span window, each with its offset.

    Workers of a synchronous job start every step within one step time of each
    other (pipeline stages later by their warm-up, a DP rank by its wait). A
    worker whose step starts sit, at the median over the window's steps, more
    than two median step times (and at least one second) from the other
    workers' has a clock that is off, and its spans would stretch the window
    and its GPU-hours.

    Offsets are measured against the workers whose clocks agree, not against
    every worker: with two of four workers 3 h ahead, the median of all four
    sits halfway and would call each worker 1.5 h off. So the workers are first
    grouped by clock (offsets to the per-step median, sorted, split where two
    neighbours differ by more than the threshold); the largest group is the
    reference, and each worker outside it is measured against the median of the
    reference workers of the same steps. With no single largest group (two
    workers, or two against two) the group of the lowest worker is the
    reference: dp0/pp0 holds rank 0, whose clock is the job clock the exporters
    align the others' to.
    """
    if ops.num_rows == 0:
        return None
    end = pc.add(ops["start_ns"], ops["duration_ns"])
    t = pa.table({"dp": ops["dp_rank"], "pp": ops["pp_rank"], "step": ops["step"], "start": ops["start_ns"],
                  "end": end})
    g = t.group_by(["dp", "pp", "step"]).aggregate([("start", "min"), ("end", "max")])
    if g.num_rows < 2:
        return None
    step = g["step"].to_numpy()
    start = g["start_min"].to_numpy().astype(np.float64)
    span = g["end_max"].to_numpy().astype(np.float64) - start
    steps, idx = np.unique(step, return_inverse=True)
    workers = g["dp"].to_numpy().astype(np.int64) * (1 << 32) + g["pp"].to_numpy().astype(np.int64)
    ids, widx = np.unique(workers, return_inverse=True)
    if len(ids) < 2:
        return None
    threshold_ns = max(2.0 * float(np.median(span)), 1e9)
    per_worker = _group_median(widx, start - _group_median(idx, start, len(steps))[idx], len(ids))
    order = np.argsort(per_worker, kind="stable")
    clock = np.empty(len(ids), dtype=np.int64)
    clock[order] = np.concatenate([[0], np.cumsum(np.diff(per_worker[order]) > threshold_ns)])
    if clock.max() == 0:
        return None  # one clock: however the workers spread, no two neighbours are implausibly far apart
    sizes = np.bincount(clock)
    # ``ids`` are sorted, so the first worker of the largest groups decides a tie in favour of the lowest worker.
    ref = clock[np.flatnonzero(sizes[clock] == sizes.max())[0]]
    in_ref = clock[widx] == ref
    ref_steps, ref_idx = np.unique(idx[in_ref], return_inverse=True)
    ref_at = np.full(len(steps), np.nan)
    ref_at[ref_steps] = _group_median(ref_idx, start[in_ref], len(ref_steps))
    off = start - ref_at[idx]
    mine = ~in_ref & ~np.isnan(off)  # the other workers' steps that some reference worker ran too
    if not mine.any():
        return None
    others, oidx = np.unique(widx[mine], return_inverse=True)
    offsets = _group_median(oidx, off[mine], len(others))
    far = np.abs(offsets) > threshold_ns
    if not far.any():
        return None
    shifted = tuple(((int(ids[w] >> 32), int(ids[w] & 0xFFFFFFFF)), float(o) / 1e9)
                    for w, o in zip(others[far], offsets[far]))
    return ClockSkew(shifted, threshold_ns / 1e9)


def _group_median(group: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Median of ``values`` per group index 0..n-1 (every group non-empty), in one sort."""
    order = np.lexsort((values, group))
    v = values[order]
    counts = np.bincount(group, minlength=n)
    first = np.cumsum(counts) - counts
    return (v[first + (counts - 1) // 2] + v[first + counts // 2]) / 2
