"""Alert rules over results, deduplicated per (job, rule) with a cool-down.

``AlertRules.evaluate_window`` turns a window result row into zero or more
alert rows (ALERT schema). State is the last alert time per (job, rule), kept
in the shard that owns the job; ``now`` is injected so tests drive it.
``AlertReducer`` runs the rules over what the other reducers emit (window
results, link faults, hangs, regressions) and publishes each alert once it is stored.
``WebhookSender`` delivers them to an optional webhook off the shard's loop.
``AlertOutlet`` is the one way a stored alert leaves, for the shards and for
the driver's own alerts (lemon hosts, ``DriverAlerts``): the alert topic and
the webhook.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.request
from typing import Callable

import pyarrow as pa

from analyzers.hang import hang_summary, recovery_plan_missing, recovery_plan_of
from core.control import layered
from core import codec, jsonutil
from core import schema as S
from analyzers.explain import analysis_failed_alert, fidelity_alert, lemon_alert, link_alert, slowdown_alert
from analyzers.links.history import found_before
from core.config import AlertConfig
from ray_jobs.checkpoint import Clock, Unit

log = logging.getLogger(__name__)


class AlertRules:
    def __init__(self, cfg: AlertConfig):
        self.cfg = cfg
        self._last: dict[tuple[str, str], float] = {}
        self.suppressed = 0
        # Run-time changes (core.control): the thresholds for every job (the configured ones with the fleet's
        # changes), and per job over the fleet's.
        self.params = cfg
        self.job_params: dict[str, AlertConfig] = {}

    def params_for(self, job_id: str) -> AlertConfig:
        """The thresholds ``job_id``'s alerts are judged by: its own run-time change, else the fleet's, else the
        configured ``[alerts]``. A host's key (``host/NAME``, lemon alerts) is no job: the fleet's."""
        return self.job_params.get(job_id, self.params)

    def link_confidence_for(self, job_id: str) -> float:
        """The confidence at which ``job_id``'s link findings alert (``params_for``)."""
        return self.params_for(job_id).link_confidence

    def set_overrides(self, fleet: dict, jobs: dict[str, dict]) -> None:
        """Alert thresholds changed at run time (``core.control.alert_overrides``): ``fleet`` for every job,
        ``jobs`` per job over the fleet's. Replaces the previous overrides whole, so a change that ended
        restores the configured value; applies to the next decision (a cool-down too: it is measured from the
        rule's last alert, so a shorter one can let the next alert out at once)."""
        self.params, self.job_params = layered(self.cfg, fleet, jobs)

    def _fire(self, job_id: str, rule: str, now: float) -> bool:
        last = self._last.get((job_id, rule))
        if last is not None and now - last < self.params_for(job_id).cooldown_s:
            self.suppressed += 1
            return False
        self._last[(job_id, rule)] = now
        return True

    def evaluate_window(self, row: dict, now: float, now_ns: int) -> list[dict]:
        """Alerts for one window result row (a dict of WINDOW fields)."""
        alerts = []
        job, s = row["job_id"], row["slowdown"]
        p = self.params_for(job)
        base = dict(job_id=job, attempt=row["attempt"], ts_ns=now_ns)
        if s == s and s >= p.slowdown_threshold and row["n_gpus"] >= p.min_gpus:
            if self._fire(job, "slowdown", now):
                sev = "critical" if s >= 1.5 else "warning"
                alerts.append(dict(
                    base, alert_id=f"{job}/{row['attempt']}/slowdown/{row['window_id']}", rule="slowdown",
                    severity=sev, summary=slowdown_alert(row),
                    details_json=jsonutil.dumps({k: row[k] for k in ("window_id", "slowdown", "waste_fraction",
                                                                     "wasted_gpu_hours", "verdict", "m_w", "m_s")
                                                 if row[k] == row[k]}),
                ))
        ls = row["launch_slowdown"]
        if ls == ls and abs(ls - 1.0) > p.fidelity_tolerance and self._fire(job, "fidelity", now):
            alerts.append(dict(
                base, alert_id=f"{job}/{row['attempt']}/fidelity/{row['window_id']}", rule="fidelity",
                severity="info",
                summary=fidelity_alert(row),
                details_json=jsonutil.dumps({"launch_slowdown": ls, "window_id": row["window_id"]}),
            ))
        if row["verdict"] == "analysis_failed" and self._fire(job, "analysis_failed", now):
            alerts.append(dict(
                base, alert_id=f"{job}/{row['attempt']}/analysis_failed/{row['window_id']}",
                rule="analysis_failed", severity="info",
                summary=analysis_failed_alert(row),
                details_json=jsonutil.dumps({"note": row["note"][:2000]}),
            ))
        return alerts


    def evaluate_hang(self, row: dict, now: float, now_ns: int) -> list[dict]:
        """The alert of one HANG row (``ray_jobs.hang_monitor``): critical, cooled down per (job, kind); the end
        of a stall that was reported is an ``info`` alert of its own (``hang_ended``), so the page is closed."""
        rule = {"node_loss": "node_loss", "hang_ended": "hang_ended"}.get(row["kind"], "hang")
        if not self._fire(row["job_id"], rule, now):
            return []
        return [dict(
            alert_id=f"{row['job_id']}/{row['attempt']}/{rule}/{row['hang_id']}", job_id=row["job_id"],
            attempt=row["attempt"], ts_ns=now_ns, rule=rule, severity="info" if rule == "hang_ended" else "critical",
            summary=hang_summary(row),
            details_json=jsonutil.dumps({**{k: row[k] for k in (
                "kind", "group", "seq", "op", "stuck_ranks", "missing_ranks", "suspect_hosts", "duration_s")},
                **({"recovery_plan": plan} if (plan := recovery_plan_of(row)) else {}),
                **({"recovery_plan_missing": why} if row["kind"] == "node_loss" and not plan
                   and (why := recovery_plan_missing(row)) else {})}),
        )]

    def evaluate_lemon(self, score, now: float, now_ns: int, labels: dict | None = None) -> list[dict]:
        """The alert of a host that became a lemon (``analyzers.lemons.HostScore``): critical, cooled down per
        host (a host is no job: its key is ``host/NAME``)."""
        if not self._fire(f"host/{score.host}", "lemon_host", now):
            return []
        last = score.evidence[-1]
        return [dict(
            alert_id=f"host/{score.host}/lemon_host/{now_ns}", job_id=last["job_id"], attempt=last["attempt"],
            ts_ns=now_ns, rule="lemon_host", severity="critical",
            summary=lemon_alert(score, (labels or {}).get(score.host, "")),
            details_json=jsonutil.dumps({"host": score.host, "jobs": score.jobs, "incidents": score.incidents,
                                         "gpu_hours": score.gpu_hours, "expected_jobs": score.expected_jobs,
                                         "p_value": score.p_value}),
        )]

    def evaluate_regression(self, row: dict, now: float, now_ns: int) -> list[dict]:
        """The alert of one REGRESSION row (``ray_jobs.regressions``): a job slower than its own past
        (critical from +30%, else a warning) or a worker over its own best (a warning); a return to the
        baseline is stored, never alerted."""
        if row["kind"] == "recovered":
            return []
        rule = "regression" if row["kind"] == "regression" else "degraded_worker"
        if not self._fire(row["job_id"], rule, now):
            return []
        return [dict(
            alert_id=f"{row['job_id']}/{row['attempt']}/{rule}/{row['window_id']}/{row['scope'][:40]}",
            job_id=row["job_id"], attempt=row["attempt"], ts_ns=now_ns, rule=rule,
            severity="critical" if rule == "regression" and row["change"] >= 0.3 else "warning",
            summary=row["summary"][:1000],
            details_json=jsonutil.dumps({k: row[k] for k in ("kind", "window_id", "began_window", "began_step",
                                                             "change", "before_s", "after_s", "scope")}),
        )]

    def evaluate_links(self, rows: list[dict], now: float, now_ns: int) -> list[dict]:
        """One alert per window for its most confident link fault (LINK_FAULT rows) at ``link_confidence`` or
        more (the job's run-time values, ``params_for``, as for ``link_certain``).

        Critical only when the same element was found in the job's window before too, or the finding is
        near certain (``link_certain``): one window's finding alone is a warning. A noisy host made one window's
        all-reduce look slow and the next window named another element; a real fault stays where it is.
        """
        if not rows:
            return []
        p = self.params_for(rows[0]["job_id"])  # a table per window: one job's findings
        rows = [r for r in rows if r["confidence"] >= p.link_confidence]
        if not rows:
            return []
        top = max(rows, key=lambda r: (r["confidence"], r["slowdown"]))
        # Whether the job's window before found the same element is the findings' history's to say
        # (analyzers.links.history, in the row's evidence): worked out once, for the alert and the summary.
        again = found_before(top) is not None
        rule = "link"
        if not self._fire(top["job_id"], rule, now):
            return []
        return [dict(
            alert_id=f"{top['job_id']}/{top['attempt']}/link/{top['window_id']}", job_id=top["job_id"],
            attempt=top["attempt"], ts_ns=now_ns, rule=rule,
            severity="critical" if top["kind"] != "noncomm_slow" and (again or top["confidence"] >= p.link_certain)
            else "warning",
            summary=link_alert(top, len(rows), again),
            details_json=jsonutil.dumps({k: top[k] for k in ("group", "kind", "src", "dst", "confidence", "slowdown",
                                                             "window_id")}),
        )]


class AlertReducer:
    """The rules as a reducer: result rows in (``add``), one unit of alerts out per pass (``due``).

    Alerts are evaluated once, when their rows are emitted, and the unit keeps
    them: a write the store refused is retried with the same alerts instead of
    cooling them down. They are published (alert topic, webhook) only once
    stored. A rule that fails costs its alert (logged), never the results.
    """
    consumes = frozenset({"window", "link_fault", "hang", "regression"})

    def __init__(self, rules: AlertRules, clock: Clock, publish: Callable[[dict], None]):
        self.rules = rules
        self.clock = clock
        self._publish = publish
        self._pending: list[dict] = []
        self.published = 0

    def add(self, kind: str, table: pa.Table, at=None, now: float = 0.0) -> None:
        wall_ns = self.clock.wall_ns()
        wall = wall_ns / 1e9
        try:
            rows = table.to_pylist()
            if kind == "window":
                for row in rows:
                    self._pending += self.rules.evaluate_window(row, wall, wall_ns)
            elif kind == "link_fault":  # a table per window: one alert for its most confident fault
                self._pending += self.rules.evaluate_links(rows, wall, wall_ns)
            elif kind == "hang":
                for row in rows:
                    self._pending += self.rules.evaluate_hang(row, wall, wall_ns)
            elif kind == "regression":
                for row in rows:
                    self._pending += self.rules.evaluate_regression(row, wall, wall_ns)
        except Exception as e:
            log.warning("alert rules failed on %d %s rows: %s", table.num_rows, kind, e)

    def due(self, now: float) -> list[Unit]:
        if not self._pending:
            return []
        alerts, self._pending = self._pending, []

        def stored():
            for a in alerts:
                self.published += 1
                self._publish(a)
        return [Unit(f"{len(alerts)} alert(s)", {"alert": codec.from_rows(S.ALERT, alerts)}, on_stored=stored)]

    def state(self) -> dict:
        """What a restarted shard resumes from (``ray_jobs.state``): when each (job, rule) last alerted (wall s)."""
        return {"cooldowns": dict(self.rules._last)}

    def restore(self, state: dict) -> None:
        self.rules._last.update(state["cooldowns"])

    def snapshot(self) -> dict:
        return dict(alerts=self.published)


def post_webhook(url: str, alert: dict, timeout_s: float = 3.0) -> bool:
    """POST one alert as JSON; False (logged) on any failure, never raises."""
    try:
        req = urllib.request.Request(url, data=json.dumps(alert).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return 200 <= r.status < 300
    except Exception as e:
        log.warning("webhook %s failed: %s", url, e)
        return False



class AlertTopic:
    """Stored alerts to the alert topic as JSON, keyed by job, through a producer made on first use
    (``producer()``: a kafka-python ``KafkaProducer``); a failure is logged, never raised."""

    def __init__(self, producer: Callable[[], object]):
        self._producer = producer

    @classmethod
    def for_conn(cls, conn, client_id: str) -> "AlertTopic":
        """Its own producer on ``conn`` (``core.kafka_conn.KafkaConn``), for a process without a shard's."""
        made: list = []

        def producer():
            if not made:
                from kafka import KafkaProducer

                from core.kafka_admin import KeptClient

                p = KafkaProducer(bootstrap_servers=conn.bootstrap, client_id=client_id, acks=1, linger_ms=5,
                                  allow_auto_create_topics=False, kafka_client=KeptClient(KafkaProducer),
                                  max_block_ms=3000, **conn.client_options())
                made.append(p)
            return made[0]
        return cls(producer)

    def send(self, alert: dict) -> None:
        from core import topics

        try:
            self._producer().send(topics.TOPIC_ALERTS, key=alert["job_id"].encode(), value=json.dumps(alert).encode())
        except Exception as e:
            log.warning("alert publish failed: %s", e)

    def flush(self, timeout_s: float = 5.0) -> None:
        try:
            self._producer().flush(timeout=timeout_s)
        except Exception as e:
            log.warning("alert topic flush failed: %s", e)


class AlertOutlet:
    """Where a stored alert leaves: the alert topic and the webhook. One for every alert, the shards' and the
    driver's, so that what an on-call rotation listens to gets all of them.

    ``topic``: a function that publishes one alert to the alert topic (a transport's ``alert_producer()``,
    or ``AlertTopic.send``), None where alerts are not published there."""

    def __init__(self, topic: Callable[[dict], None] | None, webhook_url: str = "",
                 on_close: Callable[[], None] | None = None):
        self.topic = topic
        self.webhook = WebhookSender(webhook_url) if webhook_url else None
        self._on_close = on_close

    def publish(self, alert: dict) -> None:
        """Off the caller's critical path: the topic's producer buffers, the webhook has its own thread."""
        if self.topic is not None:
            self.topic(alert)
        if self.webhook is not None:
            self.webhook.submit(alert)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._on_close is not None:
            self._on_close()
        if self.webhook is not None:
            self.webhook.close(timeout_s)


class DriverAlerts:
    """The driver's own alerts (lemon hosts): the same rules object as a shard's (wording, cool-down), stored
    in the alert table, then published through the same outlet."""

    def __init__(self, cfg: AlertConfig, store, outlet: AlertOutlet, clock: Clock = Clock()):
        self.rules = AlertRules(cfg)
        self.store, self.outlet, self.clock = store, outlet, clock
        self.sent = 0

    def lemons(self, scores, labels: dict | None = None, now_ns: int | None = None) -> list[dict]:
        """Alert each host score given (the new lemons of a pass): stored first, then published."""
        wall_ns = self.clock.wall_ns() if now_ns is None else now_ns
        alerts = [a for s in scores for a in self.rules.evaluate_lemon(s, wall_ns / 1e9, wall_ns, labels)]
        if alerts:
            self.store.insert("alert", codec.from_rows(S.ALERT, alerts))
            for a in alerts:
                self.outlet.publish(a)
                self.sent += 1
        return alerts


class WebhookSender:
    """POSTs alerts from a background thread so a slow or dead webhook never stalls a shard.

    The queue is bounded: when the receiver cannot keep up, the newest alerts
    are dropped and counted (they are stored and on the alerts topic anyway).
    A failed POST is retried ``retries`` times with a doubling back-off.
    """

    def __init__(self, url: str, post: Callable[[str, dict], bool] = post_webhook, max_queue: int = 1000,
                 retries: int = 2, backoff_s: float = 0.5):
        self.url = url
        self._post = post
        self._retries = retries
        self._backoff_s = backoff_s
        self._q: queue.Queue = queue.Queue(max_queue)
        self.sent = self.failed = self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="webhook", daemon=True)
        self._thread.start()

    def submit(self, alert: dict) -> bool:
        """Queue one alert; False (counted in ``dropped``) when the queue is full. Never blocks."""
        try:
            self._q.put_nowait(alert)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _run(self) -> None:
        while True:
            alert = self._q.get()
            if alert is None:
                return
            delay = self._backoff_s
            for attempt in range(self._retries + 1):
                if self._post(self.url, alert):
                    self.sent += 1
                    break
                if attempt < self._retries:
                    time.sleep(delay)
                    delay *= 2
            else:
                self.failed += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (within ``timeout_s``), then stop the thread."""
        try:
            self._q.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)
