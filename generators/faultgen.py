"""Synthetic communication incidents with ground truth, for the hang and link analyzers.

Two families, deterministic by seed:

- ``link_incident(kind, n_ranks, seed)``: the CCL records of one window of
  one communication group. Each collective runs recursive doubling: in step
  k, rank r receives from (r - 2^k) mod N, so every rank has log2(N)
  sources and destinations. Kinds: ``none``, ``link`` (one src -> dst pair
  slow), ``source`` (a slow NIC: every edge out of one rank), ``destination``
  (every edge into one rank), ``noncomm_slow`` (one sender late because of
  its own compute: its receivers wait, transfers stay normal).
- ``hang_incident(kind, n_ranks, seed)``: the heartbeats and CCL records the
  hang detector holds at a moment after the job stopped making progress.
  Kinds: ``comm_hang`` (one rank never enters collective n; everyone else is
  inside it), ``noncomm_hang`` (no rank inside a collective; one rank stuck
  in compute or data loading), ``node_loss`` (the heartbeats of one host's
  ranks stop), ``healthy`` (progressing: must not be called a hang).

``Incident.truth`` holds the labels the benchmarks score against.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from core import codec
from core import schema as S

LINK_KINDS = ("none", "link", "source", "destination", "noncomm_slow")
HANG_KINDS = ("healthy", "comm_hang", "noncomm_hang", "node_loss")
_NS = 1_000_000_000


@dataclasses.dataclass(frozen=True)
class Incident:
    kind: str
    n_ranks: int
    ccl: pa.Table
    heartbeats: pa.Table | None
    truth: dict
    now_ns: int = 0


def _peers_recursive_doubling(n: int) -> list[int]:
    return [1 << k for k in range(max(1, int(np.log2(n))))]


def link_incident(kind: str, n_ranks: int, seed: int, job_id: str = "linkjob", collectives: int = 6,
                  nbytes: int = 64 << 20, factor: float | None = None) -> Incident:
    if kind not in LINK_KINDS:
        raise ValueError(f"unknown link incident kind {kind!r} (known: {', '.join(LINK_KINDS)})")
    if n_ranks < 4:
        raise ValueError("need at least 4 ranks to tell a link from a source")
    rng = np.random.default_rng([seed, n_ranks, LINK_KINDS.index(kind)])
    dists = _peers_recursive_doubling(n_ranks)
    ranks = np.arange(n_ranks)
    base_tpb = 1e9 / 25e9  # ns per byte at 25 GB/s
    factor = factor if factor is not None else float(rng.uniform(1.8, 5.0))
    culprit = int(rng.integers(n_ranks))
    d = dists[int(rng.integers(len(dists)))]
    victim_src, victim_dst = culprit, (culprit + d) % n_ranks
    truth = {"kind": kind, "src": -1, "dst": -1, "factor": factor}
    if kind == "link":
        truth.update(src=victim_src, dst=victim_dst)
    elif kind in ("source", "noncomm_slow"):
        truth.update(src=culprit)
    elif kind == "destination":
        truth.update(dst=culprit)

    cols: dict[str, list] = {k: [] for k in ("rank", "seq", "peer", "t", "wait", "enter")}
    t0 = 10 * _NS
    for c in range(collectives):
        for k, dist in enumerate(dists):
            src = (ranks - dist) % n_ranks  # who each rank receives from in this step
            tpb = base_tpb * rng.normal(1.0, 0.05, n_ranks).clip(0.8, 1.2)
            wait = rng.exponential(50_000, n_ranks)  # healthy: ~50 us for the first byte
            if kind == "link":
                tpb = np.where((src == victim_src) & (ranks == victim_dst), tpb * factor, tpb)
            elif kind == "source":
                tpb = np.where(src == culprit, tpb * factor, tpb)
            elif kind == "destination":
                tpb = np.where(ranks == culprit, tpb * factor, tpb)
            elif kind == "noncomm_slow":
                wait = np.where(src == culprit, wait + factor * 5_000_000, wait)  # 10-30 ms late
            cols["rank"].append(ranks)
            cols["seq"].append(np.full(n_ranks, c * len(dists) + k))
            cols["peer"].append(src)
            cols["t"].append((tpb * nbytes).astype(np.int64))
            cols["wait"].append(wait.astype(np.int64))
            cols["enter"].append(np.full(n_ranks, t0 + (c * len(dists) + k) * 20_000_000))
    c = {k: np.concatenate(v) for k, v in cols.items()}
    n = len(c["rank"])
    ccl = pa.table({
        "job_id": pa.array([job_id] * n), "attempt": pa.array(np.zeros(n, np.int32)),
        "rank": pa.array(c["rank"].astype(np.int32)), "window_id": pa.array(np.zeros(n, np.int64)),
        "step": pa.array(np.zeros(n, np.int64)), "group": pa.array(["world"] * n),
        "group_ranks": pa.array([[]] * n, pa.list_(pa.int32())),
        "seq": pa.array(c["seq"].astype(np.int64)), "op": pa.array(["recv"] * n),
        "algorithm": pa.array(["recursive-doubling"] * n), "nbytes": pa.array(np.full(n, nbytes, np.int64)),
        "enter_ns": pa.array(c["enter"].astype(np.int64)),
        "exit_ns": pa.array((c["enter"] + c["wait"] + c["t"]).astype(np.int64)),
        "peers": pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), pa.array(c["peer"].astype(np.int32))),
        "peer_transfer_ns": pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), pa.array(c["t"])),
        "peer_bytes": pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)),
                                               pa.array(np.full(n, nbytes, np.int64))),
        "recv_wait_ns": pa.array(c["wait"].astype(np.int64)),
    })
    return Incident(kind, n_ranks, codec.conform(ccl, S.CCL_RECORD), None, truth)


def hang_incident(kind: str, n_ranks: int, seed: int, job_id: str = "hangjob", ranks_per_host: int = 8,
                  step_s: float = 2.0, stalled_s: float = 300.0, heartbeat_s: float = 5.0) -> Incident:
    """State at ``now``: the job has made no progress for ``stalled_s`` (except ``healthy``)."""
    if kind not in HANG_KINDS:
        raise ValueError(f"unknown hang incident kind {kind!r} (known: {', '.join(HANG_KINDS)})")
    rng = np.random.default_rng([seed, n_ranks, HANG_KINDS.index(kind)])
    now = 1_000 * _NS
    ranks = np.arange(n_ranks)
    hosts = np.array([f"node-{r // ranks_per_host:04d}" for r in ranks])
    culprit = int(rng.integers(n_ranks))
    seq_n = int(rng.integers(10, 1000))
    stall_start = now - int(stalled_s * _NS) if kind != "healthy" else now - int(0.2 * step_s * _NS)
    step = seq_n // 4
    hb_ts = now - rng.integers(0, int(heartbeat_s * _NS), n_ranks)
    inflight_op = np.array(["all_reduce"] * n_ranks, dtype=object)
    inflight_group = np.array(["world"] * n_ranks, dtype=object)
    inflight_seq = np.full(n_ranks, seq_n)
    inflight_since = stall_start + rng.integers(0, 50_000_000, n_ranks)
    entered = np.full(n_ranks, seq_n)
    completed = np.full(n_ranks, seq_n - 1)
    truth: dict = {"kind": kind, "missing": [], "stuck": [], "host": ""}
    if kind == "healthy":
        inflight_since = now - rng.integers(0, int(0.1 * step_s * _NS), n_ranks)
    elif kind == "comm_hang":
        inflight_op[culprit] = "forward-compute"
        inflight_group[culprit] = ""
        inflight_seq[culprit] = -1
        entered[culprit] = seq_n - 1
        truth.update(missing=[culprit], stuck=[int(r) for r in ranks if r != culprit], host=str(hosts[culprit]))
    elif kind == "noncomm_hang":
        # Everyone finished collective n-1 and nobody entered n: one rank is stuck outside
        # communication (compute, data loading); the others wait on the host side.
        entered[:] = seq_n - 1
        inflight_op[:] = ""
        inflight_group[:] = ""
        inflight_seq[:] = -1
        inflight_since[:] = -1
        inflight_op[culprit] = "data-loading"
        inflight_since[culprit] = stall_start
        truth.update(missing=[], stuck=[culprit], host=str(hosts[culprit]))
    elif kind == "node_loss":
        lost_host = hosts[culprit]
        lost = hosts == lost_host
        hb_ts = np.where(lost, stall_start - rng.integers(0, int(heartbeat_s * _NS), n_ranks), hb_ts)
        entered = np.where(lost, seq_n - 1, entered)
        truth.update(missing=[int(r) for r in ranks[lost]], stuck=[int(r) for r in ranks[~lost]],
                     host=str(lost_host))
    hb = pa.table({
        "job_id": [job_id] * n_ranks, "attempt": pa.array(np.zeros(n_ranks, np.int32)),
        "rank": pa.array(ranks.astype(np.int32)), "host": pa.array(hosts.tolist()),
        "pid": pa.array((10_000 + ranks).astype(np.int64)), "ts_ns": pa.array(hb_ts.astype(np.int64)),
        "step": pa.array(np.full(n_ranks, step, np.int64)), "last_op": pa.array(["optimizer"] * n_ranks),
        "last_op_end_ns": pa.array(np.full(n_ranks, stall_start - 1_000_000, np.int64)),
        "inflight_op": pa.array(inflight_op.tolist(), pa.string()),
        "inflight_group": pa.array(inflight_group.tolist(), pa.string()),
        "inflight_seq": pa.array(inflight_seq.astype(np.int64)),
        "inflight_since_ns": pa.array(inflight_since.astype(np.int64)),
        "clock_offset_ns": pa.array(np.zeros(n_ranks, np.int64)),
        "stack": pa.array([""] * n_ranks),
    })
    # The CCL view: the last collective each rank entered, and whether it completed it.
    last = entered
    exit_ns = np.where(completed >= last, stall_start - 2_000_000, -1)
    ccl = pa.table({
        "job_id": [job_id] * n_ranks, "attempt": pa.array(np.zeros(n_ranks, np.int32)),
        "rank": pa.array(ranks.astype(np.int32)), "window_id": pa.array(np.full(n_ranks, -1, np.int64)),
        "step": pa.array(np.full(n_ranks, step, np.int64)), "group": pa.array(["world"] * n_ranks),
        "group_ranks": pa.array([[]] * n_ranks, pa.list_(pa.int32())),
        "seq": pa.array(last.astype(np.int64)), "op": pa.array(["all_reduce"] * n_ranks),
        "algorithm": pa.array([""] * n_ranks), "nbytes": pa.array(np.full(n_ranks, 1 << 20, np.int64)),
        "enter_ns": pa.array(np.where(last == seq_n, inflight_since, stall_start - 5_000_000).astype(np.int64)),
        "exit_ns": pa.array(exit_ns.astype(np.int64)),
        "peers": pa.array([[]] * n_ranks, pa.list_(pa.int32())),
        "peer_transfer_ns": pa.array([[]] * n_ranks, pa.list_(pa.int64())),
        "peer_bytes": pa.array([[]] * n_ranks, pa.list_(pa.int64())),
        "recv_wait_ns": pa.array(np.zeros(n_ranks, np.int64)),
    })
    truth["seq"] = seq_n
    return Incident(kind, n_ranks, codec.conform(ccl, S.CCL_RECORD), codec.conform(hb, S.HEARTBEAT), truth, now)


def pipeline_window(dp: int, pp: int, steps: int = 4, microbatches: int = 8, slow_egress: int = -1,
                    seed: int = 0, job_id: str = "pipejob") -> pa.Table:
    """The CCL records of one window of a dp x pp pipeline job as a Python exporter writes them (enter and exit
    only, no per-peer timing): each microbatch's activation and gradient sends with their receives between
    adjacent stages, and one gradient all-reduce per stage's DP group and step. Rank = dp_rank * pp + stage.
    ``slow_egress``: a rank whose sends take 10x longer. Vectorised, for the diagnosis' speed at 16,384 ranks."""
    rng = np.random.default_rng(seed)
    d, s, st, mb = np.meshgrid(np.arange(dp), np.arange(pp - 1), np.arange(steps), np.arange(microbatches),
                               indexing="ij")
    d, s, st, mb = (x.ravel() for x in (d, s, st, mb))
    src = np.r_[d * pp + s, d * pp + s + 1]           # activations forward, then gradients back
    dst = np.r_[d * pp + s + 1, d * pp + s]
    n_seq = np.tile(st * microbatches + mb, 2)
    t = np.tile(st * _NS + mb * 20_000_000, 2).astype(np.int64)
    nbytes = 1 << 20
    xfer = (nbytes * rng.uniform(0.9, 1.1, len(src)) * np.where(src == slow_egress, 10.0, 1.0)).astype(np.int64)
    s_enter = t + rng.integers(0, 1_000_000, len(src))
    r_enter = t - 2_000_000
    r_exit = np.maximum(s_enter, r_enter) + xfer
    group = np.char.add(np.char.add(np.char.add("p2p:", src.astype(str)), ">"), dst.astype(str))
    n = len(src)
    p2p = {
        "rank": np.r_[src, dst], "group": np.r_[group, group], "seq": np.r_[n_seq, n_seq],
        "op": np.r_[np.full(n, "isend"), np.full(n, "irecv")], "enter_ns": np.r_[s_enter, r_enter],
        "exit_ns": np.r_[s_enter + xfer, r_exit], "ranks": [None] * (2 * n),
    }
    # Gradient all-reduce: per stage and step, every DP rank; the slow NIC's group takes 10x longer.
    stg, stp, dr = (x.ravel() for x in np.meshgrid(np.arange(pp), np.arange(steps), np.arange(dp), indexing="ij"))
    crank = dr * pp + stg
    slow_stage = slow_egress % pp if slow_egress >= 0 else -1
    c_enter = stp * _NS + 500_000_000 + rng.integers(0, 1_000_000, len(crank))
    c_exit = (stp * _NS + 502_000_000 + np.where(stg == slow_stage, 200_000_000, 20_000_000)).astype(np.int64)
    gnames = np.array([f"ranks:{g}-{(dp - 1) * pp + g}:{pp}" for g in range(pp)])
    members = [list(range(g, dp * pp, pp)) for g in range(pp)]
    cols = {
        "rank": np.r_[p2p["rank"], crank], "group": np.r_[p2p["group"], gnames[stg]],
        "seq": np.r_[p2p["seq"], stp], "op": np.r_[p2p["op"], np.full(len(crank), "all_reduce")],
        "enter_ns": np.r_[p2p["enter_ns"], c_enter], "exit_ns": np.r_[p2p["exit_ns"], c_exit],
    }
    n_all = len(cols["rank"])
    p2p_ranks = np.stack([np.r_[src, src], np.r_[dst, dst]], axis=1).astype(np.int32)
    offsets_p2p = np.arange(0, 2 * len(p2p_ranks) + 1, 2, dtype=np.int32)
    coll_lists = pa.array([members[g] for g in stg.tolist()], pa.list_(pa.int32()))
    group_ranks = pa.concat_arrays([pa.ListArray.from_arrays(pa.array(offsets_p2p), pa.array(p2p_ranks.ravel())),
                                    coll_lists])
    empty = pa.array([[]] * n_all, pa.list_(pa.int64()))
    return pa.table({
        "job_id": pa.array([job_id] * n_all), "attempt": pa.array(np.zeros(n_all, np.int32)),
        "rank": pa.array(cols["rank"].astype(np.int32)), "window_id": pa.array(np.zeros(n_all, np.int64)),
        "step": pa.array(np.r_[np.tile(st, 4), stp].astype(np.int64)), "group": pa.array(cols["group"].astype(str)),
        "group_ranks": group_ranks, "seq": pa.array(cols["seq"].astype(np.int64)), "op": pa.array(cols["op"]),
        "algorithm": pa.array([""] * n_all), "nbytes": pa.array(np.full(n_all, nbytes, np.int64)),
        "enter_ns": pa.array(cols["enter_ns"].astype(np.int64)), "exit_ns": pa.array(cols["exit_ns"].astype(np.int64)),
        "peers": pa.array([[]] * n_all, pa.list_(pa.int32())), "peer_transfer_ns": empty, "peer_bytes": empty,
        "recv_wait_ns": pa.array(np.full(n_all, -1, np.int64)),
    }, schema=S.CCL_RECORD)
