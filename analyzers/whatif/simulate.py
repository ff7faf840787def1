"""Many what-if scenarios in one pass over a ``Graph`` (docs/whatif.md, section 4).

A scenario is a column: every op takes its original duration where the
column's selector matches it and its ideal duration elsewhere, and launch
delays are added only in columns that keep them. One pass walks the groups of
the graph in level order once and computes all columns together:

    start = max(end of predecessors) [+ launch delay]
    end   = max(start of the group's members) + duration   (a local op is its own group)

Pair mode (``simulate_pairs``) evaluates "only DP rank k keeps its original
durations" for every k at once: column 0 holds every op with original
durations, column 1 an ideal copy that stands for all the other DP ranks
(they are identical to one another). DP-wide groups then join a rank's
original sub-group with its copy, so all DP scenarios cost two columns.

The loops themselves are compiled (``kernels``); this module chooses the
columns and the memory. Contract: times are float64 ns from the step start;
results are per step (or per step and DP rank in pair mode); nothing is
mutated in the graph.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import kernels
from .graph import Graph


@dataclasses.dataclass(frozen=True)
class Scenarios:
    """Column selectors: op keeps its original duration iff (keys[:, key] == value) != invert."""

    names: tuple[str, ...]
    key: np.ndarray  # int, column of the key matrix per scenario
    value: np.ndarray  # int
    invert: np.ndarray  # bool
    keep_delay: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.names)


class Work:
    """Reusable memory for repeated passes: fresh large arrays cost page faults on every pass."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}
        self.keep: tuple | None = None  # (graph, keys, scenarios, keep matrix) of the last pass

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        b = self._bufs.get(name)
        if b is None or b.size < size:
            b = self._bufs[name] = np.empty(size, np.float64)
        return b[:size].reshape(shape)


_NO_OVER = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64))
_NO_START = np.zeros((0, 1, 1), np.float64)


def _ends(g: Graph, nb: int, k: int, work: Work | None) -> np.ndarray:
    return np.empty((g.n + 1, nb, k), np.float64) if work is None else work.get("E", (g.n + 1, nb, k))


def _keep(g: Graph, keys: np.ndarray, sc: Scenarios, work: Work | None, k_run: int) -> np.ndarray:
    """[n, k_run] bool: op i keeps its original duration in column j (padding columns: never)."""
    if work is not None and work.keep is not None:
        g0, k0, s0, keep = work.keep
        if g0 is g and k0 is keys and s0 is sc and keep.shape[1] == k_run:
            return keep
    keep = np.zeros((g.n, k_run), bool)  # a row per op: C order
    keep[:, :len(sc)] = keys[:, np.asarray(sc.key)] == np.asarray(sc.value)
    keep[:, :len(sc)] ^= np.asarray(sc.invert, bool)
    if work is not None:
        work.keep = (g, keys, sc, keep)
    return keep


def padded_columns(nb: int, k: int) -> int:
    """Scenario columns a pass runs: ``k``, or a little more so that a row of E (nb x k) is whole vectors.

    The kernel's row loops run four float64 at a time (AVX2); a row of 14 leaves a scalar tail on every op
    and costs as much as a row of 16 (measured: 14 columns 6.3 ns an (op, column), 16 columns 4.1 ns).
    """
    for k_run in range(k, k + max(1, k // 4) + 1):  # at most a quarter more
        if (nb * k_run) % 4 == 0:
            return k_run
    return k


def simulate(g: Graph, ideal: np.ndarray, keys: np.ndarray, sc: Scenarios, *, b0: int = 0, b1: int | None = None,
             want_start: bool = False, work: Work | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Run all scenario columns on batch columns [b0, b1).

    Returns (E, S): ends [n + 1, nb, k_run] (row 0 = step start) and, if asked, starts [n, nb, k_run]:
    column j < k is scenario j, columns past k (``padded_columns``) are padding to ignore.
    ``ideal`` is per op [n]; ``keys`` [n, n_keys] selects each column's original ops.
    With ``work``, E lives in its reusable memory (valid until the next pass using it).
    """
    b1 = g.batch if b1 is None else b1
    nb, k = b1 - b0, len(sc)
    k_run = padded_columns(nb, k)
    E = _ends(g, nb, k_run, work)
    S_all = np.zeros((g.n, nb, k_run), np.float64) if want_start else _NO_START
    over = _NO_OVER if g.delay_over is None else g.delay_over
    keep_delay = np.zeros(k_run, bool)
    keep_delay[:k] = sc.keep_delay
    kernels.pass_columns(g.pred_ptr, g.pred_idx, g.g_off, np.asarray(ideal, np.float64), g.orig, g.delay,
                         *over, _keep(g, keys, sc, work, k_run), keep_delay, b0, E, S_all, want_start)
    return E, (S_all if want_start else None)


def simulate_pairs(g: Graph, ideal: np.ndarray, *, b0: int = 0, b1: int | None = None,
                   work: Work | None = None) -> np.ndarray:
    """Pair mode: ends [n + 1, nb, 2] (column 0 original DP rank, column 1 its ideal stand-in)."""
    b1 = g.batch if b1 is None else b1
    E = _ends(g, b1 - b0, 2, work)
    kernels.pass_pairs(g.pred_ptr, g.pred_idx, g.sg_off, g.sg_wide, np.asarray(ideal, np.float64), g.orig, b0, E)
    return E


def step_times(g: Graph, E: np.ndarray, batch_steps: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(steps, T[step, column]): last step-end op's end per step (ns from the step start).

    A B = 1 graph may hold several steps (``g.end_steps``); a batched graph
    holds one step per batch column (``batch_steps``).
    """
    if len(g.end_pos) == 0:
        return np.zeros(0, np.int64), np.zeros((0, E.shape[2]))
    T3 = np.maximum.reduceat(E[g.end_pos + 1], g.end_off, axis=0)  # [steps in graph, nb, k]
    if batch_steps is None:
        return g.end_steps, T3[:, 0, :]
    return np.asarray(batch_steps), T3[0]


def pair_step_times(g: Graph, E: np.ndarray, batch_steps: np.ndarray | None = None,
                    n_dp: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, DP ranks, T): per (step, DP rank k), the step time when only rank k is original."""
    if len(g.end_pos) == 0:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros(0)
    # Rank k's own step ends (column 0) and those of its stand-in for the other ranks (column 1).
    per = np.maximum.reduceat(E[g.end_pos + 1], g.end_sd_off, axis=0)  # [n_sd, nb, 2]
    t = per[:, :, 0] if n_dp < 2 else per.max(axis=2)  # alone, the stand-in stands for no one
    if batch_steps is None:
        return g.end_sd_step, g.end_sd_dp, t[:, 0]
    nb = t.shape[1]
    steps = np.repeat(np.asarray(batch_steps)[None, :], len(g.end_sd_dp), axis=0)
    dps = np.repeat(np.asarray(g.end_sd_dp)[:, None], nb, axis=1)
    return steps.ravel(), dps.ravel(), t.ravel()
