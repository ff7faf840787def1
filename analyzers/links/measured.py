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
quartile: ``slow``, ``ok`` or, in between or without a reference, ``unknown``.

Clock skew: ranks stamp with the job clock (their perf counter plus the
exporter's offset estimate to rank 0). A residual offset d between two ranks
moves a transfer, comm time, wait or lateness by at most d. Each verdict's
evidence carries ``skew_margin_ns``: how large d would have to be to undo it.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SEND_OPS = ("send", "isend")
RECV_OPS = ("recv", "irecv")


@dataclasses.dataclass(frozen=True)
class MeasuredParams:
    slow_ratio: float = 3.0
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
    """A rank is a late sender when it is late in this share of the observations it sends in."""


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
        elif self.algorithm in ("", "ring") and len(m) > 2:
            # A ring in group order (gloo's ring algorithms); a library that orders its ring otherwise
            # reports its algorithm, and then links inside the group are not named.
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
    """(unique codes, [median of each value per code], count per code)."""
    order = np.argsort(code, kind="stable")
    code_s = code[order]
    starts = np.flatnonzero(np.r_[True, code_s[1:] != code_s[:-1]])
    bounds = np.r_[starts, len(code_s)]
    meds = []
    for v in values:
        vs = v[order]
        meds.append(np.array([np.median(vs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]))
    return code_s[starts], meds, np.diff(bounds)


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


def collective_observations(ccl: pa.Table, params: MeasuredParams = MeasuredParams()) -> list[Observation]:
    """One observation per (group, op): comm time per byte, and each member's lateness."""
    coll = ccl.filter(pc.and_(pc.invert(pc.is_in(ccl["op"], pa.array(SEND_OPS + RECV_OPS))),
                              pc.invert(pc.starts_with(ccl["group"], "p2p:"))))
    if not coll.num_rows:
        return []
    gdict = pc.dictionary_encode(coll["group"]).combine_chunks()
    gcode = gdict.indices.to_numpy().astype(np.int64)
    seq = coll["seq"].to_numpy().astype(np.int64)
    rank = coll["rank"].to_numpy().astype(np.int64)
    enter = coll["enter_ns"].to_numpy().astype(np.float64)
    exit_ = coll["exit_ns"].to_numpy().astype(np.float64)
    nbytes = coll["nbytes"].to_numpy().astype(np.float64)
    ops = coll["op"].to_pylist()
    algos = coll["algorithm"].to_pylist()
    members = coll["group_ranks"].to_pylist()
    # Sort by (group, seq, enter): each collective is a run, its members in the order they came in.
    order = np.lexsort((enter, seq, gcode))
    key = gcode[order] * (int(seq.max()) + 1) + seq[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    ends = np.r_[starts[1:], len(key)]
    per_obs: dict[tuple[int, str], dict] = {}
    for a, b in zip(starts, ends):
        idx = order[a:b]
        first = idx[0]
        group_ranks = members[first] or []
        if b - a != len(group_ranks) or b - a < 2:
            continue  # a member's record is missing (not sampled, or in flight): no side-by-side view
        e, x = enter[idx], exit_[idx]
        o = per_obs.setdefault((int(gcode[first]), ops[first]), {
            "members": tuple(int(r) for r in group_ranks), "algorithm": algos[first] or "",
            "comm": [], "bytes": [], "late": {}, "last": {}})
        comm = max(float(x.mean() - e[-1]), 0.0)
        o["comm"].append(comm)
        o["bytes"].append(float(nbytes[idx].mean()))
        for r, lat in zip(rank[idx], e - e[0]):
            o["late"].setdefault(int(r), []).append(float(lat))
        margin = e[-1] - e[-2]
        if margin >= params.min_wait_ns:
            last = int(rank[idx[-1]])
            o["last"][last] = o["last"].get(last, 0) + 1
    names = gdict.dictionary.to_pylist()
    out = []
    for (g, op), o in per_obs.items():
        comm, byts = np.array(o["comm"]), np.array(o["bytes"])
        with_bytes = byts > 0
        n = len(comm)
        tpb = float(comm[with_bytes].sum() / byts[with_bytes].sum()) if with_bytes.any() else math.nan
        out.append(Observation(
            f"{names[g]} {op}", "collective", o["members"], o["algorithm"], tpb, float(np.median(comm)),
            float(np.median(byts)), n, lateness_ns={r: float(np.median(v)) for r, v in o["late"].items()},
            last_share={r: c / n for r, c in o["last"].items()}))
    return out


def judge(observations: list[Observation], params: MeasuredParams = MeasuredParams()) -> None:
    """Set ratio and status of each observation against its class's lower quartile."""
    classes: dict[tuple, list[Observation]] = {}
    for o in observations:
        if o.ns_per_byte == o.ns_per_byte:  # byte-less ops (barriers) have no rate to compare
            classes.setdefault(o.cls, []).append(o)
    for members in classes.values():
        if len(members) < 2:
            continue  # nothing to compare with: stays unknown
        ref = float(np.percentile([o.ns_per_byte for o in members], 25, method="lower"))
        for o in members:
            o.reference_ns_per_byte = ref
            o.ratio = o.ns_per_byte / ref if ref > 0 else math.inf
            if o.ratio >= params.slow_ratio and o.excess_ns() >= params.min_excess_ns:
                o.status = "slow"
            elif o.ratio < params.ok_ratio:
                o.status = "ok"
