"""The shard: consumes a fixed set of partitions and owns every job in them.

One ``ShardWorker`` per Ray actor (``ShardActor``), never one per job. It is a
host: its state lives in reducers (``ray_jobs.checkpoint.Reducer``), each with
the same verbs (add a table, emit the units due at ``now``, snapshot):

- ``WindowReducer``: op spans into windows, ready windows to the analysis
  (at most ``max_inflight`` at once: at the limit the shard stops polling,
  which is the backpressure), finished analyses out as result units;
- ``HangReducer``: heartbeats and CCL records in, hangs out;
- ``RegressionReducer``: window profiles in, regressions against each job's
  own past out;
- ``AlertReducer``: window results, link faults, hangs and regressions in,
  alerts out;
- ``DowntimeReducer``: registrations, checkpoints, heartbeats, hangs and
  alerts in, fault downtime out.

Each loop pass polls Kafka (manual assignment, no consumer group), decodes
and validates each message at the boundary (bad bytes and rows become dead
letters with the reason), routes the good tables to the reducers that consume
their kind, collects the due units, and ends in ``Checkpoint.commit``, the one
place that stores results and then the offsets they cover. A restarted shard
resumes from the stored offsets. One ``Clock`` is injected into all of them,
and the transports (``consumer_factory``, ``sink_factory``, ``submit``) are
arguments, typed by ``ray_jobs.transports``' protocols, so unit tests drive the
whole loop without Kafka, Ray or sleeping.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable

import pyarrow as pa

from core import codec, topics
from core import schema as S
from core.config import Config
from core.control import (SETTINGS, ControlBook, alert_overrides, hang_overrides, keep_link_order,
                          regression_overrides)
from core.registration import Registration
from ray_jobs import boundary as B
from ray_jobs.alerts import AlertOutlet, AlertReducer, AlertRules
from core.errors import RetryLater
from ray_jobs.checkpoint import Checkpoint, Clock, Unit
from ray_jobs.crashes import CrashJournal, default_path
from ray_jobs.dispatch import WindowReducer
from ray_jobs.downtime_reducer import DowntimeReducer
from ray_jobs.regressions import RegressionReducer, params_of
from ray_jobs.hang_monitor import HangReducer
from ray_jobs.port_counters import PortCounterReducer
from ray_jobs.transports import (Backlog, ControlFeed, JobRegistry, LostLogs, OffsetStore, Outbox, RecordSource,
                                 ResultSink)
from ray_jobs.state import StateKeeper, shard_key

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ShardStats:
    shard: int = 0
    messages: int = 0
    records: int = 0
    late_records: int = 0
    dead_letters: int = 0
    quarantined: int = 0
    """Messages dead-lettered by offset because handling them killed the shard process repeatedly."""
    clock_corrected_rows: int = 0
    """Heartbeat, collective and checkpoint rows whose rank clock was implausible and was corrected
    (``boundary.ClockGuard``)."""
    bad_stored_jobs: int = 0
    """Stored registrations skipped at start because they do not validate."""
    heartbeats: int = 0
    ccl_records: int = 0
    tcp_flows: int = 0
    """Per-connection TCP records (``core.schema.TCP_FLOW``) taken into windows for the link diagnosis."""
    port_counters: int = 0
    """Rows of hosts' port counters (``core.schema.PORT_COUNTER``) taken in, stored a row a minute per port."""
    jobs_registered: int = 0
    windows_stored: int = 0
    windows_failed: int = 0
    span_windows_kept: int = 0
    """Windows whose raw op spans were stored for drill-down (see ``pipeline.keep_op_spans_every_s``)."""
    alerts: int = 0
    hangs: int = 0
    checkpoints: int = 0
    downtime_incidents: int = 0
    regression_jobs: int = 0
    regressions: int = 0
    recoveries: int = 0
    degraded_workers: int = 0
    control_changes: int = 0
    """Run-time changes read from the control topic (``core.control``) and stored; refused ones are not counted."""
    control_refused: int = 0
    """Control records refused by ``core.control.check`` (the last reason is logged), and each time a scope's link
    thresholds in force were refused for breaking the configured order (``core.control.keep_link_order``)."""
    webhook_sent: int = 0
    webhook_failed: int = 0
    webhook_dropped: int = 0
    dispatch_to_stored_seconds: float = 0.0
    window_latency_s_last: float = 0.0
    inflight: int = 0
    open_windows: int = 0
    buffered_rows: int = 0
    lag: int = 0
    kafka_brokers: int = 0
    """Brokers in this shard's Kafka metadata now (``transports.Backlog.brokers``): fewer than were seen, one is away."""
    """Records not yet handled. Not measured before the first loop pass (``loops == 0``): read it only after."""
    loops: int = 0
    """Loop passes run (poll, handle, dispatch, collect, hangs, commit). 0: the shard has not polled yet."""
    heartbeat_age_s: float = 0.0
    """Age of the newest heartbeat when it arrived (exporter, broker and consumer delay together)."""
    heartbeat_silence_s: float = 0.0
    """Seconds since the last heartbeat of any job arrived; 0 before the first (hang checks judge silence
    only while input flows)."""
    hang_clock_held_back_s: float = 0.0
    """How far the hang checks' clock was held behind the wall at their last run, waiting for lagging input."""
    loop_seconds_max: float = 0.0
    """Longest loop iteration (poll, dispatch, collect, hangs, commit) in the last one to two minutes."""
    commits: int = 0
    """Offset stores (each after the results it covers were stored)."""
    units_dropped: int = 0
    """Stored-result units given up after the store refused them repeatedly while it answered (logged)."""
    store_down_s: float = 0.0
    """Seconds the store has been unreachable (results and offsets wait); 0 while it takes writes."""
    windows_waiting: int = 0
    """Windows closed and not stored yet: in analysis, or analysed and waiting for the store."""
    idle: bool = False
    error: str = ""


# An iteration longer than this delays hang checks noticeably: it is logged with its phases.
SLOW_ITERATION_S = 2.0


def _pay_import_costs() -> None:
    """Import now what the loop would otherwise import on its first record.

    pyarrow imports pandas the first time it builds a table from Python objects.
    On a loaded 2-core machine that import took 10-12 s inside the handling of
    the first heartbeat, and hang checks waited for it (seen in CI).
    """
    try:
        import pandas  # noqa: F401
    except ImportError:  # pyarrow then never imports it either
        pass


class ShardWorker:
    # A unit the store refused this many times while it answers is given up (``Checkpoint``).
    MAX_STORE_ATTEMPTS = 3

    def __init__(self, index: int, partitions: list[int], cfg: Config, source_id: str,
                 sink_factory: Callable[[], ResultSink],
                 consumer_factory: Callable[[], RecordSource] | None = None,
                 submit: Callable[..., Any] | None = None,
                 clock: Clock = Clock(),
                 control_factory: Callable[[], ControlFeed] | None = None):
        """``sink_factory()`` gives the writer, called in ``setup``: a ``ResultWriter`` over the store in
        production (the shard actor builds it from the pipeline's ``open_store``), a fake in tests; it plays
        ``ray_jobs.transports.WRITER_ROLES``. ``consumer_factory()`` gives the reader (``READER_ROLES``); the
        default reads this shard's partitions from Kafka (``KafkaSource``). ``control_factory()`` gives the
        reader of run-time changes (``ControlFeed``); the default reads the
        control topic where the default reader reads Kafka, and there is none beside a reader a test passed."""
        self.index = index
        self.partitions = list(partitions)
        self.cfg = cfg
        self.source_id = source_id
        self._consumer_factory = consumer_factory
        self._sink_factory = sink_factory
        self._submit = submit
        self._control_factory = control_factory
        self.clock = clock
        self.stats = ShardStats(shard=index)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._polled: collections.deque = collections.deque()  # polled, not yet handled
        # What is wrong now, by where it comes from; each cleared when that part works again, so the status
        # shows a store outage while it lasts, not forever after (ShardStats.error joins them).
        self._errors = {"loop": "", "record": ""}
        self._loop_max = [0.0, 0.0, 0.0]  # [this minute, the previous minute, when this minute ends]
        self._store_alerted = False  # the store's outage was alerted (once per outage)
        # Made in setup (clients do not pickle); None until then, which is what stop() looks at.
        # The reader and the writer, each held by the roles the shard uses (ray_jobs.transports).
        self.source: RecordSource | None = None
        self.backlog: Backlog | None = None
        self.lost: LostLogs | None = None
        self.outbox: Outbox | None = None
        self.sink: ResultSink | None = None
        self.offsets: OffsetStore | None = None
        self.checkpoint: Checkpoint | None = None
        self.journal: CrashJournal | None = None
        self.outlet: AlertOutlet | None = None
        self.controls: ControlFeed | None = None  # the control topic's reader, made in setup

    # -- lifecycle ----------------------------------------------------------
    def setup(self) -> None:
        """Create clients (here, not in __init__: Ray pickles the object), seek to stored offsets."""
        from ray_jobs.kafka_source import KafkaSource

        _pay_import_costs()
        cfg, clock = self.cfg, self.clock
        writer = self._sink_factory()
        self.sink, self.offsets = writer, writer
        registry: JobRegistry = writer
        self.sink.setup()
        reader = self._consumer_factory() if self._consumer_factory else KafkaSource(
            cfg.kafka.conn(), topics.INPUT_TOPICS, self.partitions, on_lost_log=cfg.kafka.on_lost_log)
        self.source, self.backlog, self.lost, self.outbox = reader, reader, reader, reader
        self.limits = cfg.validation
        self.clocks = B.ClockGuard(self.limits)
        self.hangs = HangReducer(cfg.hang, clock=clock)
        self.windows = WindowReducer(cfg.pipeline, clock, self.sink.window_stored, self._submit,
                                      self.limits.max_world_size, name=f"shard {self.index}",
                                      gpu_of=self.hangs.gpu_of)
        # A node loss is stored and paged with the restart plan made from its job's last window analysed whole.
        self.hangs.recovery_of = self.windows.recovery_of
        self.regressions = RegressionReducer(clock, params_of(cfg.regression))
        self.alerts = AlertReducer(AlertRules(cfg.alerts), clock, self._publish)
        self.downtime = DowntimeReducer(clock)
        self.ports = PortCounterReducer()
        # A link finding on a host whose fabric port waited or erred says so (analyzers.fabric).
        self.windows.hosts_of, self.windows.ports_of = self.hangs.hosts_of, self.ports.ports_of
        # In this order each pass: alerts follow the windows and hangs emitted in the same pass,
        # and the downtime follows the alerts. The ports' rows feed no other reducer.
        self.reducers = (self.windows, self.hangs, self.regressions, self.alerts, self.downtime, self.ports)
        # The windows hold back their own records' offsets; these three keep state built from records
        # committed long ago, so it is saved with the offsets (ray_jobs.state).
        self.state = StateKeeper(writer, self.source_id, shard_key(self.partitions),
                                 {"hangs": self.hangs, "alerts": self.alerts, "downtime": self.downtime,
                                  "regressions": self.regressions, "windows": self.windows},
                                 cfg.pipeline.state_interval_s)
        self.checkpoint = Checkpoint(
            self.sink, self.offsets, self.source, self.windows.committable, self.source_id,
            cfg.pipeline.commit_interval_s,
            clock, probe=lambda: self.offsets.load_offsets(self.source_id, topics.INPUT_TOPICS, self.partitions),
            max_attempts=self.MAX_STORE_ATTEMPTS, state=self.state)
        self.journal = CrashJournal(default_path(self.source_id, self.index, cfg.pipeline.state_dir),
                                    self.limits.max_restarts_per_message)
        self.journal.open()
        stored = self.offsets.load_offsets(self.source_id, topics.INPUT_TOPICS, self.partitions)
        self.state.load(stored)
        self.source.seek(stored, self.offsets.load_offset_logs(self.source_id, topics.INPUT_TOPICS, self.partitions),
                         by=f"shard {self.index}")
        self._audit_resets()
        self._load_jobs(registry)
        self.outlet = AlertOutlet(self.outbox.alert_producer(), cfg.alerts.webhook_url)
        self.control_book = ControlBook()
        self._control_seen, self._control_expiry = 0, 0
        self._link_problems: set[str] = set()  # the link-order refusals said already (core.control.keep_link_order)
        if self._control_factory is not None:
            self.controls = self._control_factory()
        elif self._consumer_factory is None:
            from core.control_topic import ControlReader

            self.controls = ControlReader(cfg.kafka.conn(), client_id=f"{self.source_id}-control-{self.index}")

    def _load_jobs(self, registry: JobRegistry) -> None:
        """Registrations stored before; a row that does not validate is skipped and reported, never fatal."""
        for row in registry.load_jobs():
            why = B.check_registration(row, None, self.limits, stored=True)
            if not why:
                try:
                    self.windows.tracker.register(Registration.from_row(row))
                    continue
                except Exception as e:
                    why = f"{type(e).__name__}: {e}"
            self.stats.bad_stored_jobs += 1
            log.warning("shard %d: stored registration of %r attempt %r skipped: %s", self.index,
                        str(row.get("job_id"))[:80], row.get("attempt"), why)

    def start(self) -> bool:
        """Run the loop in a thread of this actor (status() stays callable)."""
        self.setup()
        self._thread = threading.Thread(target=self._loop, name=f"shard-{self.index}", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> bool:
        """Finish the current iteration, store what is pending and the offsets it covers, close the clients."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if (self._thread is None or not self._thread.is_alive()) and self.checkpoint is not None:
            try:
                self.checkpoint.commit(self.clock.monotonic(), force=True)  # the interval may have held them
            except Exception as e:
                log.warning("final offset store failed: %s", e)
        for c in (self.source, self.sink, self.outlet, self.journal, self.controls):
            if c is not None:
                try:
                    c.close()
                except Exception as e:
                    log.warning("close failed: %s", e)
        return True

    def status(self) -> dict:
        return dataclasses.asdict(self.stats)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                self.step()
                self._errors["loop"] = ""
                self._note_loop_time(t0, time.perf_counter())
            except Exception as e:  # keep the actor alive; the failure is visible in status()
                log.exception("shard %d step failed", self.index)
                self._errors["loop"] = f"{type(e).__name__}: {e}"
                self.stats.error = self._errors["loop"][:500]
                time.sleep(1.0)

    def _note_loop_time(self, t0: float, t1: float) -> None:
        """A rolling maximum: a stalled iteration shows for one to two minutes, then ages out."""
        cur, prev, ends = self._loop_max
        if t1 >= ends:
            cur, prev, ends = 0.0, (cur if t1 < ends + 60 else 0.0), t1 + 60
        cur = max(cur, t1 - t0)
        self._loop_max = [cur, prev, ends]
        self.stats.loop_seconds_max = max(cur, prev)

    # -- one pass -----------------------------------------------------------
    def step(self, poll_timeout_ms: int = 200) -> None:
        """Poll (unless backpressured) and handle; collect what the reducers have due; commit."""
        now = self.clock.monotonic()
        busy = self.windows.busy()
        got = 0
        marks = [("start", time.perf_counter())]
        if not busy:
            if not self._polled:
                self._rewind_lost_logs()
                self._polled.extend(self.source.poll(poll_timeout_ms))
            marks.append(("poll", time.perf_counter()))
            # A poll can bring hundreds of large batches (a backlog); handling them all at once
            # held hang checks and stores up for 20 s. Handle for a time budget, keep the rest
            # (their offsets advance only once handled), and come back on the next iteration.
            budget_end = marks[0][1] + self.cfg.pipeline.handle_budget_s
            while self._polled and (got == 0 or time.perf_counter() < budget_end):
                msg, h0 = self._polled.popleft(), time.perf_counter()
                try:
                    self._handle(msg, now)
                except RetryLater as e:  # kept, in order, for the next pass; its offset does not advance
                    self._polled.appendleft(msg)
                    self._errors["record"] = str(e)
                    break
                self._errors["record"] = ""
                got += 1
                took = time.perf_counter() - h0
                if took > SLOW_ITERATION_S / 2:
                    log.warning("shard %d: handling one message on %s (%d bytes) took %.2f s", self.index,
                                msg.topic, len(msg.value or b""), took)
        self._take_controls()
        marks.append(("handle", time.perf_counter()))
        for reducer in self.reducers:
            units = reducer.due(now)
            if units and reducer is not self.windows:  # their state says these were found: keep it with them
                self.state.touch()
            for unit in units:
                self._emit(unit, now)
            marks.append((type(reducer).__name__, time.perf_counter()))
        self.checkpoint.commit(now)
        marks.append(("commit", time.perf_counter()))
        if marks[-1][1] - marks[0][1] > SLOW_ITERATION_S:
            # Hang alerts wait for the loop: say where a slow iteration spent its time.
            parts = ", ".join(f"{name} {t - marks[i][1]:.2f} s" for i, (name, t) in enumerate(marks[1:]))
            log.warning("shard %d: slow loop iteration, %.2f s (%s; %d messages)", self.index,
                        marks[-1][1] - marks[0][1], parts, got)
        self._update_stats(got)

    def _take_controls(self) -> None:
        """Run-time changes read since the last pass: each stored once (the control_changes table, with the
        results: every shard reads them all, and the table keeps the first row of a change), and the
        thresholds in force (hang, regression and alert rules) handed to their reducers before their next
        evaluation; also when one ran out."""
        if self.controls is None:
            return
        book, refused = self.control_book, len(self.control_book.refused)
        new = book.take(self.controls.poll(0))  # each change whole, its parts merged
        if len(book.refused) > refused:
            self.stats.control_refused += len(book.refused) - refused
            log.warning("shard %d: control record refused: %s", self.index, book.refused[-1])
        if new:
            self.stats.control_changes += len(new)
            self.checkpoint.add(Unit(f"{len(new)} control change(s)", {
                "control_change": codec.from_rows(S.CONTROL_CHANGE, [c.row() for c in new])}))
        now_ns = self.clock.wall_ns()
        if book.version == self._control_seen and not (self._control_expiry and now_ns >= self._control_expiry):
            return
        self._control_seen, self._control_expiry = book.version, book.next_expiry(now_ns)
        # The link thresholds must keep the configured order in every scope; only here are the configured values
        # and everything in force (what ended, what was cleared) known together, so here a scope that breaks it
        # is refused: its link values fall back (core.control.keep_link_order), said once while it lasts.
        fleet_settings, job_settings, problems = keep_link_order(
            book.settings(now_ns, None), {job: book.own_settings(now_ns, job) for job in book.jobs()}, self.cfg.alerts)
        for line in problems:
            if line not in self._link_problems:
                self.stats.control_refused += 1
                log.warning("shard %d: control refused: %s", self.index, line)
        self._link_problems = set(problems)
        # Each reducer gets the whole set of its overrides every time (what ended is simply absent), and per
        # job only where the job's differ from the fleet's.
        for reducer, overrides in ((self.hangs, hang_overrides), (self.regressions, regression_overrides),
                                   (self.alerts.rules, alert_overrides)):
            fleet = overrides(fleet_settings)
            jobs = {job: overrides(s) for job, s in job_settings.items()}
            reducer.set_overrides(fleet, {job: o for job, o in jobs.items() if o != fleet})
        def ours(settings: dict) -> dict:  # the exporters' settings (sampling, heartbeats) are not the shard's
            return {k: v for k, v in settings.items() if SETTINGS[k].reader == "shard"}
        log.info("shard %d: thresholds changed at run time: fleet %s, jobs with their own %s", self.index,
                 ours(fleet_settings) or "as configured",
                 sorted(j for j, s in job_settings.items() if ours(s) != ours(fleet_settings)))

    def _update_stats(self, got: int) -> None:
        st = self.stats
        for reducer in self.reducers:
            for name, value in reducer.snapshot().items():
                setattr(st, name, value)
        st.lag = self.source.lag() + len(self._polled)
        # Polled and not handled yet is unread too, for the hang monitor's per-partition clock.
        self.hangs.unread = self.backlog.unread() | {(m.topic, m.partition) for m in self._polled}
        st.kafka_brokers = self.backlog.brokers()
        st.loops += 1
        st.commits = self.checkpoint.commits
        st.units_dropped = self.checkpoint.units_dropped
        st.store_down_s = self.checkpoint.down_s()
        st.windows_waiting = st.inflight + self.checkpoint.windows_waiting()
        self._store_alert(st.store_down_s)
        problems = self.source.problems
        errors = [self._errors["loop"], self._errors["record"], self.checkpoint.last_error,
                  # a vanished partition, an offset past the end: paused there, shown here
                  ("kafka: " + "; ".join(problems)) if problems else ""]
        # Each on its first line (ClickHouse's errors end in an empty "Log:"), each once (the loop and the
        # checkpoint can report the same refusal).
        lines = [next((ln.strip() for ln in e.splitlines() if ln.strip()), "") for e in errors]
        st.error = "; ".join(dict.fromkeys(ln for ln in lines if ln))[:500]
        st.clock_corrected_rows = self.clocks.corrected_rows
        hook = self.outlet.webhook if self.outlet is not None else None
        if hook is not None:
            st.webhook_sent, st.webhook_failed, st.webhook_dropped = hook.sent, hook.failed, hook.dropped
        st.idle = got == 0 and not st.inflight and not st.open_windows and st.lag == 0

    def _store_alert(self, down_s: float) -> None:
        """A store unreachable for ``alerts.store_down_s``: one critical alert on the topic and the webhook (the
        alert table is in the store that is down), once per outage; its return, one ``info``."""
        limit = self.cfg.alerts.store_down_s
        if limit <= 0 or self.outlet is None:
            return
        if down_s >= limit and not self._store_alerted:
            self._store_alerted = True
            self.outlet.publish(self._pipeline_alert(
                "store_down", "critical", f"the store is unreachable for {down_s:.0f} s: shard {self.index}'s "
                f"results and offsets wait ({self.checkpoint.last_error[:300]})"))
        elif down_s == 0 and self._store_alerted:
            self._store_alerted = False
            self.outlet.publish(self._pipeline_alert("store_down", "info",
                                                     f"the store takes shard {self.index}'s writes again"))

    def _pipeline_alert(self, rule: str, severity: str, what: str) -> dict:
        now_ns = self.clock.wall_ns()
        return dict(alert_id=f"pipeline/{self.source_id}/{self.index}/{rule}/{now_ns}", job_id="", attempt=0,
                    ts_ns=now_ns, rule=rule, severity=severity, summary=f"pipeline {self.source_id}: {what}",
                    details_json=json.dumps({"shard": self.index, "source_id": self.source_id}))

    def _rewind_lost_logs(self) -> None:
        """Partitions whose log the broker lost while we read them (``kafka.on_lost_log = rewind``): from the
        new log's start. Done between polls, once what was polled of the old log is handled; the open
        windows' hold on the old log's offsets goes (those offsets count in a log that is gone)."""
        for tp in self.lost.lost_logs():
            self.windows.tracker.forget_partition(tp)
            self.state.rewound(tp, self.lost.rewind(tp, by=f"shard {self.index}"))
        self._audit_resets()

    def _audit_resets(self) -> None:
        """Each offset the source moved because the broker lost records: a row of the audit table."""
        resets = self.lost.take_resets()
        if resets:
            now_ns = self.clock.wall_ns()
            rows = [dict(r, source_id=self.source_id, reset_ns=now_ns + i) for i, r in enumerate(resets)]
            self.checkpoint.add(Unit(f"{len(rows)} offset reset(s)",
                                     {"offset_reset": codec.from_rows(S.OFFSET_RESET, rows)}))

    def _feed(self, kind: str, table: pa.Table, at, now: float) -> None:
        """A table of one record kind to every reducer that consumes that kind."""
        for reducer in self.reducers:
            if kind in reducer.consumes:
                reducer.add(kind, table, at, now)

    def _emit(self, unit: Unit, now: float) -> None:
        """A reducer's unit: its rows feed the reducers downstream (alerts, downtime), then wait for the commit."""
        if not unit.best_effort:
            for kind, table in unit.tables.items():
                if table.num_rows:
                    self._feed(kind, table, None, now)
        self.checkpoint.add(unit)

    # -- the boundary ---------------------------------------------------------
    def _handle(self, msg, now: float) -> None:
        """One message through the boundary: whatever goes wrong with it is its dead letter, never the loop's
        (except ``RetryLater``: then nothing of it was used, and the caller keeps it)."""
        pos = (msg.topic, msg.partition, msg.offset)
        if pos in self.journal.quarantined:
            self.stats.quarantined += 1
            self._dead_letter(msg, f"quarantined: the shard process died {self.journal.deaths.get(pos, 0)} times "
                                   "while handling this message")
            self.journal.forget(pos)
        else:
            self.journal.begin(*pos)
            try:
                self._route(msg, now)
            except RetryLater:
                raise
            except Exception as e:  # a bug or a case no check foresaw: this message's fault, not the shard's
                log.warning("shard %d: handling %s:%d@%d failed", self.index, *pos, exc_info=True)
                self._dead_letter(msg, f"handling failed: {type(e).__name__}: {e}")
            finally:
                self.journal.end()
        self.source.advance((msg.topic, msg.partition), msg.offset + 1)
        self.stats.messages += 1

    def _route(self, msg, now: float) -> None:
        try:
            kind, table = codec.decode(msg.value, max_decoded_bytes=int(self.limits.max_decoded_mb * 2**20))
            if topics.TOPIC_OF_KIND.get(kind) != topics.family_of(msg.topic):
                raise codec.DecodeError(f"{kind} record on topic {msg.topic}")
            key = msg.key.decode("utf-8") if msg.key is not None else None
        except (codec.DecodeError, UnicodeDecodeError) as e:
            self._dead_letter(msg, str(e))
            return
        if kind == "job":
            self._register(msg, table, key, now)
            return
        layout = self._layout_of(key, table)
        if kind == "op_span":
            split = B.check_op_spans(table, key, layout, self.limits)
        elif kind == "heartbeat":
            wall = self.clock.wall_ns()
            split = B.check_heartbeats(self.clocks.correct_heartbeats(table, wall), key, layout, self.limits, wall)
            self.stats.heartbeats += split.good.num_rows
        elif kind == "checkpoint":
            split = B.check_checkpoints(self.clocks.correct_checkpoints(table), key, layout, self.limits)
            self.stats.checkpoints += split.good.num_rows
        elif kind == "ccl_record":
            split = B.check_ccl(self.clocks.correct_ccl(table), key, layout, self.limits, self.clock.wall_ns())
            self.stats.ccl_records += split.good.num_rows
        elif kind == "tcp_flow":
            split = B.check_tcp_flows(table, key, layout, self.limits)
            self.stats.tcp_flows += split.good.num_rows
        elif kind == "port_counter":
            split = B.check_port_counters(table, key, layout, self.limits)
            self.stats.port_counters += split.good.num_rows
        else:  # a kind of record the shard does not read on an input topic
            self._dead_letter(msg, f"{kind} records are not input")
            return
        if split.refused:
            self._dead_letter(msg, split.reason)
        if split.good.num_rows:
            self._feed(kind, split.good, ((msg.topic, msg.partition), msg.offset), now)

    def _layout_of(self, key: str | None, table: pa.Table):
        """The registered layout of the job attempt the rows belong to, or None (not registered, or mixed)."""
        if key is None or table.num_rows == 0:
            return None
        attempts = pa.compute.unique(table["attempt"])
        info = self.windows.job(key, attempts[0].as_py()) if len(attempts) == 1 else None
        return info.layout if info is not None else None

    def _register(self, msg, table: pa.Table, key: str | None, now: float) -> None:
        """Validate, then use and store: a registration that fails validation is never stored or used.

        The reducers use it at once; the checkpoint stores it before the offset that covers it.
        """
        good, bad = [], []
        for row in table.to_pylist():
            why = B.check_registration(row, key, self.limits)
            (bad if why else good).append((row, why))
        if bad:
            self._dead_letter(msg, "; ".join(f"job record of {str(r.get('job_id'))[:80]!r}: {why}"
                                             for r, why in bad[:5]))
        if not good:
            return
        rows = codec.from_rows(S.JOB, [r for r, _ in good])
        self._feed("job", rows, ((msg.topic, msg.partition), msg.offset), now)

        def stored(n=rows.num_rows):
            self.stats.jobs_registered += n
        self.checkpoint.add(Unit(f"{rows.num_rows} registration(s)", {"job": rows}, on_stored=stored))

    def _dead_letter(self, msg, reason: str) -> None:
        """The message, its position and the reason: stored (before its offset) and published to the topic."""
        self.stats.dead_letters += 1
        row = dict(ts_ns=self.clock.wall_ns(), source_topic=msg.topic, source_partition=msg.partition,
                   source_offset=msg.offset, key=(msg.key or b"").decode("utf-8", "replace"),
                   reason=reason[:1000], payload=bytes(msg.value[:65536]) if msg.value else b"")
        self.checkpoint.add(Unit(f"dead letter {msg.topic}:{msg.partition}@{msg.offset}",
                                 {"dead_letter": codec.from_rows(S.DEAD_LETTER, [row])}))
        try:
            self.outbox.dead_letter(msg, reason)
        except Exception as e:  # the dead-letter topic is a copy; the stored row is what counts
            log.warning("shard %d: publishing a dead letter failed: %s", self.index, e)

    def _publish(self, alert: dict) -> None:
        """A stored alert to the alert topic and the webhook (both off the loop's critical path)."""
        if self.outlet is not None:
            self.outlet.publish(alert)
