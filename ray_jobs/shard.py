"""The shard: consumes a fixed set of partitions and owns every job in them.

One ``ShardWorker`` per Ray actor (``ShardActor``), never one per job. Its loop:
poll Kafka (manual assignment, no consumer group), decode each message at the
boundary (bad bytes go to the dead-letter topic and table with the reason),
route op spans to the ``WindowTracker``, hand ready windows to the analyzer
(Ray tasks, at most ``max_inflight`` at once: at the limit the shard stops
polling, which is the backpressure), write finished results through the sink,
raise alerts, and only then store the partitions' committable offsets beside
the results. A restarted shard resumes from the stored offsets.

The worker takes its transports as arguments (``consumer_factory``,
``sink_factory``, ``submit``) so unit tests drive it without Kafka or Ray.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import pyarrow as pa

from ingest import schema as S
from ray_jobs.alerts import AlertRules, WebhookSender
from analyzers.accounting import DowntimeAccountant, downtime_table
from analyzers.hang import HangParams
from ray_jobs import boundary as B
from ray_jobs.analysis import analyze_window, failed_window
from ray_jobs.crashes import CrashJournal, default_path
from ray_jobs.hangs import HangMonitor, hang_table
from ray_jobs.windows import JobInfo, ReadyWindow, WindowTracker
from stragglerscope.config import Config

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
    """Heartbeat and collective rows whose rank clock was implausible and was corrected (``boundary.ClockGuard``)."""
    bad_stored_jobs: int = 0
    """Stored registrations skipped at start because they do not validate."""
    heartbeats: int = 0
    ccl_records: int = 0
    jobs_registered: int = 0
    windows_stored: int = 0
    windows_failed: int = 0
    span_windows_kept: int = 0
    """Windows whose raw op spans were stored for drill-down (see ``pipeline.keep_op_spans_every_s``)."""
    alerts: int = 0
    hangs: int = 0
    checkpoints: int = 0
    downtime_incidents: int = 0
    webhook_sent: int = 0
    webhook_failed: int = 0
    webhook_dropped: int = 0
    analyzer_seconds: float = 0.0
    window_latency_s_last: float = 0.0
    inflight: int = 0
    open_windows: int = 0
    buffered_rows: int = 0
    lag: int = 0
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
    def __init__(self, index: int, partitions: list[int], cfg: Config, source_id: str,
                 consumer_factory: Callable[[], Any] | None = None,
                 sink_factory: Callable[[], Any] | None = None,
                 submit: Callable[..., Any] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_ns: Callable[[], int] = time.time_ns):
        self.index = index
        self.partitions = list(partitions)
        self.cfg = cfg
        self.source_id = source_id
        self._consumer_factory = consumer_factory
        self._sink_factory = sink_factory
        self._submit = submit
        self._clock = clock
        self._wall_ns = wall_ns  # the job clock is wall time: hang durations are measured on it
        self.stats = ShardStats(shard=index)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._inflight: list[tuple[Any, ReadyWindow, float]] = []
        self._committed: dict = {}
        self._commit_due = 0.0
        self._polled: collections.deque = collections.deque()  # polled, not yet handled
        self._loop_max = [0.0, 0.0, 0.0]  # [this minute, the previous minute, when this minute ends]
        # (job, attempt) -> (start_ns, verdict) of the last window whose spans were kept.
        self._spans_kept: dict[tuple[str, int], tuple[int, str]] = {}

    # -- lifecycle ----------------------------------------------------------
    def setup(self) -> None:
        """Create clients (here, not in __init__: Ray pickles the object), seek to stored offsets."""
        from ray_jobs.io import KafkaSource, ResultWriter

        _pay_import_costs()
        self.sink = self._sink_factory() if self._sink_factory else ResultWriter(self.cfg.store.url)
        self.sink.setup()
        self.tracker = WindowTracker(self.cfg.pipeline.idle_timeout_s, is_stored=self.sink.window_stored)
        self.rules = AlertRules(self.cfg.alerts)
        h = self.cfg.hang
        self.hangs = HangMonitor(HangParams(h.floor_s, h.k_steps, h.heartbeat_timeout_s, h.startup_s))
        # Fault downtime (detection, diagnosis, lost progress, re-init) from the same stream.
        self.downtime = DowntimeAccountant()
        self._downtime_due = 0.0
        self.source = self._consumer_factory() if self._consumer_factory else KafkaSource(
            self.cfg.kafka.conn(), S.INPUT_TOPICS, self.partitions)
        self.limits = self.cfg.validation
        self.clocks = B.ClockGuard(self.limits)
        self._store_failures: dict = {}  # window key -> failed store attempts
        self._last_store_ok = 0.0
        self.journal = CrashJournal(default_path(self.source_id, self.index, self.cfg.pipeline.state_dir),
                                    self.limits.max_restarts_per_message)
        self.journal.open()
        stored = self.sink.load_offsets(self.source_id, S.INPUT_TOPICS, self.partitions)
        self.source.seek(stored)
        self._load_jobs()
        self.alerts_out = self.source.alert_producer() if hasattr(self.source, "alert_producer") else None
        url = self.cfg.alerts.webhook_url
        self.webhook = WebhookSender(url) if url else None

    def _load_jobs(self) -> None:
        """Registrations stored before; a row that does not validate is skipped and reported, never fatal."""
        for row in self.sink.load_jobs():
            why = B.check_registration(row, None, self.limits)
            if not why:
                try:
                    self.tracker.register(JobInfo.from_row(row))
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
        """Finish the current iteration, store the offsets its stored results cover, close the clients."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if (self._thread is None or not self._thread.is_alive()) and hasattr(self, "tracker"):
            try:
                self._commit()  # the commit interval may have held the last positions back
            except Exception as e:
                log.warning("final offset store failed: %s", e)
        for c in (getattr(self, "source", None), getattr(self, "sink", None), getattr(self, "webhook", None),
                  getattr(self, "journal", None)):
            if c is not None and hasattr(c, "close"):
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
                self._note_loop_time(t0, time.perf_counter())
            except Exception as e:  # keep the actor alive; the failure is visible in status()
                log.exception("shard %d step failed", self.index)
                self.stats.error = f"{type(e).__name__}: {e}"[:500]
                time.sleep(1.0)

    def _note_loop_time(self, t0: float, t1: float) -> None:
        """A rolling maximum: a stalled iteration shows for one to two minutes, then ages out."""
        cur, prev, ends = self._loop_max
        if t1 >= ends:
            cur, prev, ends = 0.0, (cur if t1 < ends + 60 else 0.0), t1 + 60
        cur = max(cur, t1 - t0)
        self._loop_max = [cur, prev, ends]
        self.stats.loop_seconds_max = max(cur, prev)

    # -- one iteration ------------------------------------------------------
    def step(self, poll_timeout_ms: int = 200) -> None:
        """Poll (unless backpressured), dispatch ready windows, collect results."""
        now = self._clock()
        pcfg = self.cfg.pipeline
        busy = len(self._inflight) >= pcfg.max_inflight or self.tracker.buffered_rows() >= pcfg.max_buffered_rows
        got = 0
        marks = [("start", time.perf_counter())]
        if not busy:
            if not self._polled:
                self._polled.extend(self.source.poll(poll_timeout_ms))
            marks.append(("poll", time.perf_counter()))
            # A poll can bring hundreds of large batches (a backlog); handling them all at once
            # held hang checks and stores up for 20 s. Handle for a time budget, keep the rest
            # (their offsets advance only once handled), and come back on the next iteration.
            budget_end = marks[0][1] + pcfg.handle_budget_s
            while self._polled and (got == 0 or time.perf_counter() < budget_end):
                msg, h0 = self._polled.popleft(), time.perf_counter()
                self._handle(msg, now)
                got += 1
                took = time.perf_counter() - h0
                if took > SLOW_ITERATION_S / 2:
                    log.warning("shard %d: handling one message on %s (%d bytes) took %.2f s", self.index,
                                msg.topic, len(msg.value or b""), took)
        marks.append(("handle", time.perf_counter()))
        for win in self.tracker.ready(now):
            self._dispatch(win)
        marks.append(("dispatch", time.perf_counter()))
        self._collect(block=busy)
        marks.append(("collect", time.perf_counter()))
        self._check_hangs(now)
        marks.append(("hangs", time.perf_counter()))
        self._account_downtime(now)
        marks.append(("downtime", time.perf_counter()))
        self._commit(now)
        marks.append(("commit", time.perf_counter()))
        if marks[-1][1] - marks[0][1] > SLOW_ITERATION_S:
            # Hang alerts wait for the loop: say where a slow iteration spent its time.
            parts = ", ".join(f"{name} {t - marks[i][1]:.2f} s" for i, (name, t) in enumerate(marks[1:]))
            log.warning("shard %d: slow loop iteration, %.2f s (%s; %d messages)", self.index,
                        marks[-1][1] - marks[0][1], parts, got)
        st = self.stats
        st.inflight = len(self._inflight)
        st.open_windows = len(self.tracker.open)
        st.buffered_rows = self.tracker.buffered_rows()
        st.lag = self.source.lag() + len(self._polled)
        st.loops += 1
        problems = getattr(self.source, "problems", ())
        if problems:  # a vanished partition, an offset past the end: paused there, shown here
            st.error = ("kafka: " + "; ".join(problems))[:500]
        st.heartbeat_age_s = self.hangs.heartbeat_age_s
        st.heartbeat_silence_s = now - self.hangs.last_input if self.hangs.last_input else 0.0
        st.hang_clock_held_back_s = self.hangs.clock_held_back_s
        st.clock_corrected_rows = self.clocks.corrected_rows
        st.records = self.tracker.counters.records
        st.late_records = self.tracker.counters.late_records
        if self.webhook is not None:
            st.webhook_sent, st.webhook_failed, st.webhook_dropped = (
                self.webhook.sent, self.webhook.failed, self.webhook.dropped)
        st.idle = got == 0 and not self._inflight and not self.tracker.open and st.lag == 0

    def _handle(self, msg, now: float) -> None:
        """One message through the boundary: whatever goes wrong with it is its dead letter, never the loop's."""
        self.stats.messages += 1
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
            except Exception as e:  # a bug or a case no check foresaw: this message's fault, not the shard's
                log.warning("shard %d: handling %s:%d@%d failed", self.index, *pos, exc_info=True)
                self._dead_letter(msg, f"handling failed: {type(e).__name__}: {e}")
            finally:
                self.journal.end()
        self.source.advance((msg.topic, msg.partition), msg.offset + 1)

    def _route(self, msg, now: float) -> None:
        try:
            kind, table = S.decode(msg.value)
            if S.TOPIC_OF_KIND.get(kind) != msg.topic:
                raise S.DecodeError(f"{kind} record on topic {msg.topic}")
            key = msg.key.decode("utf-8") if msg.key is not None else None
        except (S.DecodeError, UnicodeDecodeError) as e:
            self._dead_letter(msg, str(e))
            return
        tp = (msg.topic, msg.partition)
        if kind == "job_registration":
            self._register(msg, table, key)
            return
        layout = self._layout_of(key, table)
        if kind == "op_span":
            split = B.check_op_spans(table, key, layout, self.limits)
            if split.refused:
                self._dead_letter(msg, split.reason)
            if split.good.num_rows:
                self.tracker.add_ops(split.good, tp, msg.offset, now)
        elif kind == "heartbeat":
            wall = self._wall_ns()
            table = self.clocks.correct_heartbeats(table, wall)
            split = B.check_heartbeats(table, key, layout, self.limits, wall)
            if split.refused:
                self._dead_letter(msg, split.reason)
            self.stats.heartbeats += split.good.num_rows
            if split.good.num_rows:
                self.hangs.add_heartbeats(split.good, now)
                self.downtime.add_heartbeats(split.good)
        elif kind == "checkpoint":
            split = B.check_checkpoints(table, key, layout, self.limits)
            if split.refused:
                self._dead_letter(msg, split.reason)
            self.stats.checkpoints += split.good.num_rows
            if split.good.num_rows:
                self.downtime.add_checkpoints(split.good)
        elif kind == "ccl_record":
            table = self.clocks.correct_ccl(table)
            split = B.check_ccl(table, key, layout, self.limits, self._wall_ns())
            if split.refused:
                self._dead_letter(msg, split.reason)
            self.stats.ccl_records += split.good.num_rows
            if split.good.num_rows:
                self.hangs.add_ccl(split.good, now)
                self.tracker.add_ccl(split.good, tp, msg.offset, now)

    def _layout_of(self, key: str | None, table: pa.Table):
        """The registered layout of the job attempt the rows belong to, or None (not registered, or mixed)."""
        if key is None or table.num_rows == 0:
            return None
        attempts = pa.compute.unique(table["attempt"])
        info = self.tracker.job(key, attempts[0].as_py()) if len(attempts) == 1 else None
        return info.layout if info is not None else None

    def _register(self, msg, table: pa.Table, key: str | None) -> None:
        """Validate, then store, then use: a registration that fails validation is never stored."""
        good, bad = [], []
        for row in table.to_pylist():
            why = B.check_registration(row, key, self.limits)
            (bad if why else good).append((row, why))
        if bad:
            self._dead_letter(msg, "; ".join(f"job_registration of {str(r.get('job_id'))[:80]!r}: {why}"
                                             for r, why in bad[:5]))
        if not good:
            return
        rows = [r for r, _ in good]
        self.sink.write("job_registration", S.from_rows(S.JOB_REGISTRATION, rows))
        self.sink.flush()  # registrations are stored before their offset can be committed
        for row in rows:
            self.tracker.register(JobInfo.from_row(row))
            self.stats.jobs_registered += 1
        self.downtime.add_registrations(S.from_rows(S.JOB_REGISTRATION, rows))

    def _dead_letter(self, msg, reason: str) -> None:
        self.stats.dead_letters += 1
        row = dict(ts_ns=self._wall_ns(), source_topic=msg.topic, source_partition=msg.partition,
                   source_offset=msg.offset, key=(msg.key or b"").decode("utf-8", "replace"),
                   reason=reason[:1000], payload=bytes(msg.value[:65536]) if msg.value else b"")
        self.sink.write("dead_letter", S.from_rows(S.DEAD_LETTER, [row]))
        try:
            self.source.dead_letter(msg, reason)
        except Exception as e:  # the dead-letter topic is a copy; the stored row is what counts
            log.warning("shard %d: publishing a dead letter failed: %s", self.index, e)

    def _dispatch(self, win: ReadyWindow) -> None:
        """Hand a ready window to the analyzer; a window that cannot even be submitted is stored as failed."""
        t0 = self._clock()
        try:
            info = self.tracker.job(win.key[0], win.key[1]) or _unregistered(win, self.limits.max_world_size)
            args = (win.ops, info, win.key, win.complete, win.note, win.ccl)
            handle = self._submit(*args) if self._submit else analyze_window(*args)
        except Exception as e:
            log.warning("shard %d: dispatching %s failed: %s", self.index, win.key, e)
            handle = self._failed(win, f"dispatch failed: {type(e).__name__}: {e}")
        self._inflight.append((handle, win, t0))

    def _failed(self, win: ReadyWindow, reason: str) -> dict[str, pa.Table]:
        """The tables of a window that could not be analysed or stored, with the reason (never raises)."""
        self.stats.windows_failed += 1
        try:
            info = self.tracker.job(win.key[0], win.key[1]) or _unregistered(win, self.limits.max_world_size)
        except Exception:
            info = JobInfo(job_id=win.key[0], attempt=win.key[1], layout=S.JobLayout(1, 1), profiled_steps=1,
                           registered=False)
        return failed_window(win.ops, info, win.key, reason)

    def _collect(self, block: bool) -> None:
        from ray_jobs.io import resolve_ready

        if not self._inflight:
            return
        self._give_up_refused()
        done, pending = resolve_ready(self._inflight, timeout_s=0.5 if block else 0.0)
        self._inflight = pending
        batch = []
        for (tables, err), win, t0 in done:
            if tables is None:
                # The task died after Ray's own retries (worker killed, OOM): store the
                # failure so the window is visible and its offsets can advance.
                log.warning("analysis task for %s failed: %s", win.key, err)
                tables = self._failed(win, f"analysis task failed: {err}")
            batch.append((tables, win, t0))
        if not batch:
            return
        try:
            self._store(batch)
            return
        except Exception as e:
            if len(batch) == 1:
                self._store_failed(batch[0], e)
                return
        # One window's rows may be what the store refuses: store the rest one by one.
        for entry in batch:
            try:
                self._store([entry])
            except Exception as e:
                self._store_failed(entry, e)

    # A window whose rows the store refused this many times, while the store took other writes
    # since, is stored as a failed window instead: retrying it forever would pin its offsets.
    MAX_STORE_ATTEMPTS = 3

    def _store_failed(self, entry, e: Exception) -> None:
        """Store unreachable (or refusing): keep the result, retry on the next step."""
        tables, win, t0 = entry
        n = self._store_failures.get(win.key, (0, 0.0))[0] + 1
        self._store_failures[win.key] = (n, self._clock())
        log.warning("storing %s failed (attempt %d), will retry: %s", win.key, n, e)
        self.stats.error = f"store: {type(e).__name__}: {e}"[:500]
        self._inflight.append(entry)

    def _give_up_refused(self) -> None:
        """Windows the store keeps refusing while it accepts other writes: store them as failed instead."""
        for i, (handle, win, t0) in enumerate(self._inflight):
            n, last = self._store_failures.get(win.key, (0, 0.0))
            if n >= self.MAX_STORE_ATTEMPTS and self._last_store_ok >= last and isinstance(handle, dict):
                self._inflight[i] = (self._failed(win, f"the store refused the results {n} times"), win, t0)
                self._store_failures.pop(win.key, None)

    def _store(self, batch: list[tuple[dict[str, pa.Table], ReadyWindow, float]]) -> None:
        """Write the tables and alerts of the windows done in this iteration; only then are they done.

        One flush for the whole batch (one insert per table kind): a store
        insert costs about the same for one window as for twenty, and a loop
        that stored twenty windows one by one held hang checks up for seconds.
        Alerts are evaluated once and kept in ``tables``, so a retry after a
        failed write stores the same alerts instead of cooling them down.
        """
        for tables, win, _t0 in batch:
            if "alert" not in tables:
                tables["alert"] = self._window_alerts(tables, win)
            for kind, table in tables.items():
                if table.num_rows:
                    self.sink.write(kind, table)
        self.sink.flush()
        self._last_store_ok = self._clock()
        for tables, win, t0 in batch:
            # Results are stored: only now is the window done (its offsets may advance).
            self._store_failures.pop(win.key, None)
            self.tracker.mark_stored(win.key)
            self.stats.windows_stored += 1
            self.stats.analyzer_seconds += self._clock() - t0
            self.stats.window_latency_s_last = self._clock() - t0
            self._publish(tables["alert"].to_pylist())
        self._keep_spans(batch)

    def _window_alerts(self, tables: dict[str, pa.Table], win: ReadyWindow) -> pa.Table:
        """The window's alerts; a rule that fails costs the alert (logged), never the stored result."""
        try:
            row = tables["window_result"].to_pylist()[0]
            wall_ns = self._wall_ns()
            wall = wall_ns / 1e9
            alerts = self.rules.evaluate_window(row, wall, wall_ns)
            if "link_fault" in tables and tables["link_fault"].num_rows:
                alerts += self.rules.evaluate_links(tables["link_fault"].to_pylist(), wall, wall_ns)
            return S.from_rows(S.ALERT, alerts)
        except Exception as e:
            log.warning("shard %d: alert rules failed on %s: %s", self.index, win.key, e)
            return S.empty(S.ALERT)

    def _keep_spans(self, batch: list[tuple[dict[str, pa.Table], ReadyWindow, float]]) -> None:
        """Raw spans of windows worth drilling into, for the console's timeline and `advise`.

        Kept: a window with a link fault; a window with a verdict when its job kept none within
        ``keep_op_spans_every_s`` of its own clock before, or kept one with another verdict. Raw spans
        are most of what a fleet writes (46M of 48M rows in a soak of 1,000 jobs), and one recent
        window per job and cause is what a drill-down needs. Written after the results so alerts never
        wait for them, and best effort: a failure here costs the drill-down, not the windows.
        """
        kept = 0
        every_ns = int(self.cfg.pipeline.keep_op_spans_every_s * 1e9)
        for tables, win, _t0 in batch:
            if not 0 < win.ops.num_rows <= self.cfg.pipeline.keep_op_spans_max_rows:
                continue
            result = tables["window_result"]
            verdict = result["verdict"][0].as_py()
            link = "link_fault" in tables and tables["link_fault"].num_rows > 0
            if verdict in ("", "none") and not link:
                continue
            start = int(result["start_ns"][0].as_py())
            last = self._spans_kept.get(win.key[:2])
            if (not link and every_ns > 0 and last is not None and last[1] == verdict
                    and 0 <= start - last[0] < every_ns):
                continue
            self._spans_kept[win.key[:2]] = (start, verdict)
            self.sink.write("op_span", win.ops)
            kept += 1
        self.stats.span_windows_kept += kept
        if not kept:
            return
        try:
            self.sink.flush()
        except Exception as e:
            log.warning("keeping the op spans of %d windows failed: %s", kept, e)

    def _check_hangs(self, now: float) -> None:
        """Store new hangs and their alerts (hangs must not wait for any window to close)."""
        wall_ns = self._wall_ns()
        rows = self.hangs.evaluate(now, wall_ns)
        if not rows:
            return
        alerts = [a for r in rows for a in self.rules.evaluate_hang(r, wall_ns / 1e9, wall_ns)]
        hangs = hang_table(rows)
        self.sink.write("hang", hangs)
        self.downtime.add_hangs(hangs)
        if alerts:
            alert_rows = S.from_rows(S.ALERT, alerts)
            self.sink.write("alert", alert_rows)
            self.downtime.add_alerts(alert_rows)
        self.sink.flush()
        self.stats.hangs += len(rows)
        self._publish(alerts)

    def _account_downtime(self, now: float, every_s: float = 10.0) -> None:
        """Store the fault incidents the accountant closed (each once; the table's key drops repeats)."""
        if now < self._downtime_due:
            return
        self._downtime_due = now + every_s
        rows = self.downtime.emit(self._wall_ns())
        if rows:
            self.sink.write("downtime", downtime_table(rows))
            self.sink.flush()
            self.stats.downtime_incidents += len(rows)

    def _publish(self, alerts: list[dict]) -> None:
        for a in alerts:
            self.stats.alerts += 1
            if self.alerts_out is not None:
                self.alerts_out(a)
            if self.webhook is not None:
                self.webhook.submit(a)

    def _commit(self, now: float | None = None) -> None:
        """Store the offsets up to which every result is stored; at most once per commit interval.

        Every heartbeat advances the position, so storing on every iteration would be an insert
        several times a second per shard, for nothing: a restart re-reads from the stored offsets
        and the results' keys absorb the repeats. ``now=None`` stores regardless (stop).
        """
        # Dead letters and registrations written since the last flush are covered
        # by the offsets about to be stored: store them first.
        self.sink.flush()
        self._last_store_ok = self._clock()
        if now is not None and now < self._commit_due:
            return
        positions = self.source.positions()
        committable = self.tracker.committable(positions)
        if committable != self._committed:  # an idle shard writes nothing
            self.sink.store_offsets(self.source_id, committable)
            self._committed = committable
            if now is not None:
                self._commit_due = now + self.cfg.pipeline.commit_interval_s


def _unregistered(win: ReadyWindow, max_workers: int = 1 << 18) -> JobInfo:
    """Layout inferred from the ranks seen, for a job whose registration never came.

    Raises ValueError when the ranks imply more than ``max_workers`` workers (the caller
    stores the window as failed): a grid that large would be allocated by the analyzer.
    """
    from ingest.schema import JobLayout

    if win.ops.num_rows == 0:  # CCL records only: no worker layout to infer
        return JobInfo(job_id=win.key[0], attempt=win.key[1], layout=JobLayout(1, 1), profiled_steps=1,
                       registered=False)
    dp = int(pa.compute.max(win.ops["dp_rank"]).as_py()) + 1
    pp = int(pa.compute.max(win.ops["pp_rank"]).as_py()) + 1
    if dp * pp > max_workers:
        raise ValueError(f"unregistered job: ranks imply {dp} x {pp} workers, over validation.max_world_size "
                         f"({max_workers}); register the job")
    steps = len(set(win.ops["step"].to_pylist()))
    return JobInfo(job_id=win.key[0], attempt=win.key[1], layout=JobLayout(dp, pp), profiled_steps=steps,
                   registered=False)
