"""Re-running the what-if simulator on a job's own trace with a fix applied to its op durations.

Every remedy predicts its gain the same way: take the dependency graphs the
analysis built (``WhatIfResult.model``), change the no-delay durations
of the ops the fix touches (compute: the traced duration; communication: the
transfer time), simulate, and compare the mean step time with that of the
unchanged durations. Both sides are the simulator's no-delay T of docs/whatif.md
section 5, so a fix is judged by the same model that found the straggler.

``TraceCells`` exposes, per graph, the op attributes as ``[n, B]`` arrays
(level order x batch column, one column per step for a regular window), so a
fix is a vectorised function of those arrays returning new durations of the
same shape. Nothing here mutates the analysis: graphs are copied with new
duration arrays.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from analyzers.whatif import opcodes as T
from analyzers.whatif.load import PreparedOps, WhatIfInputError
from analyzers.whatif.result import WhatIfResult
from analyzers.whatif.simulate import Scenarios, simulate, step_times

_ALL_ORIGINAL = Scenarios(("fixed",), np.array([0]), np.array([0]), np.array([False]), np.array([False]))
"""One column in which every op takes the duration it is given (no launch delays): the T of the fix."""
_BATCH_COLUMNS = 64
"""Batch columns simulated at once (bounds the [n, B] end times held)."""


@dataclasses.dataclass(frozen=True)
class Cells:
    """Attributes of the ops of one graph, each ``[n, B]``; ``dur`` is float64 ns (compute or transfer)."""

    code: np.ndarray
    dp: np.ndarray
    pp: np.ndarray
    mb: np.ndarray
    step: np.ndarray  # int64 absolute step number
    # (dp, pp, mb: int32)
    dur: np.ndarray

    def is_(self, *codes: int) -> np.ndarray:
        return np.isin(self.code, codes)

    @property
    def compute(self) -> np.ndarray:
        """Forward and backward compute ops (what layers, sequences and slow GPUs change)."""
        return self.is_(T.F, T.B)


Fix = Callable[[Cells], np.ndarray]
"""New durations ``[n, B]`` (ns) for the ops of one graph."""


class TraceCells:
    """The op cells of an analysed window and the simulator run with changed durations."""

    def __init__(self, result: WhatIfResult):
        if result.model is None:
            raise WhatIfInputError("this WhatIfResult carries no simulation state: re-run analyze on the ops")
        self.p: PreparedOps = result.model.prepared
        run = result.model.run
        self.graphs = run.graphs
        self.cells: list[Cells] = []
        p = self.p
        for g in self.graphs:
            rows = g.rows()
            # int32 coordinates: arithmetic on them (dp * m + mb) stays far below 2^31, and huge windows fit.
            self.cells.append(Cells(code=p.code[rows], dp=p.dp[rows].astype(np.int32), pp=p.pp[rows].astype(np.int32),
                                    mb=p.mb[rows].astype(np.int32), step=p.steps[p.step_idx[rows]],
                                    dur=np.asarray(g.orig, np.float64)))
        self._base: np.ndarray | None = None

    @property
    def layout(self):
        return self.p.layout

    def n_microbatches(self) -> int:
        """Microbatches per step and DP rank (largest forward/backward microbatch id + 1)."""
        return max((int(c.mb[c.compute].max(initial=-1)) for c in self.cells), default=-1) + 1

    def steps(self) -> np.ndarray:
        """Absolute step numbers of the window, sorted."""
        return np.unique(np.concatenate([np.unique(c.step) for c in self.cells])) if self.cells else np.zeros(0, int)

    def values(self, mask_fn: Callable[[Cells], np.ndarray], what: str = "dur") -> np.ndarray:
        """Flat values of attribute ``what`` where ``mask_fn`` holds, over every graph."""
        parts = [getattr(c, what)[mask_fn(c)] for c in self.cells]
        return np.concatenate(parts) if parts else np.zeros(0)

    def step_times(self, fix: Fix | None = None) -> np.ndarray:
        """Simulated step times (s), sorted by step, with ``fix``'s durations (None: as traced)."""
        if fix is None and self._base is not None:
            return self._base
        acc: dict[int, float] = {}
        for g, c in zip(self.graphs, self.cells):
            dur = c.dur if fix is None else np.asarray(fix(c), np.float64)
            if dur.shape != c.dur.shape:
                raise ValueError(f"a fix returned durations of shape {dur.shape}, expected {c.dur.shape}")
            g2 = dataclasses.replace(g, orig=np.maximum(dur, 0.0))
            keys = np.zeros((g.n, 1), np.int32)
            zero = np.zeros(g.n)
            for b0 in range(0, g.batch, _BATCH_COLUMNS):
                b1 = min(g.batch, b0 + _BATCH_COLUMNS)
                E, _ = simulate(g2, zero, keys, _ALL_ORIGINAL, b0=b0, b1=b1)
                batch_steps = np.arange(b0, b1) if g.batch > 1 else None
                st, tt = step_times(g2, E, batch_steps)
                for s, v in zip(np.asarray(st).tolist(), tt[:, 0]):
                    acc[int(s)] = float(v) / 1e9
        out = np.array([acc[k] for k in sorted(acc)], np.float64)
        if fix is None:
            self._base = out
        return out

    def mean_step_time(self, fix: Fix | None = None) -> float:
        return float(np.mean(self.step_times(fix)))


def gain(before_s: float, after_s: float) -> float:
    """Fractional speed-up of the step time: before / after - 1 (0.099 = 9.9% more steps per hour)."""
    return before_s / after_s - 1.0 if after_s > 0 else float("nan")
