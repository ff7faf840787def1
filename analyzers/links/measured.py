"""Per-link evidence from what each rank records itself: when it entered and left each call.

A training process cannot time one connection of gloo or NCCL, but every rank
records the enter and exit of each point-to-point call and each collective
on the job clock (``ingest.torch_ccl``). Put side by side, the ranks' records
of one call give what a per-connection timer would:

- point-to-point: the n-th send of group ``p2p:a>b`` on rank a is the n-th
  receive on rank b (both sides number their calls per direction).
  transfer = receiver exit - max(sender enter, receiver enter): the data's
  time in flight once both sides were ready. receiver wait = sender enter -
  receiver enter when the sender came later: a late sender.
- collectives: collective n of a group, on every member. comm = mean exit -
  last enter: how long the op took once everyone was in. lateness of a member
  = its enter - the first member's enter; the last one in, by a margin, is a
  late sender (C4D's rule).

One ``Observation`` per directed p2p pair and per (collective group, op),
with medians over the window. Observations of one class (all p2p pairs; the
collectives of one op and group size) are compared with the class's lower
quartile (``reference``): ``slow``, ``ok`` or, in between or without a
reference, ``unknown``.

Clock skew: ranks stamp with the job clock (their perf counter plus the
exporter's offset estimate to rank 0). A residual offset d between two ranks
moves a transfer, comm time, wait or lateness by at most d. Each verdict's
evidence carries ``skew_margin_ns``: how large d would have to be to undo it.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analyzers.links.fault import RECV_OPS, SEND_OPS


@dataclasses.dataclass(frozen=True)
class MeasuredParams:
    slow_ratio: float = 2.5
    """An observation is slow at this multiple of its class's lower quartile (ns per byte) ..."""
    min_excess_ns: int = 1_000_000
    """... and at least this much longer in absolute terms (1 ms: microsecond noise is no fault)."""
    ok_ratio: float = 1.6
    """Below this multiple it is healthy and clears every element it involves."""
    wait_ratio: float = 3.0
    """A sender is late when its receivers wait this multiple of the class's median wait ..."""
    min_wait_ns: int = 2_000_000
    """... and at least this long (2 ms)."""
    late_fraction: float = 0.6
    """A rank is a late sender when it is late in this share of the observations it sends in ..."""
    last_share_pair: float = 0.8
    """... and in a collective group, late means the last one in for this share of its collectives: in a
    group of two (either member is last half of the time by chance) ..."""
    last_share_group: float = 0.5
    """... and in a bigger group (a member is last 1/n of the time by chance) ..."""
    min_collectives: int = 3
    """... over at least this many collectives of the group (steps of an exchange) in the window ..."""
    late_quantile: float = 0.2
    """... and late by a stable margin: in this low quantile of its collectives (steps of an exchange) it is
    still behind the others (``localise``: its 0.2 quantile of lateness against the others' typical one) ..."""
    late_jitter: float = 1.0
    """... by at least this many of the job's own jitter, measured on the job: the robust spread (1.48 x the
    median deviation) of every member's lateness around its own median, step to step. A fixed floor of a
    tenth of a step hid a ring rank 40 ms (6%) behind its neighbours every step, and let through a healthy
    rank that scheduling put 10% behind in 3 of 5 steps (issue 52). On the recorded rings
    (``tests/diagnosis/data/ring8_*``) the late rank's 0.2 quantile stood 1.8-9.6 jitters ahead of its
    neighbours, every healthy rank's at most 0 ..."""
    work_jitters: float = 2.0
    """... and where it is judged by its own work before each step against the job's median rank
    (``work_margins``), by this many of the job's jitter of that work: the recorded late ring and all-reduce
    ranks stood 3.4-10 jitters ahead in the 0.2 quantile of their steps, a healthy rank at most 1.0 ..."""
    min_period_share: float = 0.02
    """... and by at least this share of the time between the group's collectives (about a step): steadier
    than the job's jitter, a rank 1% behind still costs the job too little to page about (the what-if weighs
    it as a straggler)."""
    late_spread: float = 3.0
    """... and later than the others by this many of their spreads (robust: 1.48 x their median deviation),
    where it is not this many times their median lateness (``localise._later_than_the_rest``)."""


@dataclasses.dataclass
class Observation:
    """One directed p2p pair, or one (collective group, op), over a window."""

    name: str                 # "p2p 0>1" or "ranks:0,2 all_reduce"
    kind: str                 # p2p | collective
    members: tuple[int, ...]  # (src, dst) for p2p; the group's ranks in group order for a collective
    algorithm: str
    ns_per_byte: float        # median (p2p) or total comm / total bytes (collective)
    median_ns: float          # median transfer or comm time
    median_bytes: float
    samples: int
    wait_ns: float = math.nan  # p2p: median receiver wait
    lateness_ns: dict[int, float] = dataclasses.field(default_factory=dict)  # collective: median per member
    last_share: dict[int, float] = dataclasses.field(default_factory=dict)   # collective: share of ops it was last in
    period_ns: float = math.nan  # collective: median time between the starts of consecutive ones
    low_lateness_ns: dict[int, float] = dataclasses.field(default_factory=dict)  # collective: late_quantile per member
    jitter_ns: float = math.nan  # collective: robust spread of each member's arrival around its own median
    ratio: float = math.nan   # ns_per_byte over the class reference
    status: str = "unknown"   # slow | ok | unknown
    reference_ns_per_byte: float = math.nan

    @property
    def cls(self) -> tuple:
        return ("p2p",) if self.kind == "p2p" else (self.name.split(" ", 1)[1], len(self.members))

    def elements(self) -> set[tuple]:
        """What this observation's time depends on: NIC egress and ingress of ranks, and directed links."""
        if self.kind == "p2p":
            s, d = self.members
            return {("egress", s), ("ingress", d), ("link", s, d)}
        m = self.members
        out = {("egress", r) for r in m} | {("ingress", r) for r in m}
        if len(m) == 2:
            out |= {("link", m[0], m[1]), ("link", m[1], m[0])}
        elif self.algorithm == "ring":
            # Only where the library says it ran a ring in group order. Otherwise which links a bigger
            # collective used is unknown (gloo picks ring or halving-doubling by size), and none is named.
            out |= {("link", m[i], m[(i + 1) % len(m)]) for i in range(len(m))}
        return out

    def excess_ns(self) -> float:
        """Time beyond what the class reference would take for the same bytes."""
        return self.median_ns - self.reference_ns_per_byte * self.median_bytes

    def evidence(self) -> dict:
        out = {"observation": self.name, "ratio": round(self.ratio, 3), "ns_per_byte": self.ns_per_byte,
               "reference_ns_per_byte": self.reference_ns_per_byte, "median_ns": self.median_ns,
               "median_bytes": self.median_bytes, "samples": self.samples}
        if self.kind == "p2p":
            out["median_wait_ns"] = self.wait_ns
        return out


def measured_rows(ccl: pa.Table) -> pa.Table:
    """Records without per-peer timings from the library, which only enter and exit can explain."""
    n_peers = pc.list_value_length(ccl["peers"])
    reported = pc.and_(pc.greater(n_peers, 0), pc.equal(pc.list_value_length(ccl["peer_transfer_ns"]), n_peers))
    return ccl.filter(pc.and_(pc.invert(reported), pc.greater_equal(ccl["exit_ns"], 0)))


def _medians_by(code: np.ndarray, *values: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """(unique codes, [median of each value per code], count per code), vectorised: sort, take the middle."""
    order = np.argsort(code, kind="stable")
    code_s = code[order]
    starts = np.flatnonzero(np.r_[True, code_s[1:] != code_s[:-1]])
    counts = np.diff(np.r_[starts, len(code_s)])
    lo, hi = starts + (counts - 1) // 2, starts + counts // 2
    meds = []
    for v in values:
        vs = v[np.lexsort((v, code))]
        meds.append((vs[lo] + vs[hi]) / 2)
    return code_s[starts], meds, counts


def _quantiles_by(code: np.ndarray, values: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray]:
    """(unique codes, the ``q`` quantile of the values per code, linearly interpolated as ``np.quantile``)."""
    order = np.lexsort((values, code))
    code_s, v = code[order], values[order]
    starts = np.flatnonzero(np.r_[True, code_s[1:] != code_s[:-1]])
    counts = np.diff(np.r_[starts, len(code_s)])
    pos = q * (counts - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, counts - 1)
    frac = pos - lo
    return code_s[starts], v[starts + lo] * (1 - frac) + v[starts + hi] * frac


def jitter(deviations: np.ndarray) -> float:
    """The robust spread of arrival deviations (each member's lateness less its own median): 1.48 x their
    median absolute value, the standard deviation of a normal jitter; nan without any."""
    return float(1.4826 * np.median(np.abs(deviations))) if len(deviations) else math.nan


def p2p_observations(ccl: pa.Table) -> list[Observation]:
    """One observation per directed pair: the n-th send of a group matched with its n-th receive."""
    cols = ["group", "seq", "rank", "enter_ns", "exit_ns", "nbytes"]
    sends = ccl.filter(pc.is_in(ccl["op"], pa.array(SEND_OPS))).select(cols)
    recvs = ccl.filter(pc.is_in(ccl["op"], pa.array(RECV_OPS))).select(cols)
    if not sends.num_rows or not recvs.num_rows:
        return []
    sends = sends.rename_columns(["group", "seq", "s_rank", "s_enter", "s_exit", "s_bytes"])
    recvs = recvs.rename_columns(["group", "seq", "r_rank", "r_enter", "r_exit", "r_bytes"])
    j = sends.join(recvs, keys=["group", "seq"], join_type="inner")
    if not j.num_rows:
        return []
    src = j["s_rank"].to_numpy().astype(np.int64)
    dst = j["r_rank"].to_numpy().astype(np.int64)
    s_enter = j["s_enter"].to_numpy().astype(np.float64)
    r_enter = j["r_enter"].to_numpy().astype(np.float64)
    r_exit = j["r_exit"].to_numpy().astype(np.float64)
    nbytes = np.maximum(j["s_bytes"].to_numpy(), j["r_bytes"].to_numpy()).astype(np.float64)
    ok = nbytes > 0
    transfer = np.maximum(r_exit - np.maximum(s_enter, r_enter), 0.0)[ok]
    wait = np.maximum(s_enter - r_enter, 0.0)[ok]
    src, dst, nbytes = src[ok], dst[ok], nbytes[ok]
    if not len(src):
        return []
    size = int(max(src.max(), dst.max())) + 1
    pairs, (tpb, t, w, b), n = _medians_by(src * size + dst, transfer / nbytes, transfer, wait, nbytes)
    return [Observation(f"p2p {p // size}>{p % size}", "p2p", (int(p // size), int(p % size)), "direct",
                        float(tpb[i]), float(t[i]), float(b[i]), int(n[i]), wait_ns=float(w[i]))
            for i, p in enumerate(pairs)]


@dataclasses.dataclass(frozen=True)
class Arrivals:
    """When a rank that exchanges with several peers at once reached each step's exchange, against them.

    ``margin_ns[i]``: in step ``steps[i]``, this rank's first transfer call less the latest of its exchange
    peers' first calls (> 0: it came after every one of them). ``period_ns``: the median time between its
    steps' first calls."""
    rank: int
    peers: tuple[int, ...]
    steps: np.ndarray
    margin_ns: np.ndarray
    period_ns: float


@dataclasses.dataclass(frozen=True)
class Work:
    """How long a rank worked on its own before each step's first call, against the job's median rank.

    ``margin_ns[i]``: in step ``steps[i]``, the time from its last call that ended before its first call of the
    step to that first call (compute, input, optimizer: everything but communication), less the median of
    every rank's that step. ``period_ns``: the median time between its steps' first calls."""
    rank: int
    steps: np.ndarray
    margin_ns: np.ndarray
    period_ns: float


def _firsts(key: np.ndarray, enter: np.ndarray, exit_: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct key, the enter and exit of its earliest-entered record (sorted keys). One sort by key and
    segment minima: a lexsort on (key, enter) cost 3x as much on a 16,384-rank window."""
    if not len(key):
        return key, enter, exit_
    order = np.argsort(key, kind="stable")
    k, e = key[order], enter[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    counts = np.diff(np.r_[starts, len(k)])
    earliest = np.minimum.reduceat(e, starts)
    at = np.where(e == np.repeat(earliest, counts), np.arange(len(k)), len(k))
    pick = order[np.minimum.reduceat(at, starts)]
    return k[starts], enter[pick], exit_[pick]


def exchange_arrivals(ccl: pa.Table, min_peers: int = 2) -> dict[int, Arrivals]:
    """Per rank that exchanges with at least ``min_peers`` peers at once (a ring trading with both neighbours,
    a halo exchange, an all-to-all written with isend/irecv): how late it came to each step's exchange,
    compared with those peers.

    Why pairwise and per step: in such a job a late rank delays its neighbours, they delay theirs, and every
    receiver in the window waits for somebody (a hand-written ring of 8 with a rank 60 ms late: the late
    rank's receivers waited 17-69 ms, the others' 47-81 ms), so a median wait over the window names no one.
    Its first call of a step, against its own peers' first calls, is another matter: the late rank came after
    both its neighbours in every step (by 28-121 ms), a healthy rank in 2 of 5 at most.

    An exchange peer: one that the rank's first send and first receive of a step were in flight together
    with, in at least half its steps. A pipeline stage receives its first activation at the step's start and
    sends the gradient back after its backward: no exchange, and it is not judged here (it comes first or
    last by its place in the schedule). Vectorised: a 16,384-rank window has millions of records.
    """
    p2p = ccl.filter(pc.and_(pc.is_in(ccl["op"], pa.array(SEND_OPS + RECV_OPS)), pc.greater_equal(ccl["exit_ns"], 0)))
    p2p = p2p.filter(pc.equal(pc.list_value_length(p2p["group_ranks"]), 2))
    if not p2p.num_rows:
        return {}
    rank = p2p["rank"].to_numpy().astype(np.int64)
    src = pc.list_element(p2p["group_ranks"], 0).to_numpy().astype(np.int64)
    dst = pc.list_element(p2p["group_ranks"], 1).to_numpy().astype(np.int64)
    is_send = pc.is_in(p2p["op"], pa.array(SEND_OPS)).to_numpy(zero_copy_only=False)
    other = np.where(is_send, dst, src)
    step_values, step = np.unique(p2p["step"].to_numpy().astype(np.int64), return_inverse=True)
    enter = p2p["enter_ns"].to_numpy().astype(np.int64)
    exit_ = p2p["exit_ns"].to_numpy().astype(np.int64)
    n_steps = len(step_values)
    width = int(max(rank.max(), other.max())) + 1
    key = (rank * width + other) * n_steps + step  # (rank, peer, step)
    sk, s_in, s_out = _firsts(key[is_send], enter[is_send], exit_[is_send])
    rk, r_in, r_out = _firsts(key[~is_send], enter[~is_send], exit_[~is_send])
    both, i_s, i_r = np.intersect1d(sk, rk, assume_unique=True, return_indices=True)
    together = both[(s_in[i_s] <= r_out[i_r]) & (r_in[i_r] <= s_out[i_s])]
    pair, pair_steps = np.unique(together // n_steps, return_counts=True)  # (rank, peer) -> steps exchanged
    rank_step = np.unique(rank * n_steps + step)
    rank_steps = np.bincount(rank_step // n_steps, minlength=width)
    pair = pair[2 * pair_steps >= rank_steps[pair // width]]
    me, peer = pair // width, pair % width
    judged = np.flatnonzero(np.bincount(me, minlength=width) >= min_peers)
    if not len(judged):
        return {}
    # Each rank's first call of each step (any transfer), as a dense ranks x steps grid.
    fk, f_in, _ = _firsts(rank * n_steps + step, enter, exit_)
    first = np.full((width, n_steps), np.nan)
    first[fk // n_steps, fk % n_steps] = f_in
    keep = np.isin(me, judged)
    me, peer = me[keep], peer[keep]
    latest_peer = np.full((width, n_steps), -np.inf)
    np.maximum.at(latest_peer, me, np.nan_to_num(first[peer], nan=np.inf))  # a peer missing a step: no margin
    margin = first - latest_peer
    period = np.full(width, np.nan)
    if n_steps > 1:
        gaps = np.diff(first[judged], axis=1) / np.maximum(np.diff(step_values), 1)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a rank seen in one step: no period
            period[judged] = np.nanmedian(gaps, axis=1)
    order = np.argsort(me, kind="stable")
    peers_of = np.split(peer[order], np.flatnonzero(np.diff(me[order])) + 1)
    out: dict[int, Arrivals] = {}
    for r, ps in zip(np.unique(me).tolist(), peers_of):
        ok = np.isfinite(margin[r])
        if ok.any():
            out[r] = Arrivals(r, tuple(sorted(ps.tolist())), step_values[ok], margin[r][ok], float(period[r]))
    return out


def work_margins(ccl: pa.Table, exchange_ranks: Iterable[int] = ()) -> dict[int, Work]:
    """Per rank of a job whose ranks all do the same: how much longer than the job's median rank it worked on
    its own before each step's first call (``Work``); {} for any other job.

    Why: where a late rank delays its peers, its arrival at a collective or an exchange moves with when its
    previous one ended, which depends on the others (in a ring one late rank delays both neighbours, and the
    noise of a shared host moves every rank by tens of ms), but the time it spent on its own between two
    does not. A ring rank 60 ms late (30 ms more per forward and backward) came after both neighbours by
    39-106 ms in the recorded runs (``tests/diagnosis/data``), a margin that a loaded host hid in 2 of 4 runs;
    its work between exchanges was 48-65 ms longer than the job's median rank in every step, a healthy rank's
    at most 4 ms in its 0.2 quantile of steps. In 8-rank gloo all-reduce jobs (flat and two-level) a rank 60 ms
    late was missed once each by its lateness into the all-reduce (last one in only 2 of 5 times): its work
    was 47-49 ms longer in the 0.2 quantile, a healthy rank's at most 5.4 ms.

    Ranks do the same where the job has no point-to-point transfers and every rank makes the same number of
    calls in each step (data, tensor or context parallel), or where every rank trades with several peers at
    once (``exchange_ranks``: a ring, a halo). Not in a pipeline: its end stages trade with one peer and its
    stages' work before their first call differs by design (the first computes a forward, a later one posts a
    receive at once)."""
    if not ccl.num_rows:
        return {}
    # The cheap refusals first: a 16,384-rank pipeline window has 2 million records and no use for this.
    seen = np.flatnonzero(np.bincount(ccl["rank"].to_numpy().astype(np.int64)))
    exchanging = np.array(sorted(set(exchange_ranks)), dtype=np.int64)
    if len(exchanging) and not np.array_equal(seen, exchanging):
        return {}
    if not len(exchanging) and pc.any(pc.is_in(ccl["op"], pa.array(SEND_OPS + RECV_OPS))).as_py():
        return {}
    done = ccl.filter(pc.greater_equal(ccl["exit_ns"], 0))
    if not done.num_rows:
        return {}
    rank = done["rank"].to_numpy().astype(np.int64)
    seen = np.flatnonzero(np.bincount(rank))
    step_values, step = np.unique(done["step"].to_numpy().astype(np.int64), return_inverse=True)
    n_steps, width = len(step_values), int(seen[-1]) + 1
    if not len(exchanging):
        calls = np.bincount(rank * n_steps + step, minlength=width * n_steps).reshape(width, n_steps)[seen]
        if not (calls == calls.max()).all():  # a rank missing a step, or making other calls: not alike
            return {}
    enter = done["enter_ns"].to_numpy().astype(np.int64)
    exit_ = done["exit_ns"].to_numpy().astype(np.int64)
    fk, f_in, _ = _firsts(rank * n_steps + step, enter, exit_)
    first = np.full((width, n_steps), np.nan)
    first[fk // n_steps, fk % n_steps] = f_in
    work = _work_before(rank, step, exit_, first, step_values)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step no rank has a call before: no margin
        margin = work - np.nanmedian(work[seen], axis=0)
        period = np.nanmedian(np.diff(first, axis=1) / np.maximum(np.diff(step_values), 1), axis=1) \
            if n_steps > 1 else np.full(width, np.nan)
    out: dict[int, Work] = {}
    for r in seen.tolist():
        ok = np.isfinite(margin[r])
        if ok.any():
            out[r] = Work(r, step_values[ok], margin[r][ok], float(period[r]))
    return out


def _work_before(rank: np.ndarray, step: np.ndarray, exit_: np.ndarray, first: np.ndarray,
                 step_values: np.ndarray) -> np.ndarray:
    """ranks x steps (``step``: index into the window's ``step_values``): the time from each rank's last call
    that ended before its first call of the step to that first call. nan where that call is not in the window or belongs
    to a step before the one before (a gap in the sampled steps). One sort of (rank, exit) keys and a search:
    a 16,384-rank window has millions of records."""
    out = np.full(first.shape, np.nan)
    width = first.shape[0]
    rows, cols = np.nonzero(np.isfinite(first))
    if not len(rank) or not len(rows):
        return out
    t0 = min(int(exit_.min()), int(np.nanmin(first)))
    span = max(int(exit_.max()), int(np.nanmax(first))) - t0 + 1
    if width * span >= 2**62:  # one key per (rank, time) would overflow: a window this long has no gaps to read
        return out
    key = rank * span + (exit_ - t0)
    order = np.argsort(key, kind="stable")
    key, step = key[order], step[order]
    query = rows * span + (first[rows, cols].astype(np.int64) - t0)
    at = np.searchsorted(key, query, side="left") - 1  # the latest call that ended before the first one
    found = at >= 0
    found[found] &= key[at[found]] // span == rows[found]
    behind = step_values[cols[found]] - step_values[step[at[found]]]  # 0: this step, 1: the one before
    found[found] &= (behind == 0) | (behind == 1)
    out[rows[found], cols[found]] = (query[found] - key[at[found]]).astype(np.float64)
    return out


def collective_observations(ccl: pa.Table, params: MeasuredParams = MeasuredParams()) -> list[Observation]:
    """One observation per (group, op): comm time per byte, and each member's lateness.

    Vectorised over collectives (a 16,384-rank window holds millions of member records): sort by
    (group, seq, enter), so each collective is a run of its members in the order they came in.
    """
    coll = ccl.filter(pc.and_(pc.invert(pc.is_in(ccl["op"], pa.array(SEND_OPS + RECV_OPS))),
                              pc.invert(pc.starts_with(ccl["group"], "p2p:"))))
    if not coll.num_rows:
        return []
    gdict = pc.dictionary_encode(coll["group"]).combine_chunks()
    odict = pc.dictionary_encode(coll["op"]).combine_chunks()
    gcode = gdict.indices.to_numpy().astype(np.int64)
    ocode = odict.indices.to_numpy().astype(np.int64)
    seq = coll["seq"].to_numpy().astype(np.int64)
    enter = coll["enter_ns"].to_numpy().astype(np.float64)
    order = np.lexsort((enter, seq, gcode))
    gcode, ocode, seq, enter = gcode[order], ocode[order], seq[order], enter[order]
    rank = coll["rank"].to_numpy().astype(np.int64)[order]
    exit_ = coll["exit_ns"].to_numpy().astype(np.float64)[order]
    nbytes = coll["nbytes"].to_numpy().astype(np.float64)[order]
    size = pc.list_value_length(coll["group_ranks"]).to_numpy(zero_copy_only=False).astype(np.int64)[order]
    key = gcode * (int(seq.max()) + 1) + seq
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    counts = np.diff(np.r_[starts, len(key)])
    # Only collectives with every member's record: a missing one (not sampled, in flight) hides who was late.
    whole = (counts == size[starts]) & (counts >= 2)
    starts, counts = starts[whole], counts[whole]
    if not len(starts):
        return []
    ends = starts + counts
    last_enter, first_enter = enter[ends - 1], enter[starts]
    mean_exit = _run_sums(exit_, starts, counts) / counts
    comm = np.maximum(mean_exit - last_enter, 0.0)
    mean_bytes = _run_sums(nbytes, starts, counts) / counts
    late_margin = last_enter - enter[ends - 2]
    n_ops = int(ocode.max()) + 1
    obs_code = gcode[starts] * n_ops + ocode[starts]
    # Member records of the whole collectives, with their run's observation and lateness.
    run_of = np.repeat(np.arange(len(starts)), counts)
    members = _run_indices(starts, counts)
    lateness = enter[members] - first_enter[run_of]
    n_ranks = int(rank.max()) + 1
    m_code = obs_code[run_of] * n_ranks + rank[members]
    m_keys, (m_late,), _ = _medians_by(m_code, lateness)
    _, m_low = _quantiles_by(m_code, lateness, params.late_quantile)
    # The job's own jitter per observation: how far each member's arrival moves around its own median, against
    # the collective's mean arrival (against the first one in, the first member of a pair would move by 0).
    centred = enter[members] - (_run_sums(enter, starts, counts) / counts)[run_of]
    c_keys, (c_med,), _ = _medians_by(m_code, centred)
    deviation = np.abs(centred - c_med[np.searchsorted(c_keys, m_code)])
    j_keys, (j_med,), _ = _medians_by(obs_code[run_of], deviation)
    jitter_of = dict(zip(j_keys.tolist(), (1.4826 * j_med).tolist()))
    last_keys, last_counts = np.unique((obs_code * n_ranks + rank[ends - 1])[late_margin >= params.min_wait_ns],
                                       return_counts=True)
    o_keys, (o_comm, o_bytes), o_n = _medians_by(obs_code, comm, mean_bytes)
    # The time between consecutive collectives of an observation (runs are in seq order within a group).
    by_obs = np.argsort(obs_code, kind="stable")
    same = obs_code[by_obs][1:] == obs_code[by_obs][:-1]
    gaps = np.diff(first_enter[by_obs])[same]
    p_keys, (p_med,), _ = _medians_by(obs_code[by_obs][1:][same], gaps) if same.any() else (np.array([], np.int64),
                                                                                              [np.array([])], None)
    period = dict(zip(p_keys.tolist(), p_med.tolist()))
    with_bytes = mean_bytes > 0
    sum_comm = np.bincount(np.searchsorted(o_keys, obs_code[with_bytes]), comm[with_bytes], len(o_keys))
    sum_bytes = np.bincount(np.searchsorted(o_keys, obs_code[with_bytes]), mean_bytes[with_bytes], len(o_keys))
    first_of = {int(c): int(s) for c, s in zip(obs_code[::-1], starts[::-1])}  # a record of each observation
    groups, ops = gdict.dictionary.to_pylist(), odict.dictionary.to_pylist()
    group_ranks, algos = coll["group_ranks"], coll["algorithm"]
    out = []
    for i, c in enumerate(o_keys.tolist()):
        rec = int(order[first_of[c]])
        lo, hi = np.searchsorted(m_keys, [c * n_ranks, (c + 1) * n_ranks])
        llo, lhi = np.searchsorted(last_keys, [c * n_ranks, (c + 1) * n_ranks])
        n = int(o_n[i])
        out.append(Observation(
            f"{groups[c // n_ops]} {ops[c % n_ops]}", "collective",
            tuple(int(r) for r in group_ranks[rec].as_py()), algos[rec].as_py() or "",
            float(sum_comm[i] / sum_bytes[i]) if sum_bytes[i] > 0 else math.nan, float(o_comm[i]), float(o_bytes[i]),
            n, lateness_ns={int(k % n_ranks): float(v) for k, v in zip(m_keys[lo:hi], m_late[lo:hi])},
            last_share={int(k % n_ranks): int(v) / n for k, v in zip(last_keys[llo:lhi], last_counts[llo:lhi])},
            period_ns=float(period.get(c, math.nan)),
            low_lateness_ns={int(k % n_ranks): float(v) for k, v in zip(m_keys[lo:hi], m_low[lo:hi])},
            jitter_ns=float(jitter_of.get(c, math.nan))))
    return out


def _run_sums(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sum of each run values[start:start + count] (runs sorted, non-overlapping, maybe with gaps)."""
    csum = np.r_[0.0, np.cumsum(values)]
    return csum[starts + counts] - csum[starts]


def _run_indices(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Every index of every run, in order, without a Python loop."""
    offsets = np.repeat(starts - np.r_[0, np.cumsum(counts)[:-1]], counts)
    return np.arange(int(counts.sum())) + offsets


def reference(values: list[float]) -> float:
    """A class's healthy time per byte: its lower quartile, rounded up to a real member.

    Rounded up, so that one unusually fast cell (a receiver that happened to be scheduled at once)
    does not make every ordinary cell look slow; with two members, the faster one (the median of two
    would sit halfway to a slow one).
    """
    v = sorted(values)
    return v[0] if len(v) <= 2 else v[math.ceil(0.25 * (len(v) - 1))]


def judge(observations: list[Observation], params: MeasuredParams = MeasuredParams()) -> None:
    """Set ratio and status of each observation against its class's lower quartile."""
    classes: dict[tuple, list[Observation]] = {}
    for o in observations:
        if o.ns_per_byte == o.ns_per_byte:  # byte-less ops (barriers) have no rate to compare
            classes.setdefault(o.cls, []).append(o)
    for members in classes.values():
        if len(members) < 2:
            continue  # nothing to compare with: stays unknown
        ref = reference([o.ns_per_byte for o in members])
        for o in members:
            o.reference_ns_per_byte = ref
            o.ratio = o.ns_per_byte / ref if ref > 0 else math.inf
            if o.ratio >= params.slow_ratio and o.excess_ns() >= params.min_excess_ns:
                o.status = "slow"
            elif o.ratio < params.ok_ratio:
                o.status = "ok"
