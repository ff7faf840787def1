"""A link finding earns its confidence by coming back: one window's alone is reported at low confidence.

On shared hosts one window now and then has a healthy rank last into every
collective (named a late sender at 1.00 in 2 of 8 healthy 8-rank runs
recorded on the 2-core VM, each time in one window only, never the next), or
a transfer slowed by a CPU hiccup. A real fault stays where it is: the slow
link of a ring was named in the window before in 3 of 3 runs. So a finding
keeps the confidence of its window only where the job's latest earlier
analysed window found the same element (kind, src, dst) too; otherwise it
is capped at ``FIRST_SEEN_CAP`` (0.5: printed, a warning at most, never near
certain), a late sender at ``LATE_FIRST_SEEN_CAP`` (a hint until the next
window finds it too, unless its window had it last in every step: ``_steady``),
and its evidence says so. A finding that named the
element it could not tell itself from (``evidence['alternative_element']``: a
ring's NIC or its one link, before the sender's path probe arrived), or that
named a rank's network without its direction ('endpoint'), found those
elements too: a later window that tells the two apart is its confirmation, not
a first sighting (a flat ring's link 5>4 at 40mbit: window 0 "NIC of rank 5,
or link 5>4" at 0.48, window 6 "link 5>4" at 0.97, stored at 0.50).

``weigh(faults, prior)`` does that to a window's findings inside its analysis
(``analyzers.window``: before its tables are built, so the remedies and the
stored rows see the same confidences). ``FindingHistory`` is what the shard
keeps per (job, attempt) across windows: ``before(key)`` is the ``Prior`` a
window is analysed with, ``record(key, found_in(link_fault_table))`` what it
found once analysed. A window whose predecessor is still being analysed is
judged against the latest earlier one that is done. The history is bounded
and part of the shard's saved state (``state``/``restore``, ``ray_jobs.state``),
so a restarted shard judges the next window against the one before as it would
have.
"""
from __future__ import annotations

import dataclasses
import json

import pyarrow as pa

from analyzers.links.fault import LinkFault

FIRST_SEEN_CAP = 0.5
"""Most confidence a finding of the network keeps in the first window that shows it."""
LATE_FIRST_SEEN_CAP = 0.45
"""... and a late sender: under what is printed and alerted (``[alerts] link_shown_confidence``, 0.5). A late
sender is a rank last by a stable margin across windows (issue 52); one window's lateness is what a shared
host's scheduler does: a healthy DP2 x PP2 job beside a CPU hog had rank 2 last by 9.5 ms (4% of its step)
in window 6 only, printed at 0.50, while every late rank of the real runs but one (below) was found in window 0
as well."""
LATE_STEADY_STEPS = 4
LATE_STEADY_SHARE = 0.08
"""A late sender that its first window saw last in every one of its steps (at least ``LATE_STEADY_STEPS``), by at
least this share of the step (median), has its stable margin within the window: the first-seen cap of the
network (0.5, printed) is its cap. Recorded windows (sweeps 8-16, 340 real runs on the 2-core VM): the late
ranks' windows of that kind held margins of 11-48% of the step; a healthy rank last in every step of one window
(2 of 340 runs) held 5.2-5.6%, and the other ranks wrongly found late by more (8-33%) were so in 3 of 4 steps.
A ring's late rank 3 that window 0 (the warm-up, beside a CPU hog: jitter 19 ms) missed was last by 23% in all 4
steps of window 6, and stayed a hint at 0.45 until this."""
SEEN = 0.3
"""A finding of a window at least this confident confirms the same element in a later window."""
KEEP_WINDOWS = 4
"""Windows remembered per job (the latest earlier one decides; a few more absorb analyses finishing out of order)."""


@dataclasses.dataclass(frozen=True)
class Prior:
    """What the job's latest analysed window before this one found, at ``SEEN`` or more."""
    window_id: int
    elements: frozenset[tuple[str, int, int]]


def weigh(faults: list[LinkFault], prior: Prior | None) -> list[LinkFault]:
    """``faults`` with those ``prior`` did not find capped (``FIRST_SEEN_CAP``, ``LATE_FIRST_SEEN_CAP``), each
    one's evidence saying which (``persistence``); the most confident first, as the analysis ordered them."""
    out = []
    for f in faults:
        if prior is not None and f.kind == "endpoint":
            # A rank's network without its direction, where the window before told which: that direction (a
            # two-level job's capped ingress 6, window 0 "ingress 6" from the flows, window 6 "endpoint 6"
            # from the collectives alone, printed as such at 0.50).
            sides = [e for e in (("source", f.src, -1), ("destination", -1, f.src)) if e in prior.elements]
            if len(sides) == 1:
                f = dataclasses.replace(f, kind=sides[0][0], src=sides[0][1], dst=sides[0][2],
                                        evidence={**f.evidence, "direction_from": prior.window_id})
        if prior is not None and (f.kind, f.src, f.dst) in prior.elements:
            out.append(dataclasses.replace(f, evidence={**f.evidence, "persistence": {"found_before": prior.window_id}}))
            continue
        capped = min(f.confidence, LATE_FIRST_SEEN_CAP if f.kind == "noncomm_slow" and not _steady(f)
                     else FIRST_SEEN_CAP)
        note: dict = {"first_seen": True}
        if capped < f.confidence:
            note["window_confidence"] = round(f.confidence, 3)
        out.append(dataclasses.replace(f, confidence=capped, evidence={**f.evidence, "persistence": note}))
    return sorted(out, key=lambda f: (-f.confidence, -f.slowdown))


def _steady(f: LinkFault) -> bool:
    """Whether a late sender was late in every step of its window by ``LATE_STEADY_SHARE`` of the step or more."""
    ev = f.evidence
    try:
        steps, late, share = int(ev["steps"]), int(ev["late_steps"]), float(ev["margin_share_of_step"])
    except (KeyError, TypeError, ValueError):
        return False
    return steps >= LATE_STEADY_STEPS and late == steps and share >= LATE_STEADY_SHARE


def elements(kind: str, src: int, dst: int, evidence: dict) -> set[tuple[str, int, int]]:
    """The element a finding names, and those it could not tell it from: the alternative it named beside it
    (``alternative_element``); a rank's NIC and its ingress for an 'endpoint' (its network, direction not
    observable: a two-level all-reduce's capped ingress of rank 6 was that in window 0, at 0.52, and its
    ingress at 0.97 in window 6, stored at 0.50)."""
    out = {(kind, src, dst)}
    if kind == "endpoint":
        out |= {("source", src, -1), ("destination", -1, src)}
    alt = evidence.get("alternative_element") if isinstance(evidence, dict) else None
    if isinstance(alt, (list, tuple)) and len(alt) == 3:
        out.add((str(alt[0]), int(alt[1]), int(alt[2])))
    return out


def found_in(link_faults: pa.Table | None) -> frozenset[tuple[str, int, int]]:
    """The elements a window's LINK_FAULT rows name at ``SEEN`` or more (with the alternatives they named): what
    confirms them in the next window."""
    if link_faults is None or link_faults.num_rows == 0:
        return frozenset()
    cols = [link_faults[c].to_pylist() for c in ("kind", "src", "dst", "confidence")]
    evidence = (link_faults["evidence_json"].to_pylist() if "evidence_json" in link_faults.column_names
                else [None] * link_faults.num_rows)
    found: set[tuple[str, int, int]] = set()
    for k, s, d, c, ev in zip(*cols, evidence):
        if c >= SEEN:
            found |= elements(k, s, d, _parsed(ev))
    return frozenset(found)


def _parsed(evidence_json: str | None) -> dict:
    try:
        ev = json.loads(evidence_json or "{}")
    except ValueError:
        return {}
    return ev if isinstance(ev, dict) else {}


class FindingHistory:
    def __init__(self, max_jobs: int = 100_000):
        self.max_jobs = max_jobs
        # (job, attempt) -> window_id -> elements found there at SEEN or more
        self._seen: dict[tuple[str, int], dict[int, frozenset[tuple[str, int, int]]]] = {}

    def state(self) -> dict:
        """Plain data to resume from: (job, attempt) -> window -> the elements found there."""
        return {job: {w: sorted(found) for w, found in windows.items()} for job, windows in self._seen.items()}

    def restore(self, state: dict) -> None:
        self._seen = {tuple(job): {int(w): frozenset(tuple(e) for e in found) for w, found in windows.items()}
                      for job, windows in state.items()}

    def before(self, key: tuple[str, int, int]) -> Prior | None:
        """What the job's latest analysed window before window ``key`` found; None if none was analysed."""
        windows = self._seen.get(key[:2], {})
        earlier = [w for w in windows if w < key[2]]
        return Prior(max(earlier), windows[max(earlier)]) if earlier else None

    def record(self, key: tuple[str, int, int], found: frozenset[tuple[str, int, int]]) -> None:
        """Window ``key`` is analysed and found ``found`` (``found_in``); a window without findings is remembered
        too (it confirms nothing in the next)."""
        job = key[:2]
        windows = self._seen.pop(job, {})
        self._seen[job] = windows  # most recently used last: the oldest job is the first to go
        if len(self._seen) > self.max_jobs:
            del self._seen[next(iter(self._seen))]
        windows[key[2]] = frozenset(found)
        for w in sorted(windows)[:-KEEP_WINDOWS]:
            del windows[w]

    def weigh(self, key: tuple[str, int, int], faults: list[LinkFault]) -> list[LinkFault]:
        """A reader that takes a job's windows one after another: ``faults`` of window ``key`` weighed by the
        window before, and remembered."""
        out = weigh(faults, self.before(key))
        self.record(key, frozenset().union(*(elements(f.kind, f.src, f.dst, f.evidence)
                                             for f in out if f.confidence >= SEEN)))
        return out


def found_before(row: dict) -> int | None:
    """The window before in which the job found this LINK_FAULT row's element too (``weigh`` wrote it into the
    evidence), or None."""
    seen = _parsed(row.get("evidence_json")).get("persistence")
    return seen.get("found_before") if isinstance(seen, dict) else None
