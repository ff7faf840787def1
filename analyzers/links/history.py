"""A link finding earns its confidence by coming back: one window's alone is reported at low confidence.

On shared hosts one window now and then has a healthy rank last into every
collective (named a late sender at 1.00 in 2 of 8 healthy 8-rank runs
recorded on the 2-core VM, each time in one window only, never the next), or
a transfer slowed by a CPU hiccup. A real fault stays where it is: the slow
link of a ring was named in the window before in 3 of 3 runs. So a finding
keeps the confidence of its window only where the job's latest earlier
analysed window found the same element (kind, src, dst) too; otherwise it
is capped at ``FIRST_SEEN_CAP``, still shown (the trace summary prints from
0.3), never near certain, and its evidence says so.

``FindingHistory.weigh(key, link_fault_table)`` is called by the shard for
every analysed window (``ray_jobs/dispatch.py``), in the order the analyses
finish: a window whose predecessor is not analysed yet is judged alone. The
history is per (job, attempt) and bounded; it is part of the shard's saved
state (``state``/``restore``, ``ray_jobs.state``), so a restarted shard
judges the next window against the one before as it would have.
"""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from core import jsonutil

FIRST_SEEN_CAP = 0.5
"""Most confidence a finding keeps in the first window that shows it."""
SEEN = 0.3
"""A finding of a window at least this confident confirms the same element in a later window."""
KEEP_WINDOWS = 4
"""Windows remembered per job (the latest earlier one decides; a few more absorb analyses finishing out of order)."""


class FindingHistory:
    def __init__(self, max_jobs: int = 100_000):
        self.max_jobs = max_jobs
        # (job, attempt) -> window_id -> elements found there at SEEN or more
        self._seen: dict[tuple[str, int], dict[int, set[tuple[str, int, int]]]] = {}

    def state(self) -> dict:
        """Plain data to resume from: (job, attempt) -> window -> the elements found there."""
        return {job: {w: sorted(found) for w, found in windows.items()} for job, windows in self._seen.items()}

    def restore(self, state: dict) -> None:
        self._seen = {tuple(job): {int(w): {tuple(e) for e in found} for w, found in windows.items()}
                      for job, windows in state.items()}

    def weigh(self, key: tuple[str, int, int], faults: pa.Table | None) -> pa.Table | None:
        """``faults`` (LINK_FAULT rows of window ``key``) with the unconfirmed ones capped; a window without
        findings is remembered too (it confirms nothing in the next)."""
        job, window = key[:2], key[2]
        windows = self._seen.pop(job, {})
        self._seen[job] = windows  # most recently used last: the oldest job is the first to go
        if len(self._seen) > self.max_jobs:
            del self._seen[next(iter(self._seen))]
        earlier = [w for w in windows if w < window]
        before = windows[max(earlier)] if earlier else None
        rows = faults.to_pylist() if faults is not None and faults.num_rows else []
        windows[window] = {(r["kind"], r["src"], r["dst"]) for r in rows if r["confidence"] >= SEEN}
        for w in sorted(windows)[:-KEEP_WINDOWS]:
            del windows[w]
        if not rows:
            return faults
        confidence, evidence = [], []
        for r in rows:
            element = (r["kind"], r["src"], r["dst"])
            if before is not None and element in before:
                confidence.append(r["confidence"])
                evidence.append(_with(r["evidence_json"], {"found_before": max(earlier)}))
            else:
                capped = min(r["confidence"], FIRST_SEEN_CAP)
                confidence.append(capped)
                note = {"first_seen": True}
                if capped < r["confidence"]:
                    note["window_confidence"] = round(r["confidence"], 3)
                evidence.append(_with(r["evidence_json"], note))
        out = faults.set_column(faults.schema.get_field_index("confidence"), "confidence",
                                pa.array(confidence, pa.float64()))
        out = out.set_column(out.schema.get_field_index("evidence_json"), "evidence_json",
                             pa.array(evidence, pa.string()))
        # The most confident first, as the analysis ordered them.
        return out.take(pc.sort_indices(out, [("confidence", "descending"), ("slowdown", "descending")]))


def found_before(row: dict) -> int | None:
    """The window before in which the job found this LINK_FAULT row's element too (``weigh`` wrote it into the
    evidence), or None."""
    try:
        seen = (json.loads(row.get("evidence_json") or "{}").get("persistence") or {})
    except (ValueError, AttributeError):
        return None
    return seen.get("found_before")


def _with(evidence_json: str, extra: dict) -> str:
    try:
        ev = json.loads(evidence_json) if evidence_json else {}
    except ValueError:
        ev = {"evidence": evidence_json}
    if not isinstance(ev, dict):
        ev = {"evidence": ev}
    return jsonutil.dumps({**ev, "persistence": extra})
