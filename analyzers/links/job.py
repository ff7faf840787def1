"""One answer per job: the link finding its windows support, not one per window side by side.

Each window names its most likely element on its own evidence; on a noisy host two windows of one fault
can name two elements (window 0 "NIC egress of rank 2", window 15 "link 2>1": a capped egress is also the
one link the ring's sender uses; a capped ingress also slows the ACKs of the rank's own sends). The job's
answer is worked out from every window's findings:

- each window votes for its most confident finding (at ``shown`` or more: ``[alerts] link_shown_confidence``,
  what the trace summary prints);
- the element with most votes wins (ties: the higher summed confidence, then the earlier first sighting);
- where the winner has no majority of the voting windows and every winner of a window names one rank
  (as sender, receiver or both), that rank's network is the answer (``endpoint``): the windows agree on
  the rank and differ only on its direction, which they could not tell apart;
- the answer says how many windows support it, of how many with findings, and since when; the others are
  listed as also named.

Pure: LINK_FAULT rows in (the store's ``job_links``, one job attempt), a ``JobFinding`` out.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

@dataclasses.dataclass(frozen=True)
class JobFinding:
    kind: str                      # a LinkFault kind; "endpoint" where windows agree on a rank only
    src: int
    dst: int
    group: str
    windows: tuple[int, ...]       # the windows whose vote it is (for an endpoint: every window naming the rank)
    voting: int                    # windows with a finding at ``shown`` or more
    since: int                     # its first window
    confidence: float              # the best confidence a supporting window gave it
    named_as: tuple[tuple[str, int, int, int], ...] = ()  # for an endpoint: (kind, src, dst, windows) per element
    others: tuple[tuple[str, int, int, int], ...] = ()    # other windows' elements: (kind, src, dst, windows)
    late_by: tuple[float, float] | None = None  # a late sender's margin: median ns and share of its step over its windows


def _late_by(rows: list[Mapping[str, Any]]) -> tuple[float, float] | None:
    """A late sender's median margin over the windows that named it (``margin_ns``, ``margin_share_of_step`` of
    each window's evidence); None where no window's evidence has them."""
    ns, share = [], []
    for r in rows:
        ev = r.get("evidence") or r.get("evidence_json") or {}
        if isinstance(ev, str):
            try:
                ev = json.loads(ev)
            except ValueError:
                continue
        if isinstance(ev, Mapping) and ev.get("margin_ns") is not None:
            ns.append(float(ev["margin_ns"]))
            if ev.get("margin_share_of_step") is not None:
                share.append(float(ev["margin_share_of_step"]))
    if not ns:
        return None
    return float(np.median(ns)), (float(np.median(share)) if share else float("nan"))


def _ranks(kind: str, src: int, dst: int) -> set[int]:
    return {r for r in (src, dst) if r is not None and r >= 0}


def job_finding(rows: Iterable[Mapping[str, Any]], shown: float) -> JobFinding | None:
    """The job's answer from its windows' LINK_FAULT rows (one attempt), or None where no window found anything
    at ``shown``."""
    best: dict[int, Mapping[str, Any]] = {}
    for r in rows:
        if r["confidence"] < shown:
            continue
        w = int(r["window_id"])
        cur = best.get(w)
        if cur is None or (r["confidence"], r["slowdown"]) > (cur["confidence"], cur["slowdown"]):
            best[w] = r
    if not best:
        return None
    votes: dict[tuple[str, int, int], list[int]] = {}
    for w, r in sorted(best.items()):
        votes.setdefault((r["kind"], int(r["src"]), int(r["dst"])), []).append(w)
    conf = {e: max(best[w]["confidence"] for w in ws) for e, ws in votes.items()}
    total = {e: sum(best[w]["confidence"] for w in ws) for e, ws in votes.items()}
    order = sorted(votes, key=lambda e: (-len(votes[e]), -total[e], min(votes[e])))
    lead = order[0]
    listed = tuple((k, s, d, len(votes[(k, s, d)])) for k, s, d in order)
    common = set.intersection(*(_ranks(*e) for e in votes))
    if len(votes) > 1 and 2 * len(votes[lead]) <= len(best) and len(common) == 1:
        rank = next(iter(common))
        return JobFinding("endpoint", rank, -1, best[min(best)]["group"], tuple(sorted(best)), len(best),
                          min(best), max(conf.values()), named_as=listed)
    group = best[votes[lead][0]]["group"]
    late = _late_by([best[w] for w in votes[lead]]) if lead[0] == "noncomm_slow" else None
    return JobFinding(lead[0], lead[1], lead[2], group, tuple(votes[lead]), len(best), min(votes[lead]), conf[lead],
                      others=listed[1:], late_by=late)
