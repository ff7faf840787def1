"""Worker issues and link or NIC faults -> which host to swap or drain, and what it buys.

Why: a slow GPU, a throttled host or a slow NIC holds back every rank that
synchronises with it; the fix an on-call engineer can apply is operational:
cordon the host, swap in a spare, restart from the checkpoint, or drain a
link. What the engineer needs is *which* host (names, ranks) and whether it
is worth a restart (the gain).

How:
- ``advise_swap`` (verdict ``worker``): the top workers of the analysis whose
  compute is slower than their peers (the other DP ranks of the stage; with
  one DP rank, the other stages but the last). The fix sets each such
  worker's compute durations to its peers' (per op type: the worker's
  durations times peer median / worker median, so per-microbatch variation is
  kept); without any peer the what-if ideal (the mean of the type) stands in. Hosts come from the Megatron rank order
  (``JobFacts.worker_ranks``) and ``gpus_per_node``.
- ``advise_link`` (a fault of ``analyzers.links``): a slow link, source NIC or
  destination names its ranks; the fix gives the communication ops of the
  groups that cross it (the DP collectives of a stage, the point-to-point
  transfers between two neighbouring stages) the median transfer time of
  their type among the groups that do not, never longer than traced. A late
  sender (``noncomm_slow``) is a compute problem: its host is swapped as above.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from analyzers.whatif import opcodes as T

from .model import JobFacts, Remedy
from .resim import Cells, TraceCells, gain

SLOW_RATIO = 1.05
"""A worker whose compute is at least this much slower than its peers is worth a swap."""
_COMPUTE = (T.F, T.B, T.OPT)
_P2P = (T.FS, T.FR, T.BS, T.BR)


def _fold(ranks: list[int]) -> str:
    """'0-7, 16' from sorted ranks."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and isinstance(out[-1], list) and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def worker_slowness(tc: TraceCells, dp: int, pp: int) -> dict[int, float]:
    """Per compute op type: median duration of worker (dp, pp) over the median of its peers.

    Peers are the other DP ranks of its stage (same layers, same work); with
    one DP rank, the other stages but the last (which also runs the loss).
    """
    lay = tc.layout
    if lay.dp_size > 1:
        peer = lambda c: (c.dp != dp) & (c.pp == pp)
    elif lay.pp_size > 2 or (lay.pp_size == 2 and pp == 1):
        last = lay.pp_size - 1
        peer = lambda c: (c.pp != pp) & ((c.pp != last) | (pp == last))
    else:
        return {}
    out = {}
    for code in _COMPUTE:
        own = tc.values(lambda c, k=code: (c.code == k) & (c.dp == dp) & (c.pp == pp))
        peers = tc.values(lambda c, k=code: (c.code == k) & peer(c))
        if len(own) and len(peers) and np.median(peers) > 0:
            out[code] = float(np.median(own) / np.median(peers))
    return out


def _hosts_of(facts: JobFacts, workers: list[tuple[int, int]]) -> dict[int, list[int]]:
    """Host index -> global ranks of the given workers on it."""
    hosts: dict[int, list[int]] = {}
    for d, x in workers:
        for r in facts.worker_ranks(d, x):
            hosts.setdefault(facts.host_index(r), []).append(r)
    return hosts


def _spares(facts: JobFacts, n: int) -> list[str]:
    return [facts.spare_hosts[i] if i < len(facts.spare_hosts) else "a spare host" for i in range(n)]


def _swap_fix(tc: TraceCells, workers: list[tuple[int, int]], ratios: dict[tuple[int, int], dict[int, float]]):
    ideal = {code: float(np.mean(tc.values(lambda c, k=code: c.code == k))) for code in _COMPUTE}

    def fix(c: Cells) -> np.ndarray:
        out = c.dur.copy()
        for d, x in workers:
            on = (c.dp == d) & (c.pp == x)
            for code in _COMPUTE:
                sel = on & (c.code == code)
                if not sel.any():
                    continue
                r = ratios[(d, x)].get(code)
                if r is not None and r > 1.0:
                    out[sel] = c.dur[sel] / r
                elif r is None:  # no DP peers: the what-if ideal
                    out[sel] = np.minimum(c.dur[sel], ideal[code])
        return out

    return fix


def advise_swap(tc: TraceCells, facts: JobFacts, workers: list[tuple[int, int]], verdict: str = "worker",
                reason: dict[tuple[int, int], str] | None = None) -> Remedy | None:
    """Swap the hosts of the given (dp, pp) workers that are measurably slower than their peers."""
    slow, ratios = [], {}
    for d, x in workers:
        r = worker_slowness(tc, d, x)
        if not r or max(r.values()) >= SLOW_RATIO:  # no peers at all: trust the verdict
            slow.append((d, x))
            ratios[(d, x)] = r
    if not slow:
        return None
    before = tc.mean_step_time()
    after = tc.mean_step_time(_swap_fix(tc, slow, ratios))
    hosts = _hosts_of(facts, slow)
    spares = _spares(facts, len(hosts))
    parts = []
    plan = []
    for (h, ranks), spare in zip(sorted(hosts.items()), spares):
        on = [w for w in slow if facts.host_index(facts.worker_ranks(*w)[0]) == h]
        why = []
        for d, x in on:
            r = ratios[(d, x)].get(T.F) or ratios[(d, x)].get(T.B)
            why.append(f"dp{d}/pp{x}" + (f" compute {r:.2f}x its peers" if r else "")
                       + (f" {reason[(d, x)]}" if reason and (d, x) in reason else ""))
        name = facts.host_name(h)
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{name} ({label} {_fold(ranks)}: {'; '.join(why)}) for {spare}")
        plan.append({"host": name, "host_index": h, "ranks": sorted(ranks), "spare": spare,
                     "workers": [[d, x] for d, x in on],
                     "compute_vs_peers": {f"dp{d}/pp{x}": {T.GROUP_NAMES[T.GROUP_OF_CODE[k]]: v
                                                           for k, v in ratios[(d, x)].items()} for d, x in on}})
    action = f"cordon and swap {', '.join(parts)}; restart from the last checkpoint"
    details: dict[str, Any] = {
        "hosts": plan, "gpus_per_node": facts.gpus_per_node,
        "model": "the workers' compute durations scaled to their peers' median (no peers: the type's mean)",
    }
    return Remedy(kind="swap_host", verdict=verdict, action=action, predicted_gain=gain(before, after),
                  step_time_before_s=before, step_time_after_s=after, details=details)


def _crossing(facts: JobFacts, kind: str, src: int, dst: int) -> list[tuple[str, int, int, int]]:
    """Communication groups of the op trace that cross the fault: (what, stage, dp, other stage)."""
    lay = facts.layout
    out: list[tuple[str, int, int, int]] = []
    ends = {"source": [src], "destination": [dst], "endpoint": [src], "link": [src, dst]}.get(kind, [])
    ws = [facts.worker_of_rank(r) for r in ends if 0 <= r < lay.world_size]
    if kind == "link" and len(ws) == 2:
        (d1, p1), (d2, p2) = ws
        if p1 == p2 and d1 != d2:
            return [("dp", p1, -1, -1)]
        if d1 == d2 and abs(p1 - p2) == 1:
            return [("p2p", min(p1, p2), d1, max(p1, p2))]
        ws = ws[:1]  # same worker (TP/CP inside it) or no direct group: its own groups
    for d, x in ws:
        if lay.dp_size * lay.cp_size > 1:
            out.append(("dp", x, -1, -1))
        for y in (x - 1, x + 1):
            if 0 <= y < lay.pp_size:
                out.append(("p2p", min(x, y), d, max(x, y)))
    return out


def _link_fix(tc: TraceCells, groups: list[tuple[str, int, int, int]]):
    def crossing(c: Cells) -> np.ndarray:
        hit = np.zeros(c.code.shape, bool)
        for what, s, d, s2 in groups:
            if what == "dp":
                hit |= np.isin(c.code, T.DP_COLLECTIVES) & (c.pp == s)
            else:
                hit |= np.isin(c.code, _P2P) & (c.dp == d) & ((c.pp == s) | (c.pp == s2))
        return hit

    med = {}
    for code in (*T.DP_COLLECTIVES, *_P2P):
        v = tc.values(lambda c, k=code: (c.code == k) & ~crossing(c))
        if len(v):
            med[code] = float(np.median(v))

    def fix(c: Cells) -> np.ndarray:
        out = c.dur.copy()
        hit = crossing(c)
        for code, v in med.items():
            sel = hit & (c.code == code)
            out[sel] = np.minimum(c.dur[sel], v)
        return out

    return fix


def advise_link(tc: TraceCells, facts: JobFacts, fault: dict[str, Any], verdict: str = "link_fault") -> Remedy | None:
    """A drain (or swap, for a late sender) remedy for one fault of ``analyzers.links.diagnose``."""
    kind = str(fault.get("kind", ""))
    src, dst = int(fault.get("src", -1)), int(fault.get("dst", -1))
    lay = facts.layout
    if kind == "noncomm_slow" and 0 <= src < lay.world_size:
        w = facts.worker_of_rank(src)
        return advise_swap(tc, facts, [w], verdict=verdict,
                           reason={w: f"(rank {src} late to send: its own compute)"})
    if kind not in ("link", "source", "destination", "endpoint"):
        return None  # comm_slow: not localised, nothing to drain
    need = {"link": (src, dst), "source": (src,), "destination": (dst,), "endpoint": (src,)}[kind]
    if any(not 0 <= r < lay.world_size for r in need):
        return None  # not a rank of this job
    groups = _crossing(facts, kind, src, dst)
    before = tc.mean_step_time()
    fix = _link_fix(tc, groups)
    after = tc.mean_step_time(fix) if groups else before
    sd = float(fault.get("slowdown", float("nan")))
    hs = facts.host_name(facts.host_index(src)) if src >= 0 else ""
    hd = facts.host_name(facts.host_index(dst)) if dst >= 0 else ""
    spare = _spares(facts, 1)[0]
    if kind == "link":
        if hs == hd:
            action = (f"drain {hs}: its intra-node link rank {src} -> rank {dst} is {sd:.1f}x slower per byte; "
                      f"swap in {spare}")
            drain = [hs]
        else:
            action = (f"drain the link {hs} -> {hd} (rank {src} -> rank {dst}, {sd:.1f}x slower per byte): "
                      f"reroute around it or reseat the cable/NIC port; the hosts' other links are healthy")
            drain = []
    elif kind == "endpoint":
        action = (f"drain {hs} (rank {src}'s network is {sd:.1f}x slower per byte in every group it is in; "
                  f"whether it sends or receives slowly the collectives cannot say) and swap in {spare}")
        drain = [hs]
    elif kind == "source":
        action = (f"drain {hs} (rank {src}'s NIC sends {sd:.1f}x slower per byte on most of its links) and "
                  f"swap in {spare}")
        drain = [hs]
    else:
        action = (f"drain {hd} (rank {dst} receives {sd:.1f}x slower per byte on most of its links) and "
                  f"swap in {spare}")
        drain = [hd]
    details = {
        "fault": {k: fault.get(k) for k in ("group", "kind", "src", "dst", "confidence", "slowdown")},
        "drain_hosts": drain, "link": [hs, hd] if kind == "link" else None,
        "crossing_groups": [{"type": w, "stage": s, "dp_rank": d if d >= 0 else None,
                             "other_stage": s2 if s2 >= 0 else None} for w, s, d, s2 in groups],
        "model": "transfers of the groups crossing the fault at the median of their type elsewhere",
    }
    return Remedy(kind="drain_link", verdict=verdict, action=action, predicted_gain=gain(before, after),
                  step_time_before_s=before, step_time_after_s=after, details=details)
