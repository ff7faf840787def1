"""Regressions against a job's own past, inside a shard: ``analyzers.regression`` as a reducer.

Each analysed window's profile (WINDOW_PROFILE rows: the job's step time,
its op types' and its workers' time per step) becomes one ``WindowPoint`` of
the job's detector; the detector's events (a regression, a return to the
baseline, a worker over its own best) are emitted as REGRESSION rows, which
the alert rules page on (``ray_jobs.alerts``; a recovery is stored, not
alerted). One detector per job, across its attempts: a restarted job that
comes back slower is a regression too.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math

import pyarrow as pa

from analyzers.regression import RegressionDetector, RegressionParams, WindowPoint
from core.control import layered
from core import codec
from core import schema as S
from ray_jobs.checkpoint import Clock, Unit

MAX_JOBS = 50_000
"""Detectors kept per shard; the job heard from least recently goes first (its history is rebuilt)."""


def params_of(cfg) -> RegressionParams:
    """The detector's parameters: the ``[regression]`` section's (``RegressionParams`` extends
    ``core.config.RegressionConfig``), and the detector's own defaults for what is not configured."""
    return RegressionParams(**dataclasses.asdict(cfg))


def points_of(table: pa.Table) -> list[tuple[str, int, WindowPoint]]:
    """(job, attempt, point) per window of a WINDOW_PROFILE table, in window order."""
    by_window: dict[tuple[str, int, int], dict] = {}
    for r in table.to_pylist():
        w = by_window.setdefault((r["job_id"], r["attempt"], r["window_id"]),
                                 dict(first_step=r["first_step"], end_ns=r["end_ns"], step=math.nan, optypes={},
                                      workers={}))
        if r["dp_rank"] < 0:
            if r["optype"] == "step":
                w["step"] = r["seconds"]
            else:
                w["optypes"][r["optype"]] = r["seconds"]
        else:
            w["workers"][(r["dp_rank"], r["pp_rank"])] = r["seconds"]
    return [(job, attempt, WindowPoint(window, w["first_step"], w["end_ns"], w["step"], w["optypes"], w["workers"]))
            for (job, attempt, window), w in sorted(by_window.items(), key=lambda kv: (kv[0], kv[1]["end_ns"]))]


class RegressionReducer:
    consumes = frozenset({"window_profile"})

    def __init__(self, clock: Clock, params: RegressionParams = RegressionParams()):
        self.clock = clock
        self.params = params
        # Run-time changes (core.control): the configured thresholds, and each job's overrides over the fleet's.
        self.base_params = params
        self.job_params: dict[str, RegressionParams] = {}
        self.detectors: collections.OrderedDict[str, RegressionDetector] = collections.OrderedDict()
        self._rows: list[dict] = []
        self.found = collections.Counter()  # stored events by kind

    def params_for(self, job_id: str) -> RegressionParams:
        """The thresholds ``job_id`` is judged by: its own run-time change, else the fleet's, else the configured."""
        return self.job_params.get(job_id, self.params)

    def set_overrides(self, fleet: dict, jobs: dict[str, dict]) -> None:
        """Thresholds changed at run time (``core.control.regression_overrides``): ``fleet`` for every job,
        ``jobs`` per job over the fleet's. Replaces the previous overrides whole, so a change that ended
        restores the configured value. The detectors keep their history (baseline, CUSUM): the new thresholds
        judge the windows that come next, so a change takes effect at once instead of after a new baseline."""
        self.params, self.job_params = layered(self.base_params, fleet, jobs)
        for job, det in self.detectors.items():
            det.params = self.params_for(job)

    def add(self, kind: str, table: pa.Table, at=None, now: float = 0.0) -> None:
        for job, attempt, point in points_of(table):
            det = self.detectors.pop(job, None) or RegressionDetector(self.params_for(job))
            self.detectors[job] = det  # most recent last
            if len(self.detectors) > MAX_JOBS:
                self.detectors.popitem(last=False)
            found_ns = self.clock.wall_ns()
            for ev in det.add(point):
                self._rows.append(dict(
                    job_id=job, kind=ev.kind, attempt=attempt, window_id=ev.window_id,
                    began_window=ev.began_window, began_step=ev.began_step, change=ev.change,
                    before_s=ev.before_s, after_s=ev.after_s,
                    optypes_json=json.dumps({k: round(v, 4) for k, v in ev.optypes.items()}),
                    scope=ev.scope, summary=f"{job}: {ev.summary}", found_ns=found_ns))

    def due(self, now: float) -> list[Unit]:
        if not self._rows:
            return []
        rows, self._rows = self._rows, []

        def stored():
            self.found.update(r["kind"] for r in rows)
        return [Unit(f"{len(rows)} regression event(s)", {"regression": codec.from_rows(S.REGRESSION, rows)},
                     on_stored=stored)]

    def state(self) -> dict:
        """What a restarted shard resumes from (``ray_jobs.state``): each job's detector as plain data."""
        return {job: det.state() for job, det in self.detectors.items()}

    def restore(self, state: dict) -> None:
        for job, st in state.items():
            det = RegressionDetector(self.params_for(job))
            det.restore(st)
            self.detectors[job] = det

    def snapshot(self) -> dict:
        return dict(regression_jobs=len(self.detectors), regressions=self.found["regression"],
                    recoveries=self.found["recovered"], degraded_workers=self.found["degraded_worker"])
