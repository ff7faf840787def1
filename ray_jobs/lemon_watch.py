"""Lemon hosts across the fleet: the one analysis that needs every job at once, so the driver runs it.

A shard owns some jobs; a lemon is a host that several jobs implicate, so the
scoring reads the store, not the stream. Every ``lemons.every_s`` the driver
(``stragglerscope run``) calls ``LemonWatch.score``: it gathers each
implication of a host over the last ``lemons.period_days`` (the slowest worker
of a window whose main verdict is a slow worker, a hang's or a node loss's
suspect hosts, a worker over its own best, a port of the host with errors or
link downs in a job: ``analyzers.fabric.port_incidents``), mapped to machines by
the ranks' heartbeats (RANK_HOST) and the rank that reported each worker's spans
(WINDOW_PROFILE), weighs each host by the GPU-hours it ran in any job
(``analyzers.lemons``), stores the pass (LEMON_HOST rows) and raises one
``lemon_host`` alert per host that became a lemon since the pass before,
through the driver's alerts (``ray_jobs.alerts.DriverAlerts``: the alert
table, then the alert topic and webhook every other alert goes to).
A failing pass is logged and tried again; it never stops the pipeline.
Before each pass the watch reads the control topic (``core.control``): the
fleet's lemons_min_jobs and lemons_max_p in force judge that pass.
"""
from __future__ import annotations

import csv
import dataclasses
import logging
import re
import time
from collections import defaultdict

from analyzers.fabric import port_incidents
from analyzers.lemons import Incident, LemonParams, lemon_hosts
from core import codec, jsonutil
from core import schema as S

log = logging.getLogger(__name__)

_WORKER = re.compile(r"dp(\d+)/pp(\d+)")


def read_topology(path: str) -> dict[str, str]:
    """``host,label`` lines (a rack or switch per host; '#' comments): what groups hosts in the console."""
    if not path:
        return {}
    out = {}
    with open(path, newline="") as f:
        for row in csv.reader(line for line in f if line.strip() and not line.lstrip().startswith("#")):
            if len(row) >= 2:
                out[row[0].strip()] = row[1].strip()
    return out


@dataclasses.dataclass
class LemonWatch:
    """One scoring pass at a time over a store (``run_named``/``insert``); see the module docstring."""

    store: object
    params: LemonParams = LemonParams()
    period_s: float = 7 * 86400.0
    labels: dict = dataclasses.field(default_factory=dict)
    lemons: set = dataclasses.field(default_factory=set)  # hosts that were lemons in the last pass
    alerts: object = None  # ray_jobs.alerts.DriverAlerts; default: stored only, published nowhere (tests)
    controls: object = None
    """The control topic (``core.control_topic.ControlReader``, or anything with ``poll(timeout_ms)`` returning
    records), read before each pass; None: the configured thresholds always."""

    def __post_init__(self) -> None:
        if self.alerts is None:
            from core.config import AlertConfig
            from ray_jobs.alerts import AlertOutlet, DriverAlerts

            self.alerts = DriverAlerts(AlertConfig(), self.store, AlertOutlet(None))
        from core.control import ControlBook

        self.base_params = self.params  # the configured [lemons]; params: what the next pass scores by
        self.book = ControlBook()
        self._control_seen = 0

    def take_controls(self, now_ns: int) -> None:
        """The run-time changes published since the last pass (``core.control``), and the fleet's lemon thresholds
        in force handed to the next pass: what no change in force names is the configured value again. Lemon
        hosts are scored across every job at once, so only fleet changes set them (``check`` refuses a job's).
        The fleet's alert cool-down applies to the lemon alerts too, as it does to the shards' alerts."""
        if self.controls is None:
            return
        from core.control import alert_overrides, lemon_overrides

        refused = len(self.book.refused)
        # The pass runs every lemons.every_s: read what has come since, not only what one poll returns, so that
        # a change is applied to the next pass rather than one later. Bounded: the topic is small and slow.
        for _ in range(100):
            got = self.controls.poll(1000)
            if not got:
                break
            for record in got:
                self.book.add(record)
        for line in self.book.refused[refused:]:
            log.warning("lemon watch: control record refused: %s", line)
        settings = self.book.settings(now_ns, None)
        params = dataclasses.replace(self.base_params, **lemon_overrides(settings))
        if params != self.params:
            log.info("lemon watch: thresholds min_jobs %d, max_p %g (%s)", params.min_jobs, params.max_p,
                     "changed at run time" if params != self.base_params else "as configured")
        self.params = params
        # Only the cool-down is the driver's: lemon alerts use no other alert threshold (the link pair's order
        # is the shards' to keep).
        cooldown = {k: v for k, v in alert_overrides(settings).items() if k == "cooldown_s"}
        self.alerts.rules.set_overrides(cooldown, {})

    def _rows(self, name: str, since: int, until: int) -> list[dict]:
        return self.store.run_named(name, {"since": since, "until": until}).to_pylist()

    def incidents(self, since: int, until: int) -> tuple[list[Incident], dict[str, float]]:
        """Every implication of a host in [since, until), and each host's GPU-hours in that period."""
        hosts = defaultdict(set)  # (job, attempt, rank) -> hosts
        per_job_host = defaultdict(lambda: defaultdict(int))  # (job, attempt) -> host -> ranks
        for r in self._rows("lemon_rank_hosts", since, until):
            hosts[(r["job_id"], r["attempt"], r["rank"])].add(r["host"])
            per_job_host[(r["job_id"], r["attempt"])][r["host"]] += 1
        exposure: dict[str, float] = defaultdict(float)
        for r in self._rows("lemon_job_hours", since, until):
            on = per_job_host.get((r["job_id"], r["attempt"]))
            if on:
                ranks = sum(on.values())
                for host, n in on.items():
                    exposure[host] += r["gpu_hours"] * n / ranks
        rank_of = {(r["job_id"], r["attempt"], r["dp_rank"], r["pp_rank"]): r["worker_rank"]
                   for r in self._rows("lemon_worker_ranks", since, until)}

        def worker_hosts(job, attempt, dp, pp):
            rank = rank_of.get((job, attempt, dp, pp))
            return hosts.get((job, attempt, rank), ()) if rank is not None else ()

        out = []
        for r in self._rows("lemon_slow_workers", since, until):
            for host in worker_hosts(r["job_id"], r["attempt"], r["top_dp"], r["top_pp"]):
                out.append(Incident(host, r["job_id"], r["attempt"], r["at_ns"], "worker",
                                    f"window {r['window_id']}: worker dp{r['top_dp']}/pp{r['top_pp']} "
                                    f"S_w {r['top_s_w']:.2f}"))
        for r in self._rows("lemon_hangs", since, until):
            for host in filter(None, r["suspect_hosts"].split(",")):
                out.append(Incident(host, r["job_id"], r["attempt"], r["hang_id"], r["kind"],
                                    f"{r['kind'].replace('_', ' ')} for {r['duration_s']:.0f} s"))
        for r in self._rows("lemon_degraded_workers", since, until):
            m = _WORKER.fullmatch(r["scope"])
            if m:
                for host in worker_hosts(r["job_id"], r["attempt"], int(m[1]), int(m[2])):
                    out.append(Incident(host, r["job_id"], r["attempt"], r["found_ns"], "degraded_worker",
                                        f"window {r['window_id']}: {r['scope']} {r['change']:+.0%} over its "
                                        "own best"))
        # Port errors a host's own ranks reported (PORT_COUNTER): one implication per job attempt and port, so a
        # host whose cable fails under job after job scores as one a job after another finds slow.
        out += port_incidents(self._rows("lemon_port_errors", since, until))
        return out, dict(exposure)

    def score(self, now_ns: int | None = None) -> list:
        """One pass: score, store the pass, alert the new lemons; returns the host scores (lemons first)."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        self.take_controls(now_ns)
        since = now_ns - int(self.period_s * 1e9)
        incidents, exposure = self.incidents(since, now_ns)
        scores = lemon_hosts(incidents, exposure, self.params)
        if not scores:
            return scores
        self.store.insert("lemon_host", codec.from_rows(S.LEMON_HOST, [dict(
            host=s.host, scored_ns=now_ns, period_s=self.period_s, label=self.labels.get(s.host, ""),
            jobs=s.jobs, incidents=s.incidents, gpu_hours=s.gpu_hours, expected_jobs=s.expected_jobs,
            p_value=s.p_value, lemon=s.lemon, evidence_json=jsonutil.dumps(s.evidence)) for s in scores]))
        new = [s for s in scores if s.lemon and s.host not in self.lemons]
        self.lemons = {s.host for s in scores if s.lemon}
        if new:
            self.alerts.lemons(new, self.labels, now_ns)
        return scores


def restore_lemons(store) -> set:
    """The hosts the latest stored pass called lemons, so a restarted driver does not page them again."""
    try:
        return {r["host"] for r in store.run_named("lemon_hosts", {"lemons_only": 1}).to_pylist()}
    except Exception as e:  # an empty or older store: every lemon is news
        log.info("no earlier lemon pass read: %s", e)
        return set()
