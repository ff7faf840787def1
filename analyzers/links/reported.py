"""Link diagnosis from per-peer timings that the collective library reports itself.

Input: CCL records (``core.schema.CCL_RECORD``) of one job window whose
``peer_transfer_ns`` has one entry per peer (a library such as C4D's patched
NCCL, or generated incidents, time each connection). Each such record
contributes directed edges: a receive-type op (``recv``, ``irecv``)
gives ``peer -> rank`` with its transfer time, bytes and the receiver's wait
for the first byte; any other op gives ``rank -> peer`` edges with their
transfer times and bytes. Per edge we keep the median time per byte
(the inverse of effective bandwidth) over the window.

Classification (C4D's "communication slow" split by where it sits):
- a *link*: one hot cell (src, dst) whose row and column are otherwise normal;
- a *source*: most of a row is hot (a slow NIC or host sending);
- a *destination*: most of a column is hot (a slow receiver);
- *noncomm_slow*: transfers are normal but receivers wait long for the first
  byte from one source: that sender was late because of its own compute
  (C4D's "non-communication slow").

Hot means robustly far above the group: ``value / median >= min_ratio`` and a
robust z-score (log space, MAD) of at least ``min_z``. The edge set is kept
sparse (arrays of edges, row and column counts by ``np.bincount``), so a
group of 8,192 ranks with tens of peers each is diagnosed in well under a
second; no dense N x N matrix is built unless asked for.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analyzers.links.fault import RECV_OPS, LinkFault


@dataclasses.dataclass(frozen=True)
class LinkParams:
    min_ratio: float = 1.5
    """A cell is hot when its time per byte is at least this multiple of the group median."""
    min_z: float = 6.0
    """... and its robust z-score (log space) is at least this."""
    row_fraction: float = 0.6
    """A source (row) or destination (column) is at fault when this share of its cells is hot."""
    min_cells: int = 2
    """Rows and columns with fewer cells than this cannot be told apart from a link."""
    wait_ratio: float = 3.0
    """Receiver wait at least this multiple of the median wait (and min_wait_ns above it) marks a late sender."""
    min_wait_ns: int = 1_000_000
    """Waits shorter than this never count as late (1 ms)."""


@dataclasses.dataclass(frozen=True)
class Edges:
    """The sparse matrix of one group: one entry per directed (src, dst) pair seen."""

    group: str
    src: np.ndarray
    dst: np.ndarray
    time_per_byte: np.ndarray  # ns per byte, median over the window
    wait_ns: np.ndarray        # median receiver wait, -1 where unknown
    samples: np.ndarray

    def dense(self, ranks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ranks, matrix) with NaN where no edge was seen; for display of small groups."""
        ranks = np.unique(np.concatenate([self.src, self.dst])) if ranks is None else ranks
        idx = {int(r): i for i, r in enumerate(ranks)}
        m = np.full((len(ranks), len(ranks)), np.nan)
        for s, d, v in zip(self.src, self.dst, self.time_per_byte):
            m[idx[int(s)], idx[int(d)]] = v
        return ranks, m


def edges_from_ccl(ccl: pa.Table) -> list[Edges]:
    """Group the window's CCL records that carry per-peer timings into per-group edge sets."""
    ccl = reported_rows(ccl)
    if ccl.num_rows == 0:
        return []
    flat = pa.table({
        "group": ccl["group"], "rank": ccl["rank"], "op": ccl["op"], "wait": ccl["recv_wait_ns"],
        "peers": ccl["peers"], "t": ccl["peer_transfer_ns"], "b": ccl["peer_bytes"],
    })
    lens = pc.list_value_length(flat["peers"]).to_numpy(zero_copy_only=False)
    parent = np.repeat(np.arange(flat.num_rows), lens)
    peers = pc.list_flatten(flat["peers"]).to_numpy().astype(np.int64)
    t = pc.list_flatten(flat["t"]).to_numpy().astype(np.float64)
    b = pc.list_flatten(flat["b"]).to_numpy().astype(np.float64)
    if not (len(peers) == len(t) == len(b)):
        raise ValueError("ccl records: peers, peer_transfer_ns and peer_bytes differ in length")
    rank = flat["rank"].to_numpy().astype(np.int64)[parent]
    is_recv = pc.is_in(flat["op"], pa.array(RECV_OPS)).to_numpy(zero_copy_only=False)[parent]
    wait = flat["wait"].to_numpy().astype(np.float64)[parent]
    # Group names as dictionary codes: comparing millions of strings costs more than the analysis.
    gdict = pc.dictionary_encode(flat["group"]).combine_chunks()
    gcode = gdict.indices.to_numpy()[parent]
    src = np.where(is_recv, peers, rank)
    dst = np.where(is_recv, rank, peers)
    wait = np.where(is_recv, wait, -1.0)
    ok = (b > 0) & (t >= 0)
    out = []
    for code, name in enumerate(gdict.dictionary.to_pylist()):
        sel = ok & (gcode == code)
        if sel.any():
            out.append(_aggregate(str(name), src[sel], dst[sel], t[sel] / b[sel], wait[sel]))
    return out


def reported_rows(ccl: pa.Table) -> pa.Table:
    """The records whose library timed each peer: one transfer time per peer (the others are empty)."""
    n_peers = pc.list_value_length(ccl["peers"])
    return ccl.filter(pc.and_(pc.greater(n_peers, 0),
                              pc.equal(pc.list_value_length(ccl["peer_transfer_ns"]), n_peers)))


def _sorted_within(pair: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Permutation sorting by (pair, value), with integer sorts only (faster than lexsort on floats)."""
    n = len(values)
    vrank = np.empty(n, np.int64)
    vrank[np.argsort(values, kind="stable")] = np.arange(n)
    return np.argsort(pair * n + vrank)


def _aggregate(group: str, src, dst, tpb, wait) -> Edges:
    """Median per (src, dst) pair, vectorised: sort by pair and value, take the middle of each run."""
    size = int(max(src.max(), dst.max())) + 1
    pair = src * size + dst
    order = _sorted_within(pair, tpb)
    pair_s, tpb_s = pair[order], tpb[order]
    starts = np.flatnonzero(np.r_[True, pair_s[1:] != pair_s[:-1]])
    counts = np.diff(np.r_[starts, len(pair_s)])
    mid = starts + (counts - 1) // 2
    mid2 = starts + counts // 2
    med = (tpb_s[mid] + tpb_s[mid2]) / 2
    # Median wait per pair (runs line up: both orders sort by pair first; unknown waits are -1).
    wait_s = wait[_sorted_within(pair, wait)]
    wmed = (wait_s[mid] + wait_s[mid2]) / 2
    upair = pair_s[starts]
    return Edges(group, upair // size, upair % size, med, wmed, counts)


def _robust_z(x: np.ndarray) -> np.ndarray:
    lx = np.log(np.maximum(x, 1e-300))
    med = np.median(lx)
    mad = np.median(np.abs(lx - med)) * 1.4826
    # Floor the spread: a perfectly uniform fleet must not turn 1% noise into z = 100.
    return (lx - med) / max(mad, 0.02)


def diagnose_group(edges: Edges, params: LinkParams = LinkParams()) -> list[LinkFault]:
    """Faults of one group, most severe first."""
    n = len(edges.src)
    if n < 3:
        return []
    v = edges.time_per_byte
    med = float(np.median(v))
    ratio = v / med if med > 0 else np.ones_like(v)
    z = _robust_z(v)
    hot = (ratio >= params.min_ratio) & (z >= params.min_z)
    faults: list[LinkFault] = []
    size = int(max(edges.src.max(), edges.dst.max())) + 1
    explained = np.zeros(n, bool)
    for kind, axis in (("source", edges.src), ("destination", edges.dst)):
        total = np.bincount(axis, minlength=size)
        nhot = np.bincount(axis, weights=hot, minlength=size)
        frac = np.divide(nhot, total, out=np.zeros(size), where=total > 0)
        for r in np.flatnonzero((frac >= params.row_fraction) & (total >= params.min_cells)):
            cells = axis == r
            explained |= cells & hot
            sl = float(np.median(ratio[cells & hot]))
            conf = _confidence(frac[r], float(np.median(z[cells & hot])), params)
            faults.append(LinkFault(edges.group, kind, int(r) if kind == "source" else -1,
                                    int(r) if kind == "destination" else -1, conf, sl, {
                                        "hot_cells": int(nhot[r]), "cells": int(total[r]),
                                        "median_ratio": sl, "group_median_ns_per_byte": med}))
    for i in np.flatnonzero(hot & ~explained):
        s, d = int(edges.src[i]), int(edges.dst[i])
        row = edges.src == s
        col = edges.dst == d
        others = float(np.median(ratio[(row | col) & ~hot])) if np.any((row | col) & ~hot) else 1.0
        conf = _confidence(1.0, float(z[i]), params) * (1.0 if (row.sum() >= params.min_cells and
                                                                  col.sum() >= params.min_cells) else 0.5)
        faults.append(LinkFault(edges.group, "link", s, d, conf, float(ratio[i]), {
            "ratio": float(ratio[i]), "z": float(z[i]), "row_and_column_median_ratio": others,
            "samples": int(edges.samples[i]), "group_median_ns_per_byte": med}))
    faults += _late_senders(edges, hot, params)
    faults.sort(key=lambda f: (-f.confidence, -f.slowdown))
    return faults


def _late_senders(edges: Edges, hot: np.ndarray, params: LinkParams) -> list[LinkFault]:
    """Sources whose receivers wait long although the transfers themselves are normal."""
    known = edges.wait_ns >= 0
    if known.sum() < 3:
        return []
    w = edges.wait_ns
    med_w = float(np.median(w[known]))
    late = known & ~hot & (w >= params.min_wait_ns) & (w >= params.wait_ratio * max(med_w, 1.0))
    if not late.any():
        return []
    size = int(edges.src.max()) + 1
    total = np.bincount(edges.src[known], minlength=size)
    nlate = np.bincount(edges.src[late], minlength=size)
    out = []
    for s in np.flatnonzero(nlate > 0):
        frac = nlate[s] / total[s]
        if frac < params.row_fraction:
            continue
        cells = (edges.src == s) & late
        mean_wait = float(np.median(w[cells]))
        conf = min(1.0, frac) * (1 - math.exp(-mean_wait / max(med_w * params.wait_ratio, params.min_wait_ns)))
        out.append(LinkFault(edges.group, "noncomm_slow", int(s), -1, conf, mean_wait / max(med_w, 1.0), {
            "late_cells": int(nlate[s]), "cells": int(total[s]), "median_wait_ns": mean_wait,
            "group_median_wait_ns": med_w}))
    return out


def _confidence(fraction: float, z: float, params: LinkParams) -> float:
    """0..1: how much of the row/column agrees, times how far beyond the threshold the cells are."""
    return float(min(1.0, fraction) * (1 - math.exp(-max(z, 0.0) / params.min_z)))
