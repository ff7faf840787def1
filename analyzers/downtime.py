"""Downtime that faults cost, in Alibaba C4's categories: a streaming accountant over records we already move.

``DowntimeAccountant`` is a reducer over the records we already move: JOB
(a new ``attempt`` is a restart), CHECKPOINT (saves and loads), HEARTBEAT
(progress: ``step_done`` and ``step_done_ns``, the last step a rank
completed and when), HANG rows and ALERT rows. One *incident* is
one fault of one attempt. Its time stamps:

- ``fault_start``: the attempt's last progress before the fault was detected:
  the completion of its last completed step (``fault_step``), or the end of
  that step's checkpoint save when one finished later.
- ``alert``: the first hang or node-loss alert of the attempt at or after the
  fault: the earliest HANG row (its ``hang_id`` is the detection time; an
  alert is raised from it, and one cooled down is never sent) or ALERT row
  (rules ``hang``, ``node_loss``).
- ``diagnosed``: the first HANG or ALERT row of the incident that names the
  culprit: missing ranks, a lost node's hosts, or non-communication suspects
  fewer than all the job's GPUs; never before the alert (an alert that
  already names it gives 0 s of diagnosis).
- ``restart``: registration of the next attempt (failing re-inits, attempts
  that never complete a step, are part of the same incident).
- ``resume``: the moment useful steps start again: the start of the first
  step the next attempt completes (or, for a hang that cleared by itself, of
  the step that was stuck), estimated as its observed completion minus its
  steps at the pre-fault step time; that step redoes lost work or is new
  work, not downtime.

Categories, each a difference of consecutive stamps (a missing stamp gives
its category 0 s and the time to the category before it, so a crash that
no rule alerted on counts fault start to restart as detection):

- ``detect``   fault start -> alert (C4 "detecting", 3.41% of the month)
- ``diagnose`` alert -> culprit named
- ``isolate``  culprit named -> restart (cordon, reschedule; or -> resume for a
  hang that cleared). C4's "diagnosing and isolating" (19.65%) is
  ``diagnose + isolate``; we keep the naming apart because it is what our
  diagnosis shortens.
- ``reinit``   restart -> resume (C4 "re-initialising", 0.6%). It ends where the
  first step starts, not where it completes: that step's own time is
  counted once, in lost progress (or it is new work).
- ``lost progress`` (C4 "recomputing after the last checkpoint", 7.53%):
  ``lost_steps x step_time`` with ``lost_steps = fault_step - checkpoint``,
  the checkpoint being the step the next attempt loads (CHECKPOINT load) or,
  without one, the last complete save at or before the fault step (-1 when
  the job was seen from attempt 0 and never saved). ``step_time`` is the
  attempt's mean step time over the steps it ran since that checkpoint (over
  ``step_window_s`` before the fault if that is a single step), checkpoint
  save stalls and pauses (intervals slower than twice the median: a hang
  that cleared, an evaluation) excluded.

``total`` is their sum: exactly how far the job's progress was set back
compared with a run without the fault (with constant step times). GPU-hours
are seconds x the faulty attempt's ``n_gpus`` / 3600.

A save counts as complete when rank 0 (the coordinator, which finishes a
sharded checkpoint's metadata last) reports it, or once as many ranks as the
attempt has GPUs did. Progress is the latest ``step_done_ns`` any rank
reported per step; heartbeats from before those fields existed count "last
op = optimizer" as the end of the step before ``step`` (approximate).

Streaming contract. The accountant is a pure function of what it was fed:
an incident closes when the next attempt completes a step (or the stuck
attempt progresses again); ``emit(now_ns)`` returns the rows of incidents
closed at least ``lateness_s`` before ``now_ns`` (the caller's clock), so
records from several topics that arrive out of order within that lateness
are all in, and the rows equal those of ``account_downtime`` (the batch
form) over the same records. ``finish(end_ns)`` ends the stream and returns
the rest, open incidents clipped at ``end_ns`` (``closed`` false). Records
of an incident already emitted are counted late and dropped; progress and
saves older than ``keep_s`` are pruned, and a job silent for ``keep_s`` is
forgotten (an open incident of it is emitted, clipped at its last record),
so state stays bounded. The state is plain dataclasses: pickle is the
snapshot. ``to_tables(incidents)`` gives the DOWNTIME table of emitted rows, as
every analyzer's ``to_tables`` does.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analyzers.hang import recovery_plan_of, recovery_sentence
from core import codec
from core import schema as S

_NS = 1_000_000_000


# --------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------
def _count_ranks(folded: str) -> int:
    n = 0
    for part in (folded or "").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit():
            n += int(hi or lo) - int(lo) + 1 if (hi or lo).isdigit() else 1
    return n


def _count_hosts(hosts: str | None) -> int:
    return len([h for h in (hosts or "").split(",") if h])


@dataclasses.dataclass(frozen=True)
class Signal:
    """Evidence of a fault of one attempt, typed: when it was seen, what kind, and what it names.

    Built from a HANG row (``from_hang``) or from a hang or node-loss ALERT row
    (``from_alert``, whose details are JSON); ``DowntimeAccountant.add_signal``
    takes it directly.
    """

    ns: int
    kind: str  # comm_hang, noncomm_hang, node_loss (an alert without details: hang)
    n_missing: int
    n_stuck: int
    n_hosts: int
    recovery: str = ""
    """A node loss's restart plan, in words (``analyzers.hang.recovery_sentence``); '' without one."""

    @classmethod
    def from_hang(cls, row: Mapping[str, Any]) -> "Signal":
        """From a HANG row: its ``hang_id`` is when the hang was detected."""
        plan = recovery_plan_of(dict(row))
        return cls(int(row["hang_id"]), row["kind"], _count_ranks(row["missing_ranks"]),
                   _count_ranks(row["stuck_ranks"]), _count_hosts(row["suspect_hosts"]),
                   recovery_sentence(plan) if plan else "")

    @classmethod
    def from_alert(cls, row: Mapping[str, Any]) -> "Signal | None":
        """From an ALERT row of rule ``hang`` or ``node_loss``; None for other rules (not faults that stop a job)."""
        if row["rule"] not in ("hang", "node_loss"):
            return None
        try:
            d = json.loads(row["details_json"] or "{}")
        except ValueError:
            d = {}
        if not isinstance(d, dict):
            d = {}
        kind = d.get("kind") or ("node_loss" if row["rule"] == "node_loss" else "hang")
        plan = d.get("recovery_plan")
        plan = plan if isinstance(plan, dict) and plan.get("action") else None
        return cls(int(row["ts_ns"]), kind, _count_ranks(d.get("missing_ranks", "")),
                   _count_ranks(d.get("stuck_ranks", "")), _count_hosts(str(d.get("suspect_hosts", ""))),
                   recovery_sentence(plan) if plan else "")

    def names_culprit(self, n_gpus: int) -> bool:
        if self.kind == "node_loss":
            return self.n_hosts > 0 or self.n_missing > 0
        if self.n_missing > 0:
            return True
        return self.kind == "noncomm_hang" and self.n_stuck > 0 and (n_gpus <= 0 or self.n_stuck < n_gpus)


@dataclasses.dataclass
class _Save:
    attempt: int
    ts_ns: int
    duration_ns: int
    ranks: set = dataclasses.field(default_factory=set)
    rank0: bool = False

    @property
    def end_ns(self) -> int:
        return self.ts_ns + self.duration_ns


@dataclasses.dataclass
class _Attempt:
    attempt: int
    reg_ns: int = -1
    first_seen_ns: int = -1
    n_gpus: int = 0
    team: str = ""
    model: str = ""
    obs: dict = dataclasses.field(default_factory=dict)  # completed step -> completion ns (max over ranks)
    loads: dict = dataclasses.field(default_factory=dict)  # loaded step -> start ns
    signals: list = dataclasses.field(default_factory=list)
    _cache: tuple | None = None

    def __getstate__(self) -> dict:
        """Pickled without the cache of ``progress`` (numpy arrays, rebuilt on demand): state is plain data."""
        return {**self.__dict__, "_cache": None}

    def seen(self, ns: int) -> None:
        if ns >= 0 and (self.first_seen_ns < 0 or ns < self.first_seen_ns):
            self.first_seen_ns = ns

    @property
    def start_ns(self) -> int:
        return self.reg_ns if self.reg_ns >= 0 else self.first_seen_ns

    def completed(self, step: int, ns: int) -> None:
        """Step ``step`` was completed at ``ns`` by some rank: the latest report per step is kept."""
        if ns > self.obs.get(step, -1):
            self.obs[step] = ns
            self._cache = None

    def forget(self, steps: Iterable[int]) -> None:
        """Drop old progress (pruning)."""
        for s in steps:
            del self.obs[s]
        self._cache = None

    def progress(self) -> tuple[np.ndarray, np.ndarray]:
        """Completed steps, ascending, and their completion times (made monotone: no step ends before its
        predecessor)."""
        if self._cache is None:
            steps = np.fromiter(self.obs.keys(), np.int64, len(self.obs))
            ns = np.fromiter(self.obs.values(), np.int64, len(self.obs))
            order = np.argsort(steps)
            self._cache = (steps[order], np.maximum.accumulate(ns[order]) if len(ns) else ns)
        return self._cache


@dataclasses.dataclass
class _Job:
    job_id: str
    attempts: dict = dataclasses.field(default_factory=dict)
    saves: dict = dataclasses.field(default_factory=dict)  # (attempt, step) -> _Save
    n_gpus: dict = dataclasses.field(default_factory=dict)  # attempt -> GPUs (kept when attempts are pruned)
    from_start: bool = False  # attempt 0 registered: there was no checkpoint before it
    frontier_ns: int = -1  # incidents closed up to here are emitted; older evidence is late
    min_attempt: int = -1  # attempts below were pruned with their emitted incidents
    last_ns: int = -1  # latest record of the job

    def touch(self, ns: int) -> None:
        self.last_ns = max(self.last_ns, ns)

    def attempt(self, a: int) -> _Attempt:
        st = self.attempts.get(a)
        if st is None:
            st = self.attempts[a] = _Attempt(a)
        return st


@dataclasses.dataclass
class _Incident:
    att: _Attempt
    kind: str
    first_ns: int  # first evidence: detection, alert or restart
    fault_step: int
    fault_ns: int
    signals: list = dataclasses.field(default_factory=list)
    resume_obs: tuple | None = None  # (step, ns): the stuck attempt progressed again
    restart: _Attempt | None = None
    closer: _Attempt | None = None  # the first later attempt that completed a step
    merged: int = 0  # later attempts that never completed a step

    @property
    def close_ns(self) -> int | None:
        if self.resume_obs is not None:
            return int(self.resume_obs[1])
        if self.closer is not None:
            return int(self.closer.progress()[1][0])
        return None


@dataclasses.dataclass
class AccountantStats:
    records: int = 0
    bad_records: int = 0
    late_records: int = 0
    incidents: int = 0


# --------------------------------------------------------------------------
# The reducer
# --------------------------------------------------------------------------
class DowntimeAccountant:
    """Downtime per fault incident, streaming. Feed tables with ``add``; ``emit(now_ns)``; ``finish()``."""

    def __init__(self, lateness_s: float = 300.0, step_window_s: float = 3600.0, keep_s: float = 86400.0):
        self.lateness_ns = int(lateness_s * _NS)
        self.step_window_ns = int(step_window_s * _NS)
        self.keep_ns = int(keep_s * _NS)
        self.jobs: dict[str, _Job] = {}
        self.max_ts_ns = -1
        self.stats = AccountantStats()

    # -- state for a shard to save -------------------------------------------------
    def state(self) -> dict:
        """Plain data (numbers, strings, lists, dicts) to resume from; the settings are the restorer's."""
        def attempt(a: _Attempt) -> dict:
            return {"attempt": a.attempt, "reg_ns": a.reg_ns, "first_seen_ns": a.first_seen_ns, "n_gpus": a.n_gpus,
                    "team": a.team, "model": a.model, "obs": list(a.obs.items()), "loads": list(a.loads.items()),
                    "signals": [dataclasses.asdict(sig) for sig in a.signals]}

        def job(j: _Job) -> dict:
            return {"job_id": j.job_id, "attempts": [attempt(a) for a in j.attempts.values()],
                    "saves": [[a, step, sv.attempt, sv.ts_ns, sv.duration_ns, sorted(sv.ranks), sv.rank0]
                              for (a, step), sv in j.saves.items()],
                    "n_gpus": list(j.n_gpus.items()), "from_start": j.from_start, "frontier_ns": j.frontier_ns,
                    "min_attempt": j.min_attempt, "last_ns": j.last_ns}
        return {"jobs": [job(j) for j in self.jobs.values()], "max_ts_ns": self.max_ts_ns,
                "stats": dataclasses.asdict(self.stats)}

    def restore(self, state: dict) -> None:
        """Take back what ``state`` returned (this accountant's settings stay)."""
        def attempt(d: dict) -> _Attempt:
            return _Attempt(d["attempt"], d["reg_ns"], d["first_seen_ns"], d["n_gpus"], d["team"], d["model"],
                            {int(k): int(v) for k, v in d["obs"]}, {int(k): int(v) for k, v in d["loads"]},
                            [Signal(**sig) for sig in d["signals"]])

        def job(d: dict) -> _Job:
            return _Job(d["job_id"], {a.attempt: a for a in map(attempt, d["attempts"])},
                        {(a, step): _Save(sa, ts, dur, set(ranks), rank0)
                         for a, step, sa, ts, dur, ranks, rank0 in d["saves"]},
                        {int(a): n for a, n in d["n_gpus"]}, d["from_start"], d["frontier_ns"], d["min_attempt"],
                        d["last_ns"])
        self.jobs = {j.job_id: j for j in map(job, state["jobs"])}
        self.max_ts_ns = int(state["max_ts_ns"])
        self.stats = AccountantStats(**state["stats"])

    # -- input --------------------------------------------------------------
    def add(self, table: pa.Table, kind: str | None = None) -> None:
        """Any of JOB, CHECKPOINT, HEARTBEAT, HANG or ALERT (kind from the schema metadata)."""
        kind = kind or S.kind_of(table.schema)
        handler = {"job": self.add_registrations, "checkpoint": self.add_checkpoints,
                   "heartbeat": self.add_heartbeats, "hang": self.add_hangs, "alert": self.add_alerts}.get(kind)
        if handler is None:
            raise ValueError(f"the downtime accountant does not read {kind!r} records")
        handler(table)

    def _job(self, job_id: str, attempt: int, n_records: int = 1) -> _Job | None:
        """The job's state; None (and ``n_records`` counted late) for an attempt already settled."""
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = _Job(job_id)
        if attempt < job.min_attempt:
            self.stats.late_records += n_records
            return None
        return job

    def _ts(self, ns: int, job: _Job | None = None) -> None:
        self.max_ts_ns = max(self.max_ts_ns, ns)
        if job is not None:
            job.touch(ns)

    def add_registrations(self, table: pa.Table) -> None:
        for r in table.to_pylist():
            self.stats.records += 1
            job = self._job(r["job_id"], r["attempt"])
            if job is None:
                continue
            st = job.attempt(r["attempt"])
            if st.reg_ns < 0 or r["ts_ns"] < st.reg_ns:
                st.reg_ns = r["ts_ns"]
            st.seen(r["ts_ns"])
            st.n_gpus = int(r.get("n_gpus") or 0) or st.n_gpus
            job.n_gpus[r["attempt"]] = st.n_gpus
            st.team, st.model = r.get("team") or st.team, r.get("model") or st.model
            job.from_start |= r["attempt"] == 0
            self._ts(r["ts_ns"], job)

    def add_checkpoints(self, table: pa.Table) -> None:
        good, bad, _ = codec.validate_checkpoints(table)
        self.stats.bad_records += bad.num_rows if bad is not None else 0
        for r in good.to_pylist():
            self.stats.records += 1
            job = self._job(r["job_id"], r["attempt"])
            if job is None:
                continue
            st = job.attempt(r["attempt"])
            st.seen(r["ts_ns"])
            self._ts(r["ts_ns"] + r["duration_ns"], job)
            if r["kind"] == "load":
                st.loads[r["step"]] = min(st.loads.get(r["step"], r["ts_ns"]), r["ts_ns"])
                continue
            sv = job.saves.get((r["attempt"], r["step"]))
            if sv is None:
                sv = job.saves[(r["attempt"], r["step"])] = _Save(r["attempt"], r["ts_ns"], r["duration_ns"])
            end = max(sv.end_ns, r["ts_ns"] + r["duration_ns"])
            sv.ts_ns = min(sv.ts_ns, r["ts_ns"])
            sv.duration_ns = end - sv.ts_ns
            sv.ranks.add(r["rank"])
            sv.rank0 |= r["rank"] == 0

    def add_heartbeats(self, table: pa.Table) -> None:
        """Progress: per (job, attempt, completed step) the latest completion any rank reported."""
        n = table.num_rows
        if n == 0:
            return
        self.stats.records += n
        names = table.column_names
        if "step_done" in names:
            done, done_ns = table["step_done"], table["step_done_ns"]
        else:
            done, done_ns = pa.nulls(n, pa.int64()), pa.nulls(n, pa.int64())
        # Records from before step_done existed: when the last op finished is the optimizer, the step
        # before the one started ended with it (approximate: off by one if sent between two steps).
        legacy = pc.and_(pc.fill_null(pc.less(done, 0), True), pc.equal(table["last_op"], "optimizer"))
        done = pc.if_else(legacy, pc.subtract(table["step"], 1), pc.fill_null(done, -1))
        done_ns = pc.if_else(legacy, table["last_op_end_ns"], pc.fill_null(done_ns, -1))
        t = pa.table({"job_id": table["job_id"], "attempt": table["attempt"], "ts": table["ts_ns"],
                      "done": done, "done_ns": done_ns})
        self._ts(pc.max(t["ts"]).as_py())
        agg = t.group_by(["job_id", "attempt"]).aggregate([("ts", "min"), ("ts", "max"), ("ts", "count")])
        for r in agg.to_pylist():
            job = self._job(r["job_id"], r["attempt"], r["ts_count"])
            if job is not None:
                job.attempt(r["attempt"]).seen(r["ts_min"])
                job.touch(r["ts_max"])
        t = t.filter(pc.and_(pc.greater_equal(t["done"], 0), pc.greater_equal(t["done_ns"], 0)))
        agg = t.group_by(["job_id", "attempt", "done"]).aggregate([("done_ns", "max")])
        jobs, atts = agg["job_id"].to_pylist(), agg["attempt"].to_pylist()
        steps, ns = agg["done"].to_pylist(), agg["done_ns_max"].to_pylist()
        last = None
        for j, a, s, x in zip(jobs, atts, steps, ns):
            if (j, a) != last:
                last = (j, a)
                job = self.jobs[j]
                st = job.attempt(a) if a >= job.min_attempt else None
            if st is not None:
                st.completed(s, x)

    def add_hangs(self, table: pa.Table) -> None:
        for r in table.to_pylist():
            self.stats.records += 1
            self.add_signal(r["job_id"], r["attempt"], Signal.from_hang(r))

    def add_alerts(self, table: pa.Table) -> None:
        """Hang and node-loss alerts; other rules (slowdown, link, fidelity) are not faults that stop a job."""
        for r in table.to_pylist():
            self.stats.records += 1
            sig = Signal.from_alert(r)
            if sig is not None:
                self.add_signal(r["job_id"], r["attempt"], sig)

    def add_signal(self, job_id: str, attempt: int, sig: Signal) -> None:
        """One piece of fault evidence about an attempt (``add_hangs`` and ``add_alerts`` build them from rows)."""
        job = self._job(job_id, attempt)
        if job is None:
            return
        if sig.ns <= job.frontier_ns:
            self.stats.late_records += 1
            return
        st = job.attempt(attempt)
        st.signals.append(sig)
        st.seen(sig.ns)
        self._ts(sig.ns, job)

    # -- output -------------------------------------------------------------
    def emit(self, now_ns: int) -> list[dict]:
        """DOWNTIME rows of incidents closed at or before ``now_ns - lateness``, each once, in time order.

        A job silent for ``keep_s`` is forgotten; an incident of it still open
        is emitted first, clipped at the job's last record (``closed`` false).
        """
        rows = []
        for job in list(self.jobs.values()):
            if 0 <= job.last_ns < now_ns - self.keep_ns:
                rows += [self._row(job, inc, None if inc.close_ns is not None else job.last_ns)
                         for inc in _derive(job)]
                del self.jobs[job.job_id]
                continue
            if len(job.attempts) < 2 and not any(a.signals for a in job.attempts.values()):
                self._prune(job, now_ns)
                continue
            while True:  # settling one incident removes it from the next derivation
                incidents = _derive(job)
                close = incidents[0].close_ns if incidents else None
                if close is None or close + self.lateness_ns > now_ns:
                    break
                rows.append(self._row(job, incidents[0], None))
                self._settle(job, incidents[0], close)
            self._prune(job, now_ns)
        self.stats.incidents += len(rows)
        return rows

    def finish(self, end_ns: int | None = None) -> list[dict]:
        """Ends the stream: rows of every incident not emitted yet; open ones clipped at ``end_ns``
        (default: the latest record time seen). The accountant is empty afterwards."""
        end = self.max_ts_ns if end_ns is None else int(end_ns)
        rows = []
        for job in self.jobs.values():
            for inc in _derive(job):
                rows.append(self._row(job, inc, None if inc.close_ns is not None else end))
        self.jobs.clear()
        self.stats.incidents += len(rows)
        return rows

    def _settle(self, job: _Job, inc: _Incident, close: int) -> None:
        """Forget what the emitted incident used: older attempts and evidence before its close."""
        job.frontier_ns = max(job.frontier_ns, close)
        if inc.closer is not None:
            job.min_attempt = inc.closer.attempt
            for a in [a for a in job.attempts if a < inc.closer.attempt]:
                del job.attempts[a]
        for st in job.attempts.values():
            st.signals = [s for s in st.signals if s.ns > close]

    def _prune(self, job: _Job, now_ns: int) -> None:
        horizon = now_ns - self.keep_ns
        for st in job.attempts.values():
            if len(st.obs) > 64:
                top = max(st.obs)
                old = [s for s, x in st.obs.items() if x < horizon and s != top]
                if old:
                    st.forget(old)
        old = [k for k, sv in job.saves.items() if sv.end_ns < horizon]
        complete = [k for k in old if self._complete(job, k)]
        keep = max(complete, key=lambda k: k[1]) if complete else None
        for k in old:
            if k != keep:
                del job.saves[k]

    # -- one row ------------------------------------------------------------
    @staticmethod
    def _complete(job: _Job, key: tuple[int, int]) -> bool:
        sv, n = job.saves[key], job.n_gpus.get(key[0], 0)
        return sv.rank0 or (n > 0 and len(sv.ranks) >= n)

    def _last_checkpoint(self, job: _Job, att: _Attempt, fault_step: int) -> int | None:
        """The last complete save at or before ``fault_step`` of this attempt or an earlier one."""
        best = None
        for (a, step) in job.saves:
            if a <= att.attempt and step <= fault_step and (best is None or step > best):
                if self._complete(job, (a, step)):
                    best = step
        if best is None and job.from_start:
            return -1
        return best

    def _stall_ns(self, job: _Job, att: _Attempt, lo_step: int, hi_step: int) -> int:
        """Checkpoint save stalls of the attempt between the end of ``lo_step`` and that of ``hi_step``."""
        return sum(sv.duration_ns for (a, s), sv in job.saves.items() if a == att.attempt and lo_step <= s < hi_step)

    def _step_time_s(self, job: _Job, att: _Attempt, from_step: int, fault_step: int, fault_ns: int) -> float:
        """Mean step time of the attempt from ``from_step`` to ``fault_step``, pauses left out.

        Between consecutive progress reports: elapsed time minus the checkpoint
        saves in between, over the steps made. Intervals slower than twice the
        median (a hang that cleared, an evaluation) are left out.
        """
        steps, ns = att.progress()
        upto = np.searchsorted(steps, fault_step, side="right")
        steps, ns = steps[:upto], ns[:upto]
        if len(steps) < 2:
            return float("nan")
        i = int(np.searchsorted(steps, max(from_step, 0)))
        if i >= len(steps) - 1:  # a single step since the checkpoint: widen to the window before the fault
            i = int(np.searchsorted(ns, fault_ns - self.step_window_ns))
            i = min(i, len(steps) - 2)
        steps, ns = steps[i:], ns[i:]
        busy = np.diff(ns).astype(np.float64)
        made = np.diff(steps).astype(np.float64)
        saves = [(s, sv.duration_ns) for (a, s), sv in job.saves.items() if a == att.attempt]
        if saves:
            sst = np.array([s for s, _ in saves], np.int64)
            idx = np.searchsorted(steps, sst, side="right") - 1  # the interval a save after step s falls in
            ok = (idx >= 0) & (idx < len(busy))
            np.add.at(busy, idx[ok], -np.array([d for _, d in saves], np.float64)[ok])
        rate = busy / made
        keep = (rate > 0) & (rate <= 2 * np.median(rate))
        return float(busy[keep].sum() / made[keep].sum() / _NS) if keep.any() else float("nan")

    def _resume(self, job: _Job, inc: _Incident, resume_step: int | None, T: float,
                notes: list[str]) -> tuple[int, int]:
        """(resume, end of the first useful step) of a closed incident: the first step the job completed
        again (``runner``), moved back by the steps it redid at the pre-fault step time ``T``."""
        runner = inc.att if inc.resume_obs is not None else inc.closer
        steps, ns = runner.progress()
        i = int(np.searchsorted(steps, inc.resume_obs[0])) if inc.resume_obs is not None else 0
        s_o, n_o = int(steps[i]), int(ns[i])
        if resume_step is None:
            resume_step = s_o - 1
            notes.append(f"resume step taken from attempt {runner.attempt}'s first completed step")
        if not math.isfinite(T):
            return n_o, n_o
        k = max(0, s_o - resume_step)
        start = n_o - int(round(k * T * _NS)) - self._stall_ns(job, runner, resume_step + 1, s_o)
        return start, start + int(round(T * _NS))

    def _row(self, job: _Job, inc: _Incident, end_ns: int | None) -> dict:
        att, notes = inc.att, []
        n_gpus = att.n_gpus
        if n_gpus <= 0:
            notes.append("n_gpus unknown: no registration of the attempt")
        t0 = inc.fault_ns
        sv = job.saves.get((att.attempt, inc.fault_step))
        if sv is not None and sv.end_ns <= inc.first_ns:
            t0 = max(t0, sv.end_ns)
        alert = min((s.ns for s in inc.signals), default=-1)
        named = [s.ns for s in inc.signals if s.names_culprit(n_gpus)]
        # The latest plan: a loss found again (more ranks gone) is planned again for the nodes left then.
        plans = [s.recovery for s in sorted(inc.signals, key=lambda s: s.ns) if s.recovery]
        diagnosed = max(alert, min(named)) if named else -1
        restart = inc.restart.start_ns if inc.restart is not None else -1
        if inc.merged:
            notes.append(f"{inc.merged} later attempt(s) never completed a step: their time is re-initialisation")

        ckpt = self._last_checkpoint(job, att, inc.fault_step)
        resume_step = ckpt
        if inc.resume_obs is not None:
            resume_step = inc.fault_step
        elif inc.closer is not None and inc.closer.loads:
            resume_step = min(inc.closer.loads)
            ckpt = resume_step
        if inc.resume_obs is None and resume_step is None:
            notes.append("no checkpoint seen: lost progress unknown")
        lost_steps = max(0, inc.fault_step - ckpt) if inc.resume_obs is None and ckpt is not None else 0
        T = self._step_time_s(job, att, ckpt if ckpt is not None else inc.fault_step, inc.fault_step, inc.fault_ns)
        if not math.isfinite(T):
            notes.append("step time unknown: lost progress 0, resume at the first completed step")
        lost_s = lost_steps * T if math.isfinite(T) else 0.0

        if end_ns is None:
            end, first_step_ns = self._resume(job, inc, resume_step, T, notes)
        else:
            end, first_step_ns = end_ns, -1
            notes.append("open: the stream ended before the job ran again")
        detect, diagnose, isolate, reinit = _durations([t0, alert, diagnosed, restart], end)
        total = detect + diagnose + isolate + reinit + lost_s
        gh = n_gpus / 3600.0
        return dict(
            job_id=job.job_id, attempt=att.attempt, incident_id=inc.first_ns, kind=inc.kind, team=att.team,
            model=att.model, fault_start_ns=t0, alert_ns=alert, diagnosed_ns=diagnosed, restart_ns=restart,
            restart_attempt=inc.closer.attempt if inc.closer is not None else -1, first_step_ns=first_step_ns,
            fault_step=inc.fault_step, last_checkpoint_step=ckpt if ckpt is not None else -1, lost_steps=lost_steps,
            step_time_s=T, n_gpus=n_gpus, detect_s=detect, diagnose_s=diagnose, isolate_s=isolate,
            lost_progress_s=lost_s, reinit_s=reinit, total_s=total, detect_gpu_hours=detect * gh,
            diagnose_gpu_hours=diagnose * gh, isolate_gpu_hours=isolate * gh, lost_progress_gpu_hours=lost_s * gh,
            reinit_gpu_hours=reinit * gh, total_gpu_hours=total * gh, closed=end_ns is None, note="; ".join(notes),
            recovery_plan=plans[-1] if plans else "",
        )


def _durations(stamps: list[int], end: int) -> list[float]:
    """Seconds from each present stamp (>= 0) to the next present one, the last to ``end``; 0 for an absent one.

    Stamps are clamped into order (none before the one before it, none after the end), so a
    missing stamp gives its time to the category before it.
    """
    t0 = stamps[0]
    present = [i for i, v in enumerate(stamps) if v >= 0]
    clamped, prev = list(stamps), t0
    for i in present:
        clamped[i] = prev = min(max(stamps[i], prev), max(end, t0))
    end = max(end, prev)
    dur = [0.0] * len(stamps)
    for j, i in enumerate(present):
        nxt = clamped[present[j + 1]] if j + 1 < len(present) else end
        dur[i] = (nxt - clamped[i]) / _NS
    return dur


def _derive(job: _Job) -> list[_Incident]:
    """The incidents of one job from its state, in time order (a pure function of the state)."""
    atts = [job.attempts[a] for a in sorted(job.attempts)]
    out: list[_Incident] = []
    for idx, att in enumerate(atts):
        steps, ns = att.progress()
        if idx > 0 and not len(steps):
            continue  # a re-init that never completed a step: part of the incident before it
        later = atts[idx + 1:]
        restart = later[0] if later else None
        restart_ns = restart.start_ns if restart is not None else None
        closer = next((b for b in later if b.obs), None)
        cur: _Incident | None = None
        for sig in sorted(att.signals, key=lambda s: s.ns):
            if not len(steps) or sig.ns < ns[0] or sig.ns <= job.frontier_ns:
                continue  # before the attempt's first step: still re-initialising
            if restart_ns is not None and 0 <= restart_ns <= sig.ns:
                continue  # about an attempt already replaced
            if cur is not None and (cur.resume_obs is None or sig.ns <= cur.resume_obs[1]):
                cur.signals.append(sig)
                cur.kind = "node_loss" if sig.kind == "node_loss" else cur.kind
                continue
            k = int(np.searchsorted(ns, sig.ns, side="right")) - 1
            cur = _Incident(att, "node_loss" if sig.kind == "node_loss" else "hang", sig.ns, int(steps[k]),
                            int(ns[k]), [sig])
            if k + 1 < len(steps) and (restart_ns is None or restart_ns < 0 or ns[k + 1] < restart_ns):
                cur.resume_obs = (int(steps[k + 1]), int(ns[k + 1]))
            out.append(cur)
        if restart is None:
            continue
        if cur is None or cur.resume_obs is not None:
            if len(steps):
                k = int(np.searchsorted(ns, restart_ns, side="right")) - 1 if restart_ns >= 0 else len(steps) - 1
                k = max(k, 0)
                cur = _Incident(att, "restart", restart_ns, int(steps[k]), int(ns[k]))
            else:
                cur = _Incident(att, "restart", restart_ns, -1, att.start_ns)
            out.append(cur)
        cur.restart, cur.closer = restart, closer
        cur.merged = sum(1 for b in later if closer is None or b.attempt < closer.attempt)
    return out


def to_tables(incidents: Iterable[Mapping[str, Any]]) -> dict[str, pa.Table]:
    """{"downtime": DOWNTIME rows} of accounted incidents (``DowntimeAccountant.emit``, ``account_downtime``)."""
    return {"downtime": codec.from_rows(S.DOWNTIME, incidents)}


def account_downtime(events: Iterable[pa.Table | tuple[str, pa.Table]], end_ns: int | None = None,
                     **params: float) -> list[dict]:
    """Batch form of ``DowntimeAccountant``: every event table (or (kind, table)), then ``finish(end_ns)``."""
    acc = DowntimeAccountant(**params)
    for ev in events:
        if isinstance(ev, tuple):
            acc.add(ev[1], ev[0])
        else:
            acc.add(ev)
    return acc.finish(end_ns)
