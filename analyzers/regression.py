"""Is this job slower than it was? Change points in a job's own history of windows, and what moved.

The what-if asks who is slower than their peers; when every rank slows
together (a slower storage or data loader, a congested fabric, a library
upgrade, a rack that throttles) S stays near 1 and nothing is said. This
module compares a job with its own past, window by window:

- **Detection: a one-sided CUSUM on log step time**, against a baseline
  (the median of the first ``baseline_windows`` windows, or of the windows
  since the last change). Each window adds ``x - baseline - k`` with
  ``k = log(1 + min_change) / 2``, half the smallest change that counts;
  an alarm is a sum over ``h = (k_windows - 0.5) * k``, so a change of exactly
  ``min_change`` alarms after about ``k_windows`` windows and a bigger one
  sooner, while jitter around the baseline drains away. CUSUM is the
  detector that reaches a given false-alarm rate in the fewest windows for a
  step change (Page, 1954).
- **Confirmation: a change of at least ``min_change`` lasting at least
  ``k_windows``**: the median of the last ``k_windows`` windows must be that
  much over the baseline. Jitter below it never alerts (Falcon, ATC'25, gates
  its change points the same way).
- **What moved**: the op types' time per step after the change against before
  (each op type's share of the change: "grads-reduce-scatter +85%, compute
  unchanged: communication"), and where: every worker's step time against
  its own before, "every worker" or the few that moved.
- **A return to the baseline** is an event (``recovered``), not an alert.
- **A worker against its own best**: each worker's step time over its best
  rolling median; a worker ``min_change`` over its best while the job's
  median worker is not (it degrades while its peers hold, or more than they
  slow) is a ``degraded_worker`` event (NVIDIA's straggler detection calls
  this the individual score).

``RegressionDetector`` is a reducer over one job attempt's ``WindowPoint``s in
window order; ``add`` returns the events of that window. Its state is plain
data (``state``/``restore``), for a shard to save.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from core.config import RegressionConfig


@dataclasses.dataclass(frozen=True)
class RegressionParams(RegressionConfig):
    """The ``[regression]`` section's parameters (``core.config.RegressionConfig``: the smallest change, how
    many windows, the baseline; 10% is what Falcon gates at, below it step times drift with data and load),
    and the detector's own, which are not configured."""

    worker_history: int = 8
    """Windows of a worker's own step times its best is the best rolling median of."""
    share_floor: float = 0.05
    """An op type whose change is under this share of the step's change is 'unchanged'."""
    max_points: int = 48
    """Windows kept per job: the baseline's own, then the latest (a job runs for thousands of windows)."""
    max_workers: int = 512
    """Workers whose own step times are followed (the first by rank); a wider job's others are not scored."""

    @property
    def k(self) -> float:
        return math.log1p(self.min_change) / 2

    @property
    def h(self) -> float:
        return (self.k_windows - 0.5) * self.k


@dataclasses.dataclass(frozen=True)
class WindowPoint:
    """What one analysed window says of the job's speed."""
    window_id: int
    first_step: int
    end_ns: int
    step_s: float                                   # mean actual step time
    optype_s: dict[str, float] = dataclasses.field(default_factory=dict)  # op type -> time per step
    workers: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (dp, pp) -> step time
    slowdown: float = math.nan
    mfu: float = math.nan


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str                  # regression | recovered | degraded_worker
    window_id: int             # the window that confirmed it
    began_window: int          # the first window of the change
    began_step: int
    change: float              # step time after / before - 1 (the worker's over its best for degraded_worker)
    before_s: float
    after_s: float
    optypes: dict[str, float]  # op type -> its share of the change (degraded_worker: empty)
    scope: str                 # "every worker", "dp1/pp0, dp1/pp1", or the worker
    summary: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _median(v) -> float:
    return float(np.median(v)) if len(v) else math.nan


class RegressionDetector:
    """Change points of one job attempt's step time, window by window (module docstring)."""

    def __init__(self, params: RegressionParams = RegressionParams()):
        self.params = params
        self.points: list[WindowPoint] = []   # since the baseline began (bounded: the baseline and the run)
        self.baseline: float | None = None    # log step time
        self.base_start = 0                   # index in points where the baseline's windows begin
        self.settling = False                 # the baseline is still taking in windows
        self.cusum = 0.0
        self.run_start: int | None = None     # index where the current excursion began
        self.regressed_from: float | None = None  # log baseline before the last regression (for recoveries)
        self.worker_best: dict[tuple[int, int], float] = {}
        self.worker_seen: dict[tuple[int, int], list[float]] = {}
        self.degraded: set[tuple[int, int]] = set()

    # -- input -------------------------------------------------------------
    def add(self, p: WindowPoint) -> list[Event]:
        if not (p.step_s > 0 and math.isfinite(p.step_s)):
            return []
        if len(p.workers) > self.params.max_workers:
            p = dataclasses.replace(p, workers=dict(sorted(p.workers.items())[:self.params.max_workers]))
        self.points.append(p)
        self._bound()
        events = self._workers(p)
        x = math.log(p.step_s)
        prm = self.params
        if self.baseline is None or self.settling:
            # The level is read from the job's first baseline_windows windows, and after a change from the
            # windows that follow it, before anything is held against it: set from the first settled one or
            # two alone, a level still moving made a second, spurious regression (+30%, then "+8% since"
            # three windows later on the same slowdown, tests/autotrace/test_trace_regression). After a
            # change the level so far is the baseline meanwhile (a recovery is said against it).
            logs = [math.log(q.step_s) for q in self.points[self.base_start:]]
            self.settling = len(logs) < prm.baseline_windows
            if self.baseline is not None or not self.settling:
                self.baseline = _median(logs)
            return events + self._recovery(x)
        # Up: a slowdown; after a regression, down to where it came from: a recovery.
        self.cusum = max(0.0, self.cusum + x - self.baseline - prm.k)
        if self.cusum > 0 and self.run_start is None:
            self.run_start = len(self.points) - 1
        if self.cusum == 0:
            self.run_start = None
        events += self._recovery(x)
        if self.cusum <= prm.h:
            return events
        tail = [math.log(q.step_s) for q in self.points[-prm.k_windows:]]
        if len(tail) < prm.k_windows or _median(tail) - self.baseline < math.log1p(prm.min_change):
            return events  # not yet a change of min_change lasting k_windows
        start = self._onset()
        if _median([math.log(q.step_s) for q in self.points[start:]]) - self.baseline < math.log1p(
                prm.min_change):
            return events  # the last windows are that slow, the change since it began is not: a smaller one
        events.append(self._regression(start))
        return events

    def _onset(self) -> int:
        """The first window of the excursion at least half the smallest change over the baseline (the CUSUM
        may have begun to climb on a jittery window before it)."""
        start = self.run_start if self.run_start is not None else len(self.points) - self.params.k_windows
        half = math.log1p(self.params.min_change) / 2
        for i in range(start, len(self.points)):
            if math.log(self.points[i].step_s) - self.baseline >= half:
                return i
        return start

    def _regression(self, start: int) -> Event:
        before = self.points[self.base_start:start] or self.points[:start]
        after = self.points[start:]
        # The new level is read on the windows wholly after the change began: the first one is a mix (a
        # change rarely begins on a window's boundary, and its first steps pay one-off costs: seen, a
        # +25% change read +48% and +60% with it).
        settled = after[1:] or after
        b = math.exp(self.baseline)
        a = _median([q.step_s for q in settled])
        shares, moved = _what_moved(before, settled, self.params)
        scope = _where(before, settled, self.params)
        change = a / b - 1
        summary = (f"step time +{100 * change:.0f}% since window {after[0].window_id} (step {after[0].first_step}): "
                   f"{b:.3f} s -> {a:.3f} s; {moved}; {scope}")
        ev = Event("regression", after[-1].window_id, after[0].window_id, after[0].first_step, change, b, a, shares,
                   scope, summary)
        # The new level is the job's from now on, read on the settled windows and on those to come (add);
        # the old one is remembered to see it come back.
        self.regressed_from = self.baseline
        self.base_start = start + len(after) - len(settled)
        self.baseline = _median([math.log(q.step_s) for q in settled])
        self.settling = len(settled) < self.params.baseline_windows
        self.cusum, self.run_start = 0.0, None
        self._trim()
        return ev

    def _recovery(self, x: float) -> list[Event]:
        """Back to the level before the last regression, for k_windows in a row: recorded, not alerted."""
        if self.regressed_from is None or self.baseline is None:
            return []
        tail = [math.log(q.step_s) for q in self.points[-self.params.k_windows:]]
        if len(tail) < self.params.k_windows or _median(tail) - self.regressed_from > math.log1p(
                self.params.min_change) / 2:
            return []
        back = math.log1p(self.params.min_change) / 2
        q = next(p for p in self.points[-self.params.k_windows:] if math.log(p.step_s) - self.regressed_from <= back)
        before, after = math.exp(self.baseline), math.exp(_median(tail))
        ev = Event("recovered", self.points[-1].window_id, q.window_id, q.first_step, after / before - 1, before,
                   after, {}, "", f"step time back to {after:.3f} s since window {q.window_id} (step "
                                   f"{q.first_step}), from {before:.3f} s")
        self.baseline, self.regressed_from = _median(tail), None
        self.base_start = len(self.points) - self.params.k_windows
        self.settling = self.params.k_windows < self.params.baseline_windows
        self.cusum, self.run_start = 0.0, None
        self._trim()
        return [ev]

    def _workers(self, p: WindowPoint) -> list[Event]:
        """Workers over their own best by min_change while the job's median worker is not."""
        if not p.workers:
            return []
        prm = self.params
        ratios = {}
        for w, t in p.workers.items():
            if not (t > 0 and math.isfinite(t)):
                continue
            seen = self.worker_seen.setdefault(w, [])
            seen.append(t)
            del seen[:-prm.worker_history]
            if len(seen) >= prm.k_windows:
                rolling = _median(seen[-prm.k_windows:])
                best = self.worker_best.get(w)
                if best is not None:
                    ratios[w] = rolling / best
                self.worker_best[w] = rolling if best is None else min(best, rolling)
        if len(ratios) < 2:
            return []
        typical = _median(list(ratios.values()))
        out = []
        for w, r in sorted(ratios.items()):
            over = r / typical if typical > 0 else math.nan
            if r >= 1 + prm.min_change and over >= 1 + prm.min_change and w not in self.degraded:
                self.degraded.add(w)
                name = f"dp{w[0]}/pp{w[1]}"
                out.append(Event("degraded_worker", p.window_id, p.window_id, p.first_step, r - 1,
                                 self.worker_best[w], self.worker_seen[w][-1], {}, name,
                                 f"{name}: step time {100 * (r - 1):.0f}% over its own best (the job's median "
                                 f"worker {100 * (typical - 1):+.0f}%)"))
            elif r < 1 + prm.min_change / 2:
                self.degraded.discard(w)
        return out

    def _bound(self) -> None:
        """At most ``max_points`` windows: those between the baseline's own and the current excursion (or
        the last ``k_windows``) go first; what-moved compares the baseline's windows with the excursion's."""
        extra = len(self.points) - self.params.max_points
        if extra <= 0:
            return
        lo = self.base_start + self.params.baseline_windows
        hi = self.run_start if self.run_start is not None else len(self.points) - self.params.k_windows
        drop = min(extra, hi - lo)
        if drop <= 0:  # an excursion as long as the whole history: its oldest windows go
            lo, drop = self.base_start + 1, extra
            if self.run_start is not None and self.run_start >= lo:
                self.run_start = max(lo, self.run_start - drop)
        elif self.run_start is not None:
            self.run_start -= drop
        del self.points[lo:lo + drop]

    def _trim(self) -> None:
        """Keep what the next change can need: the current baseline's windows and the run since."""
        keep = max(0, self.base_start - 1)
        if keep:
            self.points = self.points[keep:]
            self.base_start -= keep
            if self.run_start is not None:
                self.run_start -= keep

    # -- state for a shard to save ------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Plain data (numbers, strings, lists, dicts) to resume from; the parameters are the restorer's."""
        return {"points": [{**dataclasses.asdict(pt), "workers": [[d, p, t] for (d, p), t in pt.workers.items()]}
                           for pt in self.points],
                "baseline": self.baseline, "base_start": self.base_start, "settling": self.settling,
                "cusum": self.cusum, "run_start": self.run_start, "regressed_from": self.regressed_from,
                "worker_best": [[d, p, t] for (d, p), t in self.worker_best.items()],
                "worker_seen": [[d, p, list(ts)] for (d, p), ts in self.worker_seen.items()],
                "degraded": [list(w) for w in sorted(self.degraded)]}

    def restore(self, state: dict[str, Any]) -> None:
        self.points = [WindowPoint(**{**pt, "workers": {(d, p): t for d, p, t in pt["workers"]}})
                       for pt in state["points"]]
        for k in ("baseline", "base_start", "settling", "cusum", "run_start", "regressed_from"):
            setattr(self, k, state[k])
        self.worker_best = {(d, p): t for d, p, t in state["worker_best"]}
        self.worker_seen = {(d, p): list(ts) for d, p, ts in state["worker_seen"]}
        self.degraded = {tuple(w) for w in state["degraded"]}


def _what_moved(before: list[WindowPoint], after: list[WindowPoint], params: RegressionParams
                ) -> tuple[dict[str, float], str]:
    """Each op type's share of the step's change, and a phrase: 'grads-reduce-scatter +85% (70% of it),
    compute unchanged: communication'."""
    if not before or not after or not before[0].optype_s:
        return {}, "op types not known"
    names = sorted({n for q in before + after for n in q.optype_s})
    b = {n: _median([q.optype_s.get(n, 0.0) for q in before]) for n in names}
    a = {n: _median([q.optype_s.get(n, 0.0) for q in after]) for n in names}
    total = sum(a.values()) - sum(b.values())
    if not total > 0:
        return {}, "no op type took longer"
    shares = {n: (a[n] - b[n]) / total for n in names if abs(a[n] - b[n]) / total >= params.share_floor}
    top = sorted(shares, key=lambda n: -shares[n])
    parts = [f"{n} {100 * (a[n] / b[n] - 1):+.0f}% ({100 * shares[n]:.0f}% of it)" if b[n] > 0 else
             f"{n} new ({100 * shares[n]:.0f}% of it)" for n in top[:3] if shares[n] > 0]
    compute = [n for n in names if n.endswith("-compute")]
    if compute and all(n not in shares for n in compute):
        parts.append("compute unchanged")
    kind = _category(top[0]) if top else ""
    return shares, ", ".join(parts) + (f": {kind}" if kind else "")


def _category(optype: str) -> str:
    if optype.endswith("-compute"):
        return "compute"
    if any(s in optype for s in ("reduce", "gather", "send", "recv", "comm", "clip")):
        return "communication"
    if optype == "gc":
        return "garbage collection"
    if optype == "optimizer":
        return "optimizer"
    return "host-side (data loading, launches)"


def _where(before: list[WindowPoint], after: list[WindowPoint], params: RegressionParams) -> str:
    """'every worker' when each moved by about the job's change; else the workers that moved most."""
    workers = sorted({w for q in before + after for w in q.workers})
    if not workers:
        return "workers not known"
    change = {}
    for w in workers:
        b = _median([q.workers[w] for q in before if w in q.workers])
        a = _median([q.workers[w] for q in after if w in q.workers])
        if b > 0 and a > 0:
            change[w] = a / b - 1
    if not change:
        return "workers not known"
    floor = params.min_change / 2
    moved = [w for w, c in change.items() if c >= floor]
    if len(moved) == len(change):
        return "every worker"
    names = ", ".join(f"dp{d}/pp{p}" for d, p in sorted(moved, key=lambda w: -change[w])[:6])
    more = f" and {len(moved) - 6} more" if len(moved) > 6 else ""
    return f"{len(moved)} of {len(change)} workers moved: {names}{more}" if moved else "no worker moved alone"
