"""Many what-if scenarios in one pass over a ``Graph`` (WHATIF.md section 4).

A scenario is a column: every op takes its original duration where the
column's selector matches it and its ideal duration elsewhere, and launch
delays are added only in columns that keep them. One pass walks the levels of
the graph once and computes all columns together:

    start = max(end of predecessors) [+ launch delay]
    end   = max(start of the group's members) + duration   (a local op is its own group)

Pair mode (``simulate_pairs``) evaluates "only DP rank k keeps its original
durations" for every k at once: column 0 holds every op with original
durations, column 1 an ideal copy that stands for all the other DP ranks
(they are identical to one another). DP-wide groups then join a rank's
original sub-group with its copy, so all DP scenarios cost two columns.

Contract: times are float64 ns from the step start; results are per step (or
per step and DP rank in pair mode); nothing is mutated in the graph.
"""
from __future__ import annotations

import dataclasses

import numpy as np

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


def _pred_max(E: np.ndarray, g: Graph, lv, out: np.ndarray, tmp: np.ndarray) -> None:
    """out = max over each op's predecessors' ends."""
    if lv.slots is None:
        out[...] = np.maximum.reduceat(E[g.pred_idx[lv.ea:lv.eb]], lv.pred_off, axis=0)
        return
    np.take(E, lv.slots[:, 0], axis=0, out=out)
    for j in range(1, lv.slots.shape[1]):
        np.take(E, lv.slots[:, j], axis=0, out=tmp)
        np.maximum(out, tmp, out=out)


def _seg_max(seg, S: np.ndarray, tmp: np.ndarray) -> None:
    """In place: every row of S becomes the max over its segment."""
    if seg is None:
        return
    if seg.partner is not None:
        np.take(S, seg.partner, axis=0, out=tmp)
        np.maximum(S, tmp, out=S)
    if seg.big_idx is not None:
        G = np.maximum.reduceat(S[seg.big_idx], seg.big_off, axis=0)
        S[seg.big_idx] = np.repeat(G, seg.big_len, axis=0)


class Work:
    """Reusable scratch memory for repeated passes: fresh large arrays cost page faults on every pass."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}
        self.masks: tuple | None = None  # (graph, keys, scenarios, {nb: per-level cells}) of the last pass

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        b = self._bufs.get(name)
        if b is None or b.size < size:
            b = self._bufs[name] = np.empty(size, np.float64)
        return b[:size].reshape(shape)


def _buffers(g: Graph, nb: int, k: int, work: Work | None) -> tuple[np.ndarray, np.ndarray]:
    m = max((lv.b - lv.a for lv in g.levels), default=0)
    if work is None:
        return np.empty((m, nb, k)), np.empty((m, nb, k))
    return work.get("S", (m, nb, k)), work.get("tmp", (m, nb, k))


def _ends(g: Graph, nb: int, k: int, work: Work | None) -> np.ndarray:
    E = np.empty((g.n + 1, nb, k), np.float64) if work is None else work.get("E", (g.n + 1, nb, k))
    E[0] = 0.0
    return E


def simulate(g: Graph, ideal: np.ndarray, keys: np.ndarray, sc: Scenarios, *, b0: int = 0, b1: int | None = None,
             want_start: bool = False, work: Work | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Run all scenario columns on batch columns [b0, b1).

    Returns (E, S): ends [n + 1, nb, k] (row 0 = step start) and, if asked, starts [n, nb, k].
    ``ideal`` is per op [n]; ``keys`` [n, n_keys] selects each column's original ops.
    With ``work``, E lives in its reusable memory (valid until the next pass using it).
    """
    b1 = g.batch if b1 is None else b1
    nb, k = b1 - b0, len(sc)
    E = _ends(g, nb, k, work)
    S_all = np.zeros((g.n, nb, k), np.float64) if want_start else None
    dcols = np.flatnonzero(sc.keep_delay)
    orig = g.orig[:, b0:b1]
    delay = g.delay[:, b0:b1]
    buf, tmp_buf = _buffers(g, nb, k, work)
    masks = _masks(g, keys, sc, nb, work)
    over = g.delay_over  # delays too long for int32, sorted by row
    for li, lv in enumerate(g.levels):
        a, b = lv.a, lv.b
        S, tmp = buf[:b - a], tmp_buf[:b - a]
        _pred_max(E, g, lv, S, tmp)
        for j in dcols:
            S[:, :, j] += delay[a:b]
        if len(dcols) and over is not None:
            lo, hi = np.searchsorted(over[0], (a, b))
            if hi > lo:
                r, c, v = over[0][lo:hi] - a, over[1][lo:hi], over[2][lo:hi]
                ok = (c >= b0) & (c < b1)
                for j in dcols:
                    S[r[ok], c[ok] - b0, j] += v[ok]
        if want_start:
            S_all[a:b] = S
        _seg_max(lv.groups, S, tmp)
        # Ideal durations in every column, then the (op, batch, column) cells whose column keeps the
        # op's original duration, by flat index: each end is one rounding of start + duration.
        Eo = E[a + 1:b + 1]
        fidx, oidx = masks[li]
        np.add(S, ideal[a:b, None, None], out=Eo)
        if len(fidx):
            Eo.reshape(-1)[fidx] = S.reshape(-1)[fidx] + orig[a:b].reshape(-1)[oidx]
    return E, S_all


def _masks(g: Graph, keys: np.ndarray, sc: Scenarios, nb: int, work: Work | None) -> list[tuple]:
    """Per level, flat indices of the cells that keep original durations: into [m, nb, k] and into [m, nb]."""
    if work is not None and work.masks is not None:
        g0, k0, s0, by_nb = work.masks
        if g0 is g and k0 is keys and s0 is sc:
            if nb in by_nb:
                return by_nb[nb]
        else:
            work.masks = None  # other scenarios now: free the old cells before building the new
    cols = np.asarray(sc.key)
    k = len(sc)
    masks = []
    bs = np.arange(nb, dtype=np.intp)
    for lv in g.levels:
        mask = keys[lv.a:lv.b][:, cols] == sc.value
        mask ^= sc.invert
        ri, ci = np.nonzero(mask)
        o = (ri.astype(np.intp) * nb)[:, None] + bs  # cell (r, b) of the level's [m, nb] originals
        f = (o * k + ci[:, None]).ravel()
        # int32 halves the cache (indices stay below m * nb * k).
        it = np.int32 if (lv.b - lv.a) * nb * k < 2**31 else np.intp
        masks.append((f.astype(it), o.ravel().astype(it)))
    if work is not None:
        if work.masks is None:
            work.masks = (g, keys, sc, {})
        work.masks[3][nb] = masks
    return masks


def simulate_pairs(g: Graph, ideal: np.ndarray, *, b0: int = 0, b1: int | None = None,
                   work: Work | None = None) -> np.ndarray:
    """Pair mode: ends [n + 1, nb, 2] (column 0 original DP rank, column 1 its ideal stand-in)."""
    b1 = g.batch if b1 is None else b1
    nb = b1 - b0
    E = _ends(g, nb, 2, work)
    orig = g.orig[:, b0:b1]
    buf, tmp_buf = _buffers(g, nb, 2, work)
    for lv in g.levels:
        a, b = lv.a, lv.b
        S, tmp = buf[:b - a], tmp_buf[:b - a]
        _pred_max(E, g, lv, S, tmp)
        _seg_max(lv.subgroups, S, tmp)
        if lv.wide_rows is not None:
            w = lv.wide_rows
            S[w] = S[w].max(axis=2, keepdims=True)
        Eo = E[a + 1:b + 1]
        np.add(S[:, :, 0], orig[a:b], out=Eo[:, :, 0])
        np.add(S[:, :, 1], ideal[a:b, None], out=Eo[:, :, 1])
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
