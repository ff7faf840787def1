"""Compiled inner loops of the what-if passes (numba), one walk over the ops per pass.

Why compiled: a pass is ``start = max(ends of predecessors)``, a max over the
op's communication group, then ``end = start + duration`` for every (op,
batch column, scenario column). In numpy that is five or six passes over
[ops, columns] arrays per level of the graph plus index arrays for the
gathers; here it is one walk over the groups in level order, each touching an
op's predecessors once, with the columns as the contiguous inner loop.

The arithmetic is the numpy model's to the bit: the same maxima and one
rounding per addition in the same order (start + delay, then + duration).

Cached next to this file (``cache=True``); ``make setup`` compiles every
variant once (``warm``, about 20 s) so that no pipeline shard compiles one.
"""
from __future__ import annotations

import functools

import numba
import numpy as np

_JIT = {"cache": True, "nogil": True, "boundscheck": False, "error_model": "numpy"}


def _frozen(a):
    if isinstance(a, np.ndarray) and a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _entry(outputs: tuple[int, ...]):
    """Compile ``fn``; its callers pass every argument but ``outputs`` read-only.

    numba compiles a variant per argument type, and read-only is part of the type: Arrow's zero-copy
    columns are read-only, the analyzer's own arrays are not. Frozen views (free) keep one variant per
    dtype combination, which ``warm`` compiles ahead of use.
    """
    def wrap(fn):
        jitted = numba.njit(**_JIT)(fn)

        @functools.wraps(fn)
        def call(*args):
            return jitted(*(a if i in outputs else _frozen(a) for i, a in enumerate(args)))

        call.jitted = jitted
        return call
    return wrap


@_entry(outputs=(12, 13))
def pass_columns(pred_ptr, pred_idx, g_off, ideal, orig, delay, over_r, over_c, over_v, keep, keep_delay, b0,
                 E, S_all, want_start):  # pragma: no cover - compiled
    """Ends E[n + 1, nb, k] (row 0 = step start) of every scenario column on batch columns [b0, b0 + nb).

    ``g_off``: start rows of the groups in level order, then n. ``keep[i, j]``: op i keeps its original
    duration (``orig[i, b0 + c]``) in column j, else ``ideal[i]``. Columns with ``keep_delay[j]`` add the
    launch delay (``delay``, int32 ns; the rare longer ones in ``over_*``, sorted by row). Starts before
    the group max go to ``S_all`` when ``want_start``.

    The row loops are written as compare-and-select so that they vectorise (``max()`` on floats does
    not); times are never NaN or -0.0, so the result is the same.
    """
    n1, nb, k = E.shape
    W = nb * k  # a row of E: every (batch column, scenario column), contiguous
    E2 = E.reshape((n1, W))
    for w in range(W):
        E2[0, w] = 0.0
    gm = np.empty(W)
    acc = np.empty(W)
    dur = np.empty(W)
    dcols = np.flatnonzero(keep_delay)
    nd = dcols.shape[0]
    n_over = over_r.shape[0]
    cur = 0
    for gi in range(g_off.shape[0] - 1):
        a, b = g_off[gi], g_off[gi + 1]
        for m in range(a, b):
            p0, p1 = pred_ptr[m], pred_ptr[m + 1]
            row = E2[pred_idx[p0]]
            for w in range(W):
                acc[w] = row[w]
            for q in range(p0 + 1, p1):
                row = E2[pred_idx[q]]
                for w in range(W):
                    v = row[w]
                    acc[w] = v if v > acc[w] else acc[w]
            # Launch delays, in the columns that keep them (the rare long ones come from ``over_*``).
            if nd:
                for c in range(nb):
                    d = np.float64(delay[m, b0 + c])
                    for jj in range(nd):
                        acc[c * k + dcols[jj]] += d
                while cur < n_over and over_r[cur] < m:
                    cur += 1
                q = cur
                while q < n_over and over_r[q] == m:
                    c = over_c[q] - b0
                    if 0 <= c < nb:
                        for jj in range(nd):
                            acc[c * k + dcols[jj]] += over_v[q]  # the int32 delay is 0 there: one rounding
                    q += 1
            if want_start:
                S_all[m].reshape(W)[:] = acc
            if m == a:
                for w in range(W):
                    gm[w] = acc[w]
            else:
                for w in range(W):
                    v = acc[w]
                    gm[w] = v if v > gm[w] else gm[w]
        for m in range(a, b):
            # Each column's duration: the original one where the column keeps it, else the ideal one.
            di = ideal[m]
            kr = keep[m]
            for c in range(nb):
                o = orig[m, b0 + c]
                for j in range(k):
                    dur[c * k + j] = o if kr[j] else di
            out = E2[m + 1]
            for w in range(W):
                out[w] = gm[w] + dur[w]


@_entry(outputs=(7,))
def pass_pairs(pred_ptr, pred_idx, sg_off, sg_wide, ideal, orig, b0, E):  # pragma: no cover - compiled
    """Pair mode, ends E[n + 1, nb, 2]: column 0 the original DP rank, column 1 its ideal stand-in.

    ``sg_off``: start rows of the DP sub-groups in level order, then n; a wide sub-group (part of a
    DP-wide group) starts where the later of its two columns does.
    """
    n1, nb = E.shape[0], E.shape[1]
    E2 = E.reshape((n1, 2 * nb))  # a row: (original, stand-in) per batch column
    E2[0, :] = 0.0
    gm = np.empty(2 * nb)
    for gi in range(sg_off.shape[0] - 1):
        a, b = sg_off[gi], sg_off[gi + 1]
        gm[:] = -np.inf
        for m in range(a, b):
            for q in range(pred_ptr[m], pred_ptr[m + 1]):
                row = E2[pred_idx[q]]
                for w in range(2 * nb):
                    gm[w] = max(gm[w], row[w])
        if sg_wide[gi]:
            for c in range(nb):
                v = max(gm[2 * c], gm[2 * c + 1])
                gm[2 * c] = v
                gm[2 * c + 1] = v
        for m in range(a, b):
            di = ideal[m]
            out = E2[m + 1]
            for c in range(nb):
                out[2 * c] = gm[2 * c] + orig[m, b0 + c]
                out[2 * c + 1] = gm[2 * c + 1] + di


@_entry(outputs=(14, 15, 16, 17, 18))
def measure(pred_ptr, pred_idx, g_off, in_group, is_comm, is_wait, early, row_local, row_base, start, dur, clamp_ns,
            c_lo, c_hi, orig, delay, over_r, over_c, over_v):  # pragma: no cover - compiled
    """Original durations ``orig`` and launch delays ``delay`` [n, B] of every op and batch columns
    [c_lo, c_hi), read from the trace (``start``/``dur`` at row ``row_base[c] + row_local[i]``).

    A grouped op's original duration is its transfer: its end minus the group's latest start (below 0
    counts as negative and becomes 0; ``early`` ops may end so without being counted: a send that
    completed before its receive was posted, buffered or eager, and a wait of the compute stream that
    ended before the last member came, its rank having joined that collective earlier). The members of a group of waits of the compute stream
    (``is_wait``, one flag per group's first op) transfer at most as long as the member that came last,
    and end, for the delays of what follows them, that long after its start: such a wait folds every
    blocking of its compute op into one, and what the others waited beyond the last one's transfer was
    for later collectives of that compute op (FSDP's next layers), not transfer (with their own
    transfers, a slowed rank's lateness there went into the ideal's median transfer: S -6% against its
    control). None ends later than it did, so what follows it starts no earlier than its model end. A delay is the op's start
    minus its predecessors' latest end; below ``clamp_ns`` it counts as clamped and becomes 0; past int32
    it goes to ``over_*`` (as many as fit; the returned count says how many there were). Returns
    (negative, clamped, over).
    """
    n = orig.shape[0]
    cap = over_r.shape[0]
    neg = 0
    clamped = 0
    n_over = 0
    big = np.int64(2147483647)
    cb_max = 8  # columns at a time: one cache line of ``orig`` per op, not one line per op and column
    st = np.empty((n, cb_max), np.int64)
    en = np.empty((n + 1, cb_max), np.int64)  # actual ends, E rows: en[0] is the step start
    en[0, :] = 0
    gmax = np.empty(cb_max, np.int64)
    dep = np.empty(cb_max, np.int64)
    for c0 in range(c_lo, c_hi, cb_max):
        cb = min(cb_max, c_hi - c0)
        # Gather the columns' times into level order first: the loop below then reads nearby rows only.
        for i in range(n):
            for j in range(cb):
                r = row_base[c0 + j] + row_local[i]
                st[i, j] = start[r]
                en[i + 1, j] = st[i, j] + np.int64(dur[r])
        for gi in range(g_off.shape[0] - 1):
            a, b = g_off[gi], g_off[gi + 1]
            for j in range(cb):
                gmax[j] = st[a, j]
            for i in range(a + 1, b):
                for j in range(cb):
                    gmax[j] = max(gmax[j], st[i, j])
            for i in range(a, b):
                q0, q1 = pred_ptr[i], pred_ptr[i + 1]
                for j in range(cb):
                    dep[j] = en[pred_idx[q0], j]
                for q in range(q0 + 1, q1):
                    for j in range(cb):
                        dep[j] = max(dep[j], en[pred_idx[q], j])
                for j in range(cb):
                    du = en[i + 1, j] - st[i, j]
                    if is_comm[i]:
                        t = en[i + 1, j] - gmax[j] if in_group[i] else du
                        if t < 0:
                            neg += 0 if early[i] else 1
                            t = 0
                        orig[i, c0 + j] = np.float64(t)
                    else:
                        orig[i, c0 + j] = np.float64(du)
                    d = st[i, j] - dep[j]
                    if d < clamp_ns:
                        clamped += 1
                        d = 0
                    if d > big:
                        if n_over < cap:
                            over_r[n_over] = i
                            over_c[n_over] = c0 + j
                            over_v[n_over] = np.float64(d)
                        n_over += 1
                        d = 0
                    delay[i, c0 + j] = np.int32(d)
            if is_wait[a] and b - a > 1:
                for j in range(cb):
                    least = np.inf
                    for i in range(a, b):
                        if st[i, j] == gmax[j]:
                            least = min(least, orig[i, c0 + j])
                    for i in range(a, b):
                        t = min(orig[i, c0 + j], least)
                        orig[i, c0 + j] = t
                        en[i + 1, j] = gmax[j] + np.int64(t)
    return neg, clamped, n_over


@_entry(outputs=())
def replay_gap(E, col, row_local, row_base, b0, start, dur):  # pragma: no cover - compiled
    """Largest |simulated end - traced end| (ns) of column ``col`` over batch columns [b0, b0 + nb)."""
    worst = 0.0
    for c in range(E.shape[1]):
        base = row_base[b0 + c]
        for i in range(E.shape[0] - 1):
            r = base + row_local[i]
            x = abs(E[i + 1, c, col] - np.float64(np.int64(start[r]) + np.int64(dur[r])))
            if x > worst:
                worst = x
    return worst


# --- preparing the op table (load.prepare_ops) ---------------------------------------------------------------


@_entry(outputs=())
def relative_starts(step_idx, start, n_steps):  # pragma: no cover - compiled
    """(first start of each step, every start relative to its step's first)."""
    first = np.full(n_steps, np.iinfo(np.int64).max, np.int64)
    for i in range(start.shape[0]):
        s = step_idx[i]
        if start[i] < first[s]:
            first[s] = start[i]
    rel = np.empty(start.shape[0], np.int64)
    for i in range(start.shape[0]):
        rel[i] = start[i] - first[step_idx[i]]
    return first, rel


@numba.njit(**_JIT)
def _stream_key(step_idx, dp, pp, code, stream_of_code, dp_size, pp_size, i):  # pragma: no cover - compiled
    return ((np.int64(step_idx[i]) * dp_size + dp[i]) * pp_size + pp[i]) * 8 + stream_of_code[code[i]]


INSERTION_MAX = 256
"""Buckets up to this size are put in order by insertion (a few sorted runs, such as a worker-step's
forwards and backwards recorded type by type); larger ones by two stable sorts (no quadratic worst case)."""


@numba.njit(**_JIT)
def _insertion_sort(order, a, b, rel, seq):  # pragma: no cover - compiled
    """Stable sort of ``order[a:b]`` by (rel, seq) in place."""
    for t in range(a + 1, b):
        i = order[t]
        r, s = rel[i], seq[i]
        u = t
        while u > a:
            j = order[u - 1]
            if rel[j] > r or (rel[j] == r and seq[j] > s):
                order[u] = j
                u -= 1
            else:
                break
        order[u] = i


@_entry(outputs=())
def sort_rows(step_idx, dp, pp, code, stream_of_code, dp_size, pp_size, n_steps, rel, seq):  # pragma: no cover
    """Row order by (step, dp, pp, stream, start, seq), equal rows in input order.

    A stable counting sort puts every stream of a worker-step in its own bucket (traces arrive in
    per-worker runs, so this is two sequential passes); a bucket out of (start, seq) order is then
    sorted on its own (``INSERTION_MAX``).
    """
    n = rel.shape[0]
    n_keys = n_steps * dp_size * pp_size * 8
    ptr = np.zeros(n_keys + 1, np.int64)
    for i in range(n):
        ptr[_stream_key(step_idx, dp, pp, code, stream_of_code, dp_size, pp_size, i) + 1] += 1
    for k in range(n_keys):
        ptr[k + 1] += ptr[k]
    fill = ptr[:-1].copy()
    order = np.empty(n, np.int64)
    for i in range(n):
        k = _stream_key(step_idx, dp, pp, code, stream_of_code, dp_size, pp_size, i)
        order[fill[k]] = i
        fill[k] += 1
    for k in range(n_keys):
        a, b = ptr[k], ptr[k + 1]
        for t in range(a + 1, b):
            i0, i1 = order[t - 1], order[t]
            if rel[i1] < rel[i0] or (rel[i1] == rel[i0] and seq[i1] < seq[i0]):
                if b - a <= INSERTION_MAX:
                    _insertion_sort(order, a, b, rel, seq)
                    break
                seg = order[a:b].copy()
                seg = seg[np.argsort(seq[seg], kind="mergesort")]
                order[a:b] = seg[np.argsort(rel[seg], kind="mergesort")]
                break
    return order


@_entry(outputs=(14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24))
def gather_rows(order, t0, t1, step_idx, dp, pp, code, rel, dur, seq, mc, gmc, mb, pp_size,
                step_o, dp_o, pp_o, code_o, rel_o, dur_o, seq_o, mc_o, gmc_o, mb_o, dup):  # pragma: no cover
    """Rows ``order[t0:t1]`` into positions [t0, t1) of the (narrower) output columns.

    ``dup[t]`` marks an exact re-delivery: it repeats the previous row's step, worker, type, seq and
    start (the caller drops those). A chunk below 0 becomes 0 (the model has none) and a missing
    global chunk (below 0) follows from the chunk and the stage. Ranges are independent (threads).
    Returns the number of re-deliveries in the range.
    """
    n_dup = 0
    for t in range(t0, t1):
        i = order[t]
        d = False
        if t > 0:
            j = order[t - 1]
            d = (rel[i] == rel[j] and code[i] == code[j] and seq[i] == seq[j] and dp[i] == dp[j]
                 and pp[i] == pp[j] and step_idx[i] == step_idx[j])
        dup[t] = d
        n_dup += d
        step_o[t] = step_idx[i]
        dp_o[t] = dp[i]
        pp_o[t] = pp[i]
        code_o[t] = code[i]
        rel_o[t] = rel[i]
        dur_o[t] = dur[i]
        seq_o[t] = seq[i]
        c = max(mc[i], 0)
        mc_o[t] = c
        g = gmc[i]
        gmc_o[t] = c * pp_size + pp[i] if g < 0 else g
        mb_o[t] = mb[i]
    return n_dup


def warm() -> None:
    """Compile (or load from the disk cache) every variant the analyzer calls, on tiny inputs.

    Run once at setup (``make setup``): a kernel compiled on first use inside a pipeline shard would hold
    its first window for seconds. The variants: rank and step columns of int16 or int32, durations of
    int16, int32 or int64, predecessor rows of int32 or int64.
    """
    i16, i32, i64, f64 = np.int16, np.int32, np.int64, np.float64
    stream = np.zeros(4, np.int8)
    for step_t in (i16, i32):
        for rank_t in (i16, i32):
            z = np.zeros(2, i32)
            order = np.arange(2, dtype=i64)
            first, rel = relative_starts(z, np.arange(2, dtype=i64), 1)
            order = sort_rows(z, z, z, np.zeros(2, np.int8), stream, 1, 1, 1, rel, z)
            out = [np.empty(2, t) for t in (step_t, rank_t, rank_t, np.int8, i64, i64, i32, i16, i16, i32)]
            z16 = np.zeros(2, i16)  # chunks: OP_SPAN's int16
            gather_rows(order, 0, 2, z, z, z, np.zeros(2, np.int8), rel, np.zeros(2, i64), z, z16, z16, z, 1, *out,
                        np.empty(2, np.bool_))
    bounds = np.array([0, 1, 2], i64)  # group starts, then n
    ptr = np.array([0, 1, 2], i64)
    flags = np.zeros(2, np.bool_)
    rows = np.arange(2, dtype=i64)
    for idx_t in (i32, i64):
        pidx = np.zeros(2, idx_t)
        for dur_t in (i16, i32, i64):
            orig, delay = np.zeros((2, 1), f64), np.zeros((2, 1), i32)
            over = (np.zeros(1, i64), np.zeros(1, i64), np.zeros(1, f64))
            measure(ptr, pidx, bounds, flags, flags, flags, flags, rows, np.zeros(1, i64), np.zeros(2, i64),
                    np.zeros(2, dur_t), -1, 0, 1, orig, delay, *over)
            E = np.zeros((3, 1, 2), f64)
            replay_gap(E, 1, rows, np.zeros(1, i64), 0, np.zeros(2, i64), np.zeros(2, dur_t))
        E = np.zeros((3, 1, 2), f64)
        pass_columns(ptr, pidx, bounds, np.zeros(2, f64), np.zeros((2, 1), f64), np.zeros((2, 1), i32),
                     over[0][:0], over[1][:0], over[2][:0], np.zeros((2, 2), np.bool_), np.zeros(2, np.bool_), 0,
                     E, np.zeros((2, 1, 2), f64), True)
        pass_pairs(ptr, pidx, bounds, flags, np.zeros(2, f64), np.zeros((2, 1), f64), 0, E)
