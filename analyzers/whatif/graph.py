"""The dependency model of one chunk of steps (docs/whatif.md, section 2), as arrays.

``build_graph`` takes a contiguous range of steps of ``PreparedOps`` and
returns a ``Graph``: the ops in *level order* (every op comes after all ops it
depends on; all members of a communication group share a level, and members of
one group are contiguous), the predecessor lists as CSR, the group and
DP-pair sub-group segments of every level, the no-delay ("original")
durations and the launch delays measured on the trace.

Model details fixed by the golden results:
- a recv depends on the previous compute op of its own direction before its
  consumer (forward-recv k waits for forward-compute k-1); the first
  backward-recv waits for the second-to-last forward-compute before the first
  backward-compute (1F1B warm-up);
- a communication op's original duration is its transfer time, end minus the
  latest start of its group;
- a launch delay below -10 ms is clamped to 0.

A ``params-all-gather`` or ``grads-reduce-scatter`` recorded with a microbatch
(``mb_id`` >= 0; the golden traces have none) is a wait of the compute stream,
split off the forward or backward that blocked in it (FSDP's all-gathers,
DDP's and FSDP's gradient reduction, once per microbatch where gradients are
accumulated): it sits between the compute-stream op that started before it
and the one that starts after it, groups with the DP ranks' waits after the
same compute op, and transfers at most as long as the member that came last
(``kernels.measure``). It takes no part in the chunk and post-compute rules.

Raises ``WhatIfInputError`` naming the ops of a dependency cycle.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from core import parallel

from . import kernels
from . import opcodes as T
from .levels import levels_of_groups
from .load import PreparedOps

DELAY_CLAMP_NS = -10_000_000
"""Launch delays below this are measurement noise (clock skew): set to 0."""


@dataclasses.dataclass
class Graph:
    """Ops in level order. Time arrays are [n, B]: B batch columns of the same structure.

    The general path has one graph per chunk of steps and B = 1; when every
    step has the same ops (the usual case), one graph of one step serves all
    steps, one step per column (``rows`` then maps each column to its step).
    """

    n: int
    row_local: np.ndarray  # [n] int64: row in PreparedOps (of the first batch column)
    code: np.ndarray
    dp: np.ndarray
    pp: np.ndarray
    step: np.ndarray  # int32, index into PreparedOps.steps (B = 1 graphs)
    is_comm: np.ndarray
    in_group: np.ndarray  # member of a group of two or more (its duration is a transfer)
    is_wait: np.ndarray  # a wait of the compute stream (``inline_waits``): transfers at most as its last member
    early: np.ndarray  # may end before its group's last start unremarked (sends, waits): see kernels.measure
    g_off: np.ndarray  # starts of the groups in level order, then n (int64)
    sg_off: np.ndarray  # starts of the pair mode's sub-groups in level order, then n
    sg_wide: np.ndarray  # bool per sub-group: part of a DP-wide group
    pred_idx: np.ndarray  # rows of E (0 = step start, op i = i + 1)
    pred_ptr: np.ndarray  # CSR offsets into pred_idx, n + 1
    end_pos: np.ndarray  # positions of step-end ops, sorted by (step, dp)
    end_off: np.ndarray  # reduceat offsets of end_pos per step
    end_steps: np.ndarray  # steps (index into PreparedOps.steps) of end_off
    end_sd_off: np.ndarray  # reduceat offsets of end_pos per (step, dp)
    end_sd_step: np.ndarray
    end_sd_dp: np.ndarray
    counts: dict[str, int]
    orig: np.ndarray | None = None  # [n, B] float64 ns: compute duration or transfer duration
    delay: np.ndarray | None = None  # [n, B] int32 ns launch delay (clamped); 0 where delay_over holds it
    delay_over: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (row, column, ns) of delays > 2^31 ns

    row_base: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(1, np.int64))  # [B] row offsets

    @property
    def batch(self) -> int:
        return len(self.row_base)

    def rows(self, b0: int = 0, b1: int | None = None) -> np.ndarray:
        """[n, b1 - b0] rows in PreparedOps of every op of batch columns [b0, b1)."""
        return self.row_base[None, b0:b1] + self.row_local[:, None]

    def measure(self, p: PreparedOps) -> None:
        """Original durations and launch delays [n, B] (level order) from the trace times in ``p``."""
        n, B = self.n, self.batch
        self.orig = np.empty((n, B), np.float64)
        self.delay = np.empty((n, B), np.int32)  # int ns, exact; >= -10 ms after the clamp

        def run(columns):
            out = []
            for c_lo, c_hi in columns:
                cap = _over_room(self, c_hi - c_lo)
                while True:
                    over = (np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.float64))
                    neg, clamped, n_over = kernels.measure(
                        self.pred_ptr, self.pred_idx, self.g_off, self.in_group, self.is_comm, self.is_wait,
                        self.early, self.row_local,
                        self.row_base, p.start, p.dur, DELAY_CLAMP_NS, c_lo, c_hi, self.orig, self.delay, *over)
                    if n_over <= cap:
                        break
                    cap = n_over
                out.append((neg, clamped, tuple(x[:n_over] for x in over)))
            return out

        # Column ranges, one per thread, in whole blocks of the kernel's 8 columns.
        n_thr = max(1, min(parallel.threads(n * B), B // 8))
        parts = parallel.map_slices(parallel.ranges(B, n_thr, 8), run, n_thr)
        self.counts["negative_transfer"] = sum(x[0] for x in parts)
        self.counts["delay_clamped"] = sum(x[1] for x in parts)
        r, c, v = (np.concatenate([x[2][i] for x in parts]) for i in range(3))
        if len(r):
            o = np.argsort(r, kind="stable")  # by row, then by column: a pass reads them in this order
            self.delay_over = (r[o], c[o], v[o])
        else:
            self.delay_over = None

    def replay_gap(self, E: np.ndarray, col: int, p: PreparedOps, b0: int = 0) -> float:
        """Largest |simulated - traced| end (ns) of column ``col`` of a pass on batch columns from ``b0``."""
        return float(kernels.replay_gap(E, col, self.row_local, self.row_base, b0, p.start, p.dur))


def _over_room(g: Graph, n_columns: int) -> int:
    """Room for delays over 2.1 s in a first measuring call (a second one makes room for more).

    They are mostly those of ops that wait only for the step start (a step's first op after a long
    gap): one for each of those in every batch column.
    """
    return n_columns * int(np.count_nonzero(g.pred_idx[g.pred_ptr[:-1]] == 0)) + 1024


def _run_starts(sorted_keys: np.ndarray) -> np.ndarray:
    flag = np.ones(len(sorted_keys), bool)
    if len(sorted_keys) > 1:
        flag[1:] = sorted_keys[1:] != sorted_keys[:-1]
    return flag


def _ordinal(keys: np.ndarray) -> np.ndarray:
    """Position of each element among the elements with the same key, in array order."""
    if len(keys) == 0:
        return np.zeros(0, np.int64)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    flag = _run_starts(sk)
    idx = np.arange(len(keys))
    run_start = np.maximum.accumulate(np.where(flag, idx, 0))
    out = np.empty(len(keys), np.int64)
    out[order] = idx - run_start
    return out


def _match(keys_a: np.ndarray, keys_b: np.ndarray) -> np.ndarray:
    """For each key of a, the index of the equal key in b (unique keys), else -1."""
    if len(keys_a) == 0 or len(keys_b) == 0:
        return np.full(len(keys_a), -1, np.int64)
    order = np.argsort(keys_b, kind="stable")
    sb = keys_b[order]
    pos = np.searchsorted(sb, keys_a)
    pos_c = np.minimum(pos, len(sb) - 1)
    hit = sb[pos_c] == keys_a
    return np.where(hit, order[pos_c], -1)


def _prev_same(mask: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """For each element, the index of the last earlier element with mask set in the same ws, else -1."""
    idx = np.arange(len(mask))
    last = np.maximum.accumulate(np.where(mask, idx, -1))
    prev = np.full(len(mask), -1, np.int64)
    if len(mask) > 1:
        prev[1:] = last[:-1]
    ok = prev >= 0
    ok[ok] = ws[prev[ok]] == ws[ok]
    return np.where(ok, prev, -1)


class _Edges:
    def __init__(self) -> None:
        self.src: list[np.ndarray] = []
        self.dst: list[np.ndarray] = []

    def add(self, src: np.ndarray, dst: np.ndarray) -> None:
        ok = (src >= 0) & (dst >= 0)
        self.src.append(np.asarray(src)[ok].astype(np.int64))
        self.dst.append(np.asarray(dst)[ok].astype(np.int64))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.src:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(self.src), np.concatenate(self.dst)


def _p2p_mapping(code, ws, fb, is_f_fb, gmc_fb, kind: int, direction_f: bool, eligible_fb: np.ndarray,
                 n_ws: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Map the p2p ops of one kind to compute ops (positions in ``fb``).

    Returns (rows of the p2p ops, fb position of their compute or -1 for a
    no-op, number of no-ops). The k-th recorded op of a worker-step maps to its
    k-th eligible compute (one whose peer chunk exists); when a worker-step
    records one op per compute, those of ineligible computes are no-ops.
    """
    rows = np.flatnonzero(code == kind)
    dir_mask = is_f_fb if direction_f else ~is_f_fb
    cand_all = np.flatnonzero(dir_mask)
    cand_el = np.flatnonzero(dir_mask & eligible_fb)
    n_rec = np.bincount(ws[rows], minlength=n_ws)
    n_all = np.bincount(ws[fb[cand_all]], minlength=n_ws)
    n_el = np.bincount(ws[fb[cand_el]], minlength=n_ws)
    use_all = (n_rec == n_all) & (n_rec != n_el)
    k = _ordinal(ws[rows])
    m = int(max(n_rec.max(initial=0), n_all.max(initial=0))) + 1
    key_rows = ws[rows].astype(np.int64) * m + k
    t_all = _match(key_rows, ws[fb[cand_all]].astype(np.int64) * m + _ordinal(ws[fb[cand_all]]))
    t_el = _match(key_rows, ws[fb[cand_el]].astype(np.int64) * m + _ordinal(ws[fb[cand_el]]))
    target = np.where(use_all[ws[rows]], np.where(t_all >= 0, cand_all[np.maximum(t_all, 0)], -1),
                      np.where(t_el >= 0, cand_el[np.maximum(t_el, 0)], -1))
    ok = target >= 0
    ok[ok] = eligible_fb[target[ok]]
    target = np.where(ok, target, -1)
    return rows, target, int((~ok).sum())


def inline_waits(code: np.ndarray, ws: np.ndarray, start: np.ndarray, mb: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The DP collectives that are waits of the compute stream (see the module docstring), in row order.

    Rows are sorted by worker-step, stream, start. Returns (their rows, the row of the compute-stream op
    that started before each and of the one that starts at or after it (-1: none in its worker-step), the
    ordinal of the one before among its worker-step's compute-stream ops (-1: none)).
    """
    waits = np.flatnonzero(((code == T.PAG) | (code == T.RS)) & (mb >= 0))
    none = np.zeros(0, np.int64)
    if len(waits) == 0:
        return waits, none, none, none
    comp = np.flatnonzero(T.STREAM_OF_CODE[code] == T.S_COMPUTE)
    rows = np.concatenate([comp, waits])
    is_wait = np.concatenate([np.zeros(len(comp), bool), np.ones(len(waits), bool)])
    # Merged by worker-step and start; a wait comes before a compute op that starts with it (that op waited).
    o = np.lexsort((rows, ~is_wait, start[rows], ws[rows]))
    rows, is_wait, wss = rows[o], is_wait[o], ws[rows[o]]
    idx = np.arange(len(rows))
    last = np.maximum.accumulate(np.where(~is_wait, idx, -1))
    nxt = np.minimum.accumulate(np.where(~is_wait, idx, len(rows))[::-1])[::-1]
    w = np.flatnonzero(is_wait)
    before, after = last[w], nxt[w]
    ok_b = before >= 0
    ok_b[ok_b] = wss[before[ok_b]] == wss[w[ok_b]]
    ok_a = after < len(rows)
    ok_a[ok_a] = wss[after[ok_a]] == wss[w[ok_a]]
    comp_ord = np.full(len(rows), -1, np.int64)
    comp_ord[~is_wait] = _ordinal(wss[~is_wait])  # compute rows are in time order within their worker-step
    prev_row = np.where(ok_b, rows[np.maximum(before, 0)], -1)
    next_row = np.where(ok_a, rows[np.minimum(after, len(rows) - 1)], -1)
    prev_ord = np.where(ok_b, comp_ord[np.maximum(before, 0)], -1)
    back = np.argsort(rows[w], kind="stable")  # row order
    return rows[w][back], prev_row[back], next_row[back], prev_ord[back]


def build_graph(p: PreparedOps, lo: int, hi: int, *, overlapped_dp: bool, measure: bool = True) -> Graph:
    """Dependency graph of rows [lo, hi) of ``p`` (whole steps)."""
    lay = p.layout
    DP, PP = lay.dp_size, lay.pp_size
    n_chunks = max(lay.vpp_size * PP, int(p.gmc[lo:hi].max(initial=0)) + 1)
    code = p.code[lo:hi].astype(np.int64)
    dp = p.dp[lo:hi].astype(np.int64)
    pp = p.pp[lo:hi].astype(np.int64)
    step = p.step_idx[lo:hi].astype(np.int64)
    s0 = int(step.min())
    lstep = step - s0
    n_steps = int(lstep.max()) + 1
    seq_mc = p.mc[lo:hi].astype(np.int64)
    gmc = p.gmc[lo:hi].astype(np.int64)
    ws = (lstep * DP + dp) * PP + pp
    n_ws = n_steps * DP * PP
    n = hi - lo
    counts: dict[str, int] = {}

    # --- compute ops (forward/backward) in stream order -------------------------------
    fb = np.flatnonzero((code == T.F) | (code == T.B))
    is_f = code[fb] == T.F
    ws_fb = ws[fb]
    gmc_fb = gmc[fb]
    prev_f = _prev_same(is_f, ws_fb)
    prev_b = _prev_same(~is_f, ws_fb)
    # Recv dependency of each compute consumer (positions in fb).
    # At the last forward before the first backward, prev_f gives the forward before it.
    prevprev_f = np.where(prev_f >= 0, prev_f[np.maximum(prev_f, 0)], -1)
    recv_dep = np.where(is_f, prev_f, np.where(prev_b >= 0, prev_b, prevprev_f))

    # --- p2p mapping --------------------------------------------------------------------
    last_chunk = n_chunks - 1
    fr_rows, fr_t, nf1 = _p2p_mapping(code, ws, fb, is_f, gmc_fb, T.FR, True, gmc_fb > 0, n_ws)
    br_rows, br_t, nf2 = _p2p_mapping(code, ws, fb, is_f, gmc_fb, T.BR, False, gmc_fb < last_chunk, n_ws)
    fs_rows, fs_t, nf3 = _p2p_mapping(code, ws, fb, is_f, gmc_fb, T.FS, True, gmc_fb < last_chunk, n_ws)
    bs_rows, bs_t, nf4 = _p2p_mapping(code, ws, fb, is_f, gmc_fb, T.BS, False, gmc_fb > 0, n_ws)
    counts["p2p_noop"] = nf1 + nf2 + nf3 + nf4

    # Chunk ordinal of every compute: pairs peers across stages.
    n_ord = int(np.bincount(ws_fb, minlength=1).max(initial=0)) + 1
    ckey = ((lstep[fb] * DP + dp[fb]) * n_chunks + gmc_fb) * 2 + is_f
    cord = _ordinal(ckey)

    def peer_key(t: np.ndarray, delta: int, fwd: bool) -> np.ndarray:
        tt = np.maximum(t, 0)
        g = gmc_fb[tt] + delta
        k = (((lstep[fb[tt]] * DP + dp[fb[tt]]) * (n_chunks + 2) + (g + 1)) * 2 + int(fwd)) * n_ord + cord[tt]
        return np.where(t >= 0, k, -1 - np.arange(len(t)))

    fs_peer = _match(peer_key(fs_t, +1, True), peer_key(fr_t, 0, True))
    bs_peer = _match(peer_key(bs_t, -1, False), peer_key(br_t, 0, False))
    fs_peer = np.where(fs_t >= 0, fs_peer, -1)
    bs_peer = np.where(bs_t >= 0, bs_peer, -1)

    # --- no-ops are dropped from the model ---------------------------------------------
    keep = np.ones(n, bool)
    keep[fr_rows[fr_t < 0]] = False
    keep[br_rows[br_t < 0]] = False
    keep[fs_rows[fs_t < 0]] = False
    keep[bs_rows[bs_t < 0]] = False
    newpos = np.cumsum(keep) - 1
    newpos[~keep] = -1

    def nr(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        return np.where(x >= 0, newpos[np.maximum(x, 0)], -1)

    kept = np.flatnonzero(keep)
    code, dp, pp, lstep, seq_mc, gmc, ws = (a[kept] for a in (code, dp, pp, lstep, seq_mc, gmc, ws))
    fb = nr(fb)
    n = len(kept)
    rows = kept + lo

    edges = _Edges()
    # Stream order.
    stream = T.STREAM_OF_CODE[code].astype(np.int64)
    same = np.zeros(n, bool)
    if n > 1:
        same[1:] = (ws[1:] == ws[:-1]) & (stream[1:] == stream[:-1])
    i = np.flatnonzero(same)
    edges.add(i - 1, i)

    # Recvs: recv -> consumer, consumer's recv dependency -> recv. Computes -> sends.
    fb_recv_dep = np.where(recv_dep >= 0, fb[np.maximum(recv_dep, 0)], -1)
    for r_rows, r_t in ((fr_rows, fr_t), (br_rows, br_t)):
        ok = r_t >= 0
        rr, tt = nr(r_rows[ok]), r_t[ok]
        edges.add(rr, fb[tt])
        edges.add(fb_recv_dep[tt], rr)
    for s_rows, s_t in ((fs_rows, fs_t), (bs_rows, bs_t)):
        ok = s_t >= 0
        edges.add(fb[s_t[ok]], nr(s_rows[ok]))

    # Waits of the compute stream: between the compute op before them and the one after.
    w_rows, w_prev, w_next, w_prev_ord = inline_waits(code, ws, p.start[rows], p.mb[rows])
    inline = np.zeros(n, bool)
    inline[w_rows] = True
    edges.add(w_prev, w_rows)
    edges.add(w_rows, w_next)

    # params-all-gather -> first forward of its chunk (first forward of the worker if none).
    f_rows = fb[is_f]
    big = np.iinfo(np.int64).max
    tmp = np.full(n_ws, big, np.int64)
    np.minimum.at(tmp, ws[f_rows], f_rows)
    first_f_ws = np.where(tmp == big, -1, tmp)
    mc_span = int(seq_mc.max(initial=0)) + 1
    pag = np.flatnonzero((code == T.PAG) & ~inline)
    if len(pag):
        tmp = np.full(n_ws * mc_span, big, np.int64)
        np.minimum.at(tmp, ws[f_rows] * mc_span + seq_mc[f_rows], f_rows)
        tgt = tmp[ws[pag] * mc_span + np.minimum(seq_mc[pag], mc_span - 1)]
        tgt = np.where(tgt == big, first_f_ws[ws[pag]], tgt)
        edges.add(pag, tgt)

    # Post-compute chain.
    # The compute stream is sequential: its last forward/backward is the one that ends last.
    last_fb = np.full(n_ws, -1, np.int64)
    np.maximum.at(last_fb, ws[fb], fb)

    def first_last(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        r = np.flatnonzero(mask)
        fst = np.full(n_ws, big, np.int64)
        lst = np.full(n_ws, -1, np.int64)
        np.minimum.at(fst, ws[r], r)
        np.maximum.at(lst, ws[r], r)
        return np.where(fst == big, -1, fst), lst

    chain_rs = (code == T.RS) & ~inline
    _, rs_last = first_last(chain_rs)
    if overlapped_dp:
        cats = [code == T.GC, code == T.LN, code == T.EMB, code == T.SAR, code == T.CLIP, code == T.OPT]
        rs = np.flatnonzero(chain_rs)
        if len(rs):
            b_rows = fb[~is_f]
            tmp = np.full(n_ws * mc_span, -1, np.int64)
            np.maximum.at(tmp, ws[b_rows] * mc_span + seq_mc[b_rows], b_rows)
            src = tmp[ws[rs] * mc_span + np.minimum(seq_mc[rs], mc_span - 1)]
            edges.add(src, rs)
    else:
        cats = [code == T.GC, code == T.LN, code == T.EMB, chain_rs, code == T.CLIP, code == T.OPT]
    prev_last = last_fb.copy()
    pending_rs = rs_last.copy() if overlapped_dp else np.full(n_ws, -1, np.int64)
    for ci, mask in enumerate(cats):
        fst, lst = first_last(mask)
        has = fst >= 0
        edges.add(prev_last[has], fst[has])
        if ci >= 3:  # overlapped: the first chain op after the embedding all-reduce waits for the last RS
            w = (pending_rs >= 0) & has
            edges.add(pending_rs[w], fst[w])
            pending_rs = np.where(w, -1, pending_rs)
        prev_last = np.where(has, lst, prev_last)

    src, dst = edges.arrays()

    # --- communication groups -----------------------------------------------------------
    gkey = np.arange(n, dtype=np.int64) * 8  # local op: its own group
    for s_rows, s_t, peer, r_rows in ((fs_rows, fs_t, fs_peer, fr_rows), (bs_rows, bs_t, bs_peer, br_rows)):
        ok = (s_t >= 0) & (peer >= 0)
        srow = nr(s_rows[ok])
        rrow = nr(r_rows[peer[ok]])
        good = (srow >= 0) & (rrow >= 0)
        gkey[rrow[good]] = gkey[srow[good]]
    ordn = np.zeros(n, np.int64)
    wide = np.zeros(n, bool)
    coll = np.flatnonzero(np.isin(code, (T.PAG, T.RS, T.SAR, T.EMB, T.CLIP)))
    if len(coll):
        # The k-th collective of its type on the worker-step; a wait of the compute stream is the one after
        # the same compute op on every DP rank, whatever other waits a rank recorded (it records none where
        # it never waited).
        lone_c = coll[~inline[coll]]
        ordn[lone_c] = _ordinal(ws[lone_c] * 16 + code[lone_c])
        if len(w_rows):
            base = int(ordn[lone_c].max(initial=-1)) + 1
            sub = _ordinal((ws[w_rows] * 16 + code[w_rows]) * (n + 1) + w_prev_ord + 1)
            per = int(sub.max()) + 1
            ordn[w_rows] = base + (w_prev_ord + 1) * per + sub
        m_ord = int(ordn[coll].max()) + 1
        c = code[coll]
        # DP collectives: one stage, all DP ranks.  Embedding: one pipeline.  Clip: all.
        a = np.where(np.isin(c, (T.PAG, T.RS, T.SAR)), pp[coll], np.where(c == T.EMB, dp[coll], 0))
        k = ((lstep[coll] * 16 + c) * (max(DP, PP) + 1) + a) * m_ord + ordn[coll]
        _, inv = np.unique(k, return_inverse=True)
        gkey[coll] = (n + inv.reshape(-1)) * 8 + 1
    _, gid = np.unique(gkey, return_inverse=True)
    gid = gid.reshape(-1)
    n_groups = int(gid.max()) + 1 if n else 0
    gsize = np.bincount(gid, minlength=n_groups)
    # DP-wide groups (DP collectives and clip spanning several DP ranks) split by DP rank in pair mode.
    if len(coll):
        gmin = np.full(n_groups, DP, np.int64)
        gmax = np.full(n_groups, -1, np.int64)
        np.minimum.at(gmin, gid[coll], dp[coll])
        np.maximum.at(gmax, gid[coll], dp[coll])
        c = code[coll]
        wide[coll] = (c != T.EMB) & (gmax[gid[coll]] > gmin[gid[coll]])
    counts["p2p_unpaired"] = int(np.isin(code, (T.FS, T.FR, T.BS, T.BR)).sum()
                                 - 2 * int((np.isin(code, (T.FS, T.BS)) & (gsize[gid] == 2)).sum()))

    # --- levels on the graph of groups ----------------------------------------------------
    glevel = levels_of_groups(gid[src], gid[dst], n_groups, p, rows, code, gid)
    # Sub-groups: a DP-wide group split by DP rank (pair mode).
    sgkey = gid.astype(np.int64) * (DP + 1) + np.where(wide, dp + 1, 0)
    _, sgid = np.unique(sgkey, return_inverse=True)
    sgid = sgid.reshape(-1)
    n_sg = int(sgid.max()) + 1 if n else 0
    lvl = glevel[gid]
    order = np.argsort(lvl.astype(np.int64) * (n_sg + 1) + sgid, kind="stable")
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)

    # Predecessors in level order, E rows shifted by one (row 0 is the step start).
    psrc = pos[src] + 1
    pdst = pos[dst]
    has_pred = np.zeros(n, bool)
    has_pred[pdst] = True
    lone = np.flatnonzero(~has_pred)
    psrc = np.concatenate([psrc, np.zeros(len(lone), np.int64)])
    pdst = np.concatenate([pdst, lone])
    eo = np.argsort(pdst, kind="stable")
    pred_idx = psrc[eo]
    pred_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(pdst, minlength=n), out=pred_ptr[1:])
    idx_dtype = np.int32 if n + 1 < 2**31 else np.int64
    pred_idx = pred_idx.astype(idx_dtype)
    gflag_all = _run_starts(gid[order])
    g_off_all = np.flatnonzero(gflag_all)

    # Groups and pair-mode sub-groups as contiguous runs of rows: a pass walks them in this order.
    sg_start = np.flatnonzero(_run_starts(sgid[order]) | gflag_all)

    # Step ends: the optimizer ops, or every op of a step without one.
    step_o = lstep[order]
    code_o = code[order]
    has_opt = np.zeros(n_steps, bool)
    has_opt[step_o[code_o == T.OPT]] = True
    is_end = (code_o == T.OPT) | ~has_opt[step_o]
    end_pos = np.flatnonzero(is_end)
    dp_o = dp[order]
    eo2 = np.argsort(step_o[end_pos] * (DP + 1) + dp_o[end_pos], kind="stable")
    end_pos = end_pos[eo2]
    es = step_o[end_pos]
    end_off = np.flatnonzero(_run_starts(es))
    sd_off = np.flatnonzero(_run_starts(es * (DP + 1) + dp_o[end_pos]))
    g = Graph(
        n=n, row_local=rows[order].astype(np.int64), code=code_o.astype(np.int8), dp=dp[order].astype(np.int32),
        pp=pp[order].astype(np.int32), step=(step_o + s0).astype(np.int32), is_comm=T.IS_COMM[code_o],
        in_group=(gsize[gid] > 1)[order], is_wait=inline[order],
        early=(inline | (code == T.FS) | (code == T.BS))[order], g_off=np.append(g_off_all, n).astype(np.int64),
        sg_off=np.append(sg_start, n).astype(np.int64), sg_wide=wide[order][sg_start],
        pred_idx=pred_idx, pred_ptr=pred_ptr,
        end_pos=end_pos, end_off=end_off, end_steps=(es[end_off] + s0).astype(np.int64),
        end_sd_off=sd_off, end_sd_step=(es[sd_off] + s0).astype(np.int64), end_sd_dp=dp_o[end_pos[sd_off]],
        counts=counts,
    )
    if measure:
        g.measure(p)
    return g
