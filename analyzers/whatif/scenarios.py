"""The what-if scenarios of docs/whatif.md, section 5 and the metrics built from them.

``run_scenarios`` builds the graph of every chunk of steps, derives the ideal
durations (compute: mean per op type; communication: median transfer per op
type), then runs three passes per chunk:

1. the main pass: T (no delay), the replay (delays kept), T_ideal, one column
   per attribution group (S_t), one per PP rank (S_pp) and the last stage
   removed (M_S);
2. the pair pass: every DP rank at once (S_dp), see ``simulate_pairs``;
3. the top-worker pass: the top ceil(3%) workers by S_w = min(S_dp, S_pp)
   removed from T and added to T_ideal (M_W).

All ratios are of means over steps; per-step values divide by the step's
T_ideal. Cost is linear in ops: each pass touches every op once per column.
"""
from __future__ import annotations

import dataclasses
import math
import queue

import numpy as np

from core import parallel
from core.optypes import OPTYPES

from . import opcodes as T
from .graph import Graph, build_graph, inline_waits
from .load import PreparedOps
from .simulate import (
    Scenarios,
    Work,
    pair_step_times,
    simulate,
    simulate_pairs,
    step_times,
)

CHUNK_OPS = 1_000_000
"""Ops per chunk of steps: bounds the memory of a pass (ops x columns x 8 bytes)."""
BATCH_BYTES = 256 << 20
"""Simulated times held at once in a batched pass."""
ROW_CELLS = 16
"""Batch columns x scenario columns of a pass, at most (but at least one batch column): a row of E is then a few
cache lines, and the rows an op's predecessors sit in (a level of the graph back) stay in the core's cache."""
TOP_WORKER_FRACTION = 0.03

K_ALL, K_GROUP, K_PP, K_DP, K_TOP = range(5)


@dataclasses.dataclass
class Run:
    """Everything the analysis measured, per step and in total (times in seconds)."""

    steps: np.ndarray
    actual: np.ndarray
    sim: np.ndarray
    replay: np.ndarray
    ideal: np.ndarray
    by_group: dict[str, np.ndarray]  # T_ideal^{-g} per step
    by_pp: dict[int, np.ndarray]
    by_dp: dict[int, np.ndarray]
    ms_rem: np.ndarray
    ms_add: np.ndarray
    mw_rem: np.ndarray
    mw_add: np.ndarray
    top_workers: list[tuple[int, int]]
    ideal_ns: dict[str, float]
    graphs: list[Graph]
    ideal_arrays: list[np.ndarray]
    counts: dict[str, int]
    replay_error: float

    @staticmethod
    def ratio(num: np.ndarray, den: np.ndarray) -> float:
        d = float(np.mean(den)) if len(den) else float("nan")
        return float(np.mean(num)) / d if d > 0 else float("nan")


def _chunks(p: PreparedOps, chunk_ops: int) -> list[tuple[int, int]]:
    bounds = p.step_bounds()
    out: list[tuple[int, int]] = []
    lo = 0
    for s in range(1, len(bounds)):
        if bounds[s] - bounds[lo] >= chunk_ops or s == len(bounds) - 1:
            out.append((int(bounds[lo]), int(bounds[s])))
            lo = s
    return [c for c in out if c[1] > c[0]]


def _regular(p: PreparedOps) -> bool:
    """Every step has the same ops in the same order (so one graph serves all steps)."""
    bounds = p.step_bounds()
    n_s = len(bounds) - 1
    n_t = int(bounds[1] - bounds[0]) if n_s else 0
    if n_s < 2 or p.n != n_s * n_t:
        return False
    if not all(np.array_equal(a.reshape(n_s, n_t), np.broadcast_to(a[:n_t], (n_s, n_t)))
               for a in (p.code, p.dp, p.pp, p.mc, p.gmc)):
        return False
    # Waits of the compute stream follow the compute op they were recorded after: the same one in every step.
    lay = p.layout
    ws = (p.step_idx.astype(np.int64) * lay.dp_size + p.dp) * lay.pp_size + p.pp
    w_rows, _, _, w_prev_ord = inline_waits(p.code.astype(np.int64), ws, p.start, p.mb)
    if len(w_rows) == 0:
        return True
    anchor = np.full(p.n, -2, np.int64)
    anchor[w_rows] = w_prev_ord
    return np.array_equal(anchor.reshape(n_s, n_t), np.broadcast_to(anchor[:n_t], (n_s, n_t)))


def build_graphs(p: PreparedOps, *, overlapped_dp: bool, chunk_ops: int = CHUNK_OPS,
                 template: bool | None = None) -> list[Graph]:
    """One batched graph for regular windows, else one graph per chunk of steps."""
    if template is None:
        template = _regular(p)
    if template and _regular(p):
        bounds = p.step_bounds()
        g = build_graph(p, 0, int(bounds[1]), overlapped_dp=overlapped_dp, measure=False)
        n_s = len(bounds) - 1
        for k in ("p2p_noop", "p2p_unpaired"):
            g.counts[k] = g.counts.get(k, 0) * n_s
        g.row_base = bounds[:-1].astype(np.int64) - bounds[0]
        g.measure(p)
        return [g]
    return [build_graph(p, lo, hi, overlapped_dp=overlapped_dp) for lo, hi in _chunks(p, chunk_ops)]


def ideal_values(graphs: list[Graph]) -> np.ndarray:
    """Ideal duration (ns) per op code: mean for compute types, median transfer for communication."""
    vals = np.zeros(len(T.IS_COMM), np.float64)
    for c in range(len(vals)):
        parts = [g.orig[g.code == c].ravel() for g in graphs]
        x = np.concatenate(parts) if parts else np.zeros(0)
        if len(x):
            vals[c] = float(np.median(x)) if T.IS_COMM[c] else float(np.mean(x))
    return vals


def _keys(g: Graph, top: np.ndarray | None) -> np.ndarray:
    k = np.zeros((g.n, 5), np.int32)
    k[:, K_GROUP] = T.GROUP_OF_CODE[g.code]
    k[:, K_PP] = g.pp
    k[:, K_DP] = g.dp
    if top is not None:
        k[:, K_TOP] = top[g.dp, g.pp]
    return k


def _batches(g: Graph, k: int, n_threads: int = 1) -> list[tuple[int, int, np.ndarray | None]]:
    """Batch column ranges, with their steps, bounded by BATCH_BYTES of simulated times over all threads."""
    if g.batch == 1:
        return [(0, 1, None)]
    nb = max(1, BATCH_BYTES // n_threads // max(1, (g.n + 1) * k * 8))
    # At least a batch per thread: a narrow pass (pairs, top workers) would otherwise be one batch on one thread.
    nb = min(nb, -(-g.batch // n_threads), max(1, ROW_CELLS // k))
    step = 4 // math.gcd(k, 4)  # batch columns whose rows of E are whole vectors (see padded_columns)
    if nb > step:
        nb -= nb % step
    steps = np.arange(g.batch)
    return [(b0, min(b0 + nb, g.batch), steps[b0:b0 + nb]) for b0 in range(0, g.batch, nb)]


def _pieces(graphs: list[Graph], k: int, n_threads: int) -> list[tuple[int, int, int, np.ndarray | None]]:
    """(graph index, b0, b1, steps) of every batch of every graph: the independent work of one pass."""
    return [(gi, b0, b1, st) for gi, g in enumerate(graphs) for b0, b1, st in _batches(g, k, n_threads)]


def _threads(graphs: list[Graph], k: int) -> int:
    return parallel.threads(sum(g.n * g.batch for g in graphs) * k)


def _collect(acc: dict, steps: np.ndarray, vals: np.ndarray) -> None:
    for s, v in zip(np.asarray(steps).tolist(), vals):
        acc[s] = v


def run_scenarios(p: PreparedOps, *, overlapped_dp: bool, chunk_ops: int = CHUNK_OPS,
                  template: bool | None = None) -> Run:
    lay = p.layout
    graphs = build_graphs(p, overlapped_dp=overlapped_dp, chunk_ops=chunk_ops, template=template)
    ideal_code = ideal_values(graphs)
    ideals = [ideal_code[g.code] for g in graphs]
    counts: dict[str, int] = {}
    for g in graphs:
        for k, v in g.counts.items():
            counts[k] = counts.get(k, 0) + v

    groups_present = sorted({int(x) for g in graphs for x in np.unique(T.GROUP_OF_CODE[g.code])})
    pps = sorted({int(x) for g in graphs for x in np.unique(g.pp)})
    n_dp = len({int(x) for g in graphs for x in np.unique(g.dp)})
    last_pp = lay.pp_size - 1
    names = ["T", "replay", "ideal"] + [f"g{x}" for x in groups_present] + [f"pp{x}" for x in pps] + ["ms_rem"]
    key = [K_ALL, K_ALL, K_ALL] + [K_GROUP] * len(groups_present) + [K_PP] * len(pps) + [K_PP]
    value = [0, 0, 0] + groups_present + pps + [last_pp]
    invert = [False, False, True] + [False] * (len(groups_present) + len(pps)) + [True]
    delay = [False, True] + [False] * (len(names) - 2)
    main = Scenarios(tuple(names), np.array(key), np.array(value), np.array(invert), np.array(delay))

    # Scratch memory handed on from pass to pass, one per thread: fresh pages cost more than the pass.
    spare: queue.SimpleQueue[Work] = queue.SimpleQueue()

    def take() -> Work:
        try:
            return spare.get_nowait()
        except queue.Empty:
            return Work()

    def column_pass(sc: Scenarios, top: np.ndarray | None, replay_check: bool):
        """(steps, T[step, column], the replay's largest gap) of every batch, the batches on threads."""
        def run(pieces):
            work, out, gi_keys = take(), [], (-1, None)
            for gi, b0, b1, bsteps in pieces:
                g = graphs[gi]
                if gi_keys[0] != gi:
                    gi_keys = (gi, _keys(g, top))
                E, _ = simulate(g, ideals[gi], gi_keys[1], sc, b0=b0, b1=b1, work=work)
                # Fidelity of the model: the replay with delays must end every op where the trace does.
                gap = g.replay_gap(E, 1, p, b0) if replay_check and g.n else 0.0
                out.append((*step_times(g, E, bsteps), gap))
            spare.put(work)
            return out

        n_thr = _threads(graphs, len(sc))
        return parallel.map_slices(_pieces(graphs, len(sc), n_thr), run, n_thr)

    def pair_pass(pieces):
        work = take()
        out = [pair_step_times(graphs[gi], simulate_pairs(graphs[gi], ideals[gi], b0=b0, b1=b1, work=work),
                               bsteps, n_dp) for gi, b0, b1, bsteps in pieces]
        spare.put(work)
        return out

    per_step: dict[str, dict[int, float]] = {nm: {} for nm in names}
    replay_err = 0.0
    for st, tt, gap in column_pass(main, None, True):
        for j, nm in enumerate(names):
            _collect(per_step[nm], st, tt[:, j])
        replay_err = max(replay_err, gap)
    pair: dict[tuple[int, int], float] = {}
    n_thr = _threads(graphs, 2)
    for s2, d2, t2 in parallel.map_slices(_pieces(graphs, 2, n_thr), pair_pass, n_thr):
        for s, d, v in zip(s2.tolist(), d2.tolist(), t2):
            pair[(s, d)] = v

    steps_idx = np.array(sorted(per_step["T"]), np.int64)

    def arr(d: dict[int, float]) -> np.ndarray:
        return np.array([d.get(int(s), np.nan) for s in steps_idx], np.float64) / 1e9

    sim, ideal_t = arr(per_step["T"]), arr(per_step["ideal"])
    by_group = {T.GROUP_NAMES[x]: arr(per_step[f"g{x}"]) for x in groups_present}
    by_pp = {x: arr(per_step[f"pp{x}"]) for x in pps}
    dps = sorted({d for _, d in pair})
    by_dp = {d: np.array([pair.get((int(s), d), np.nan) for s in steps_idx]) / 1e9 for d in dps}

    # Worker slowdown and the top workers.
    mean_ideal = float(np.mean(ideal_t))
    s_dp = {d: float(np.mean(v)) / mean_ideal for d, v in by_dp.items()}
    s_pp = {x: float(np.mean(v)) / mean_ideal for x, v in by_pp.items()}
    present = p.workers_present()
    sw = np.full((lay.pp_size, lay.dp_size), np.nan)
    for x in range(lay.pp_size):
        for d in range(lay.dp_size):
            if present[d, x]:
                sw[x, d] = min(s_dp.get(d, np.nan), s_pp.get(x, np.nan))
    n_top = max(1, math.ceil(TOP_WORKER_FRACTION * lay.n_workers))
    flat = np.where(np.isnan(sw), -np.inf, sw).ravel()
    top_flat = np.argsort(-flat, kind="stable")[:n_top]
    top_workers = [(int(i % lay.dp_size), int(i // lay.dp_size)) for i in top_flat if np.isfinite(flat[i])]
    top = np.zeros((lay.dp_size, lay.pp_size), np.int32)
    for d, x in top_workers:
        top[d, x] = 1
    mw_sc = Scenarios(("mw_rem", "mw_add"), np.array([K_TOP, K_TOP]), np.array([1, 1]),
                      np.array([True, False]), np.array([False, False]))

    mw: dict[str, dict[int, float]] = {"mw_rem": {}, "mw_add": {}}
    for st, tt, _ in column_pass(mw_sc, top, False):
        _collect(mw["mw_rem"], st, tt[:, 0])
        _collect(mw["mw_add"], st, tt[:, 1])

    actual = _actual_step_times(p, steps_idx)
    return Run(
        steps=p.steps[steps_idx], actual=actual, sim=sim, replay=arr(per_step["replay"]), ideal=ideal_t,
        by_group=by_group, by_pp=by_pp, by_dp=by_dp, ms_rem=arr(per_step["ms_rem"]),
        ms_add=by_pp.get(last_pp, np.full(len(steps_idx), np.nan)),
        mw_rem=arr(mw["mw_rem"]), mw_add=arr(mw["mw_add"]), top_workers=top_workers,
        ideal_ns={nm: float(ideal_code[c]) for c, nm in enumerate(OPTYPES)},
        graphs=graphs, ideal_arrays=ideals, counts=counts, replay_error=replay_err / 1e9,
    )


def _actual_step_times(p: PreparedOps, steps_idx: np.ndarray) -> np.ndarray:
    """Last end minus first start per step (starts are already relative to the step start)."""
    bounds = p.step_bounds()
    out = np.zeros(len(bounds) - 1, np.int64)
    for s in range(len(out)):  # one step at a time: no [n_ops] temporary
        a, b = int(bounds[s]), int(bounds[s + 1])
        if b > a:
            out[s] = int(np.max(p.start[a:b] + p.dur[a:b]))
    return out[steps_idx] / 1e9
