"""GPU-hours and what stragglers waste of them: the one definition of each, for the what-if's result, the
stored window, its op types' rows and the fleet's statistics (docs/whatif.md)."""
from __future__ import annotations

import numpy as np


def window_gpu_hours(n_gpus: int, actual_step_s) -> float:
    """The GPU-hours a window's steps took: every GPU of the job for the sum of its steps' actual times.

    The one definition, for the what-if's result, the stored window and the fleet's statistics. Not the
    window's wall span: a trace may put each step on a clock of its own (the golden traces start every step
    at 0, so their span is one step and the stored figure was 30 times the what-if's, smaller), and the
    host time between steps is no step's."""
    return int(n_gpus) * float(np.nansum(np.asarray(actual_step_s, dtype=np.float64))) / 3600.0


def waste_fraction(slowdown: float) -> float:
    """The share of a window's GPU time lost to stragglers, 1 - 1/S: the one definition (NaN where S is not
    positive)."""
    return 1.0 - 1.0 / slowdown if slowdown > 0 else float("nan")


def wasted_gpu_hours(gpu_hours, slowdown):
    """GPU-hours lost to stragglers, ``gpu_hours`` x (1 - 1/S), for a window (its S) or for one op type of it
    (its S_t): the one definition. None lost where S is unknown or at most 1. Floats give a float, arrays
    (many windows at once) an array."""
    g = np.asarray(gpu_hours, dtype=np.float64)
    s = np.asarray(slowdown, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(s > 0, g * (1.0 - 1.0 / s), 0.0)
    w = np.where(np.isfinite(w), np.maximum(w, 0.0), 0.0)
    return float(w) if w.ndim == 0 else w
