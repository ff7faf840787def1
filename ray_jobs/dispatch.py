"""Windows of op spans to the what-if analysis and back: the shard's window reducer.

Op spans and CCL records are added to the ``WindowTracker``; ``due(now)``
hands each window that is ready (complete, or idle past the timeout) to the
analysis (Ray tasks, at most ``max_inflight`` at once: at the limit the shard
stops polling, which is the backpressure) and emits each finished analysis as
a unit of result tables. Only when the unit is stored does the window count
as done (``mark_stored``), which lets the offsets of its records be stored.

A window that cannot be submitted, whose task died after Ray's retries, or
whose results the store keeps refusing becomes a failed window with the
reason: visible, and never pinning the offsets.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import pyarrow as pa

from analyzers.links.history import FindingHistory, found_in
from analyzers.recovery_basis import RecoveryBasis
from analyzers.window import WindowContext, WindowResult, analyze_window_for_shard, failed_window, records_span
from core.config import PipelineConfig
from core.errors import RetryLater
from core.layout import JobLayout
from core.registration import Registration
from ray_jobs.checkpoint import Clock, Unit
from ray_jobs.windows import ReadyWindow, WindowTracker

log = logging.getLogger(__name__)


UNSIZED_INFLIGHT = 2
"""In-flight limit when ``max_inflight`` is 0 (auto) and no pipeline sized it from Ray's CPUs (a bare shard)."""


class WindowReducer:
    consumes = frozenset({"job", "op_span", "ccl_record", "tcp_flow"})

    def __init__(self, cfg: PipelineConfig, clock: Clock, is_stored: Callable[[tuple], bool],
                 submit: Callable[..., Any] | None = None, max_world_size: int = 1 << 18, name: str = "shard",
                 gpu_of: Callable[[str, int], dict[int, dict]] | None = None):
        """``gpu_of(job, attempt)``: the latest GPU sample of each of its ranks (``HangReducer.gpu_of``), which a
        slow worker's verdict is compared with (``analyzers.hardware``); None: no hardware evidence. It goes to
        the analysis with what the job's window before found (``WindowContext``): the result comes back final."""
        self.cfg = cfg
        self._gpu_of = gpu_of
        # Set by the shard: where each rank of a job runs (``HangReducer.hosts_of``) and the port counters of
        # hosts over a span (``PortCounterReducer.ports_of``): a link finding's fabric evidence.
        self.hosts_of: Callable[[str, int], dict[int, str]] | None = None
        self.ports_of: Callable[..., list[dict]] | None = None
        self.clock = clock
        self._is_stored = is_stored
        self.tracker = WindowTracker(cfg.idle_timeout_s, is_stored=self._ask_store, ccl_grace_s=cfg.ccl_grace_s)
        self._submit = submit
        self.max_world_size = max_world_size
        self.name = name
        self.inflight: list[tuple[Any, ReadyWindow, float]] = []
        # (job, attempt) -> its ready windows waiting for its earlier one in flight: a job's windows are analysed
        # one after another, so that each is analysed knowing what the one before found (many are ready at once
        # when a shard catches up; jobs run in parallel).
        self._queued: dict[tuple[str, int], list[ReadyWindow]] = {}
        # (job, attempt) -> (start_ns, verdict) of the last window whose spans were kept.
        self._spans_kept: dict[tuple[str, int], tuple[int, str]] = {}
        self._findings = FindingHistory()
        # (job, attempt) -> what a recovery plan needs of its latest window analysed whole (most recent last)
        self._recovery: dict[tuple[str, int], RecoveryBasis] = {}
        self.max_recovery_jobs = 20_000
        self.stored = self.failed = self.spans_kept = 0
        self.dispatch_to_stored_seconds = self.latency_last_s = 0.0

    # -- input ----------------------------------------------------------------
    def add(self, kind: str, table: pa.Table, at: tuple[tuple[str, int], int] | None, now: float) -> None:
        if kind == "job":
            for row in table.to_pylist():
                self.tracker.register(Registration.from_row(row))
        elif kind == "op_span":
            self.tracker.add_ops(table, at[0], at[1], now)
        elif kind == "ccl_record":
            self.tracker.add_ccl(table, at[0], at[1], now)
        elif kind == "tcp_flow":
            self.tracker.add_tcp(table, at[0], at[1], now)

    def _ask_store(self, key: tuple) -> bool:
        """Whether a window first seen now was stored before (a replay after a restart drops its records)."""
        try:
            return self._is_stored(key)
        except Exception as e:  # the store cannot answer: the record waits, it is not bad input
            raise RetryLater(f"store: cannot tell whether window {key} is stored: {type(e).__name__}: {e}") from e

    def busy(self) -> bool:
        """At the in-flight or buffered-rows limit: the shard stops polling until analyses finish."""
        return (self._pending() >= (self.cfg.max_inflight or UNSIZED_INFLIGHT)
                or self.tracker.buffered_rows() >= self.cfg.max_buffered_rows)

    # -- output ---------------------------------------------------------------
    def due(self, now: float) -> list[Unit]:
        """Dispatch the ready windows; the finished analyses as units (waiting up to 0.5 s when busy)."""
        block = self.busy()
        for win in sorted(self.tracker.ready(now), key=lambda w: w.key):
            job = win.key[:2]
            if job in self._queued or any(w.key[:2] == job for _, w, _ in self.inflight):
                self._queued.setdefault(job, []).append(win)
            else:
                self._dispatch(win)
        if not self.inflight:
            return []
        done, self.inflight = resolve_ready(self.inflight, timeout_s=0.5 if block else 0.0)
        units = []
        for (got, err), win, t0 in done:
            tables = got  # a bare table dict: a test's analysis
            if isinstance(got, WindowResult):
                tables = got.tables
                if got.recovery is not None:
                    self._keep_recovery(win.key[:2], got.recovery)
            if tables is None:
                # The task died after Ray's own retries (worker killed, OOM): store the
                # failure so the window is visible and its offsets can advance.
                log.warning("analysis task for %s failed: %s", win.key, err)
                tables = self._failed(win, f"analysis task failed: {err}")
            self._findings.record(win.key, found_in(tables.get("link_fault")))
            units.append(self._unit(tables, win, t0))
            waiting = self._queued.get(win.key[:2])
            if waiting:
                self._dispatch(waiting.pop(0))  # the job's next window, knowing what this one found
                if not waiting:
                    del self._queued[win.key[:2]]
            spans = self._spans_worth_keeping(tables, win)
            if spans is not None:
                units.append(spans)
        return units

    def _keep_recovery(self, job: tuple[str, int], basis: RecoveryBasis) -> None:
        self._recovery.pop(job, None)
        self._recovery[job] = basis
        if len(self._recovery) > self.max_recovery_jobs:  # bounded: the job heard of least recently goes
            del self._recovery[next(iter(self._recovery))]

    def recovery_of(self, job_id: str, attempt: int) -> RecoveryBasis | None:
        """What a recovery plan needs of the job's latest window analysed whole (``HangReducer``: a node loss's
        plan), or None."""
        return self._recovery.get((job_id, attempt))

    def state(self) -> dict:
        """What a restarted shard resumes from (``ray_jobs.state``): the link findings' history and the recovery
        basis per job, as plain data. The open windows need none: their records are read again from the stored
        offsets."""
        return {"findings": self._findings.state(),
                "recovery": [[list(job), basis.to_dict()] for job, basis in self._recovery.items()]}

    def restore(self, state: dict) -> None:
        self._findings.restore(state.get("findings", {}))
        self._recovery = {tuple(job): RecoveryBasis.from_dict(d) for job, d in state.get("recovery", [])}

    def snapshot(self) -> dict:
        c = self.tracker.counters
        return dict(inflight=self._pending(), open_windows=len(self.tracker.open),
                    buffered_rows=self.tracker.buffered_rows(), windows_stored=self.stored,
                    windows_failed=self.failed, span_windows_kept=self.spans_kept,
                    dispatch_to_stored_seconds=self.dispatch_to_stored_seconds,
                    window_latency_s_last=self.latency_last_s,
                    records=c.records, late_records=c.late_records)

    def _pending(self) -> int:
        """Windows handed to the analysis and not back yet, and those waiting for their job's earlier one."""
        return len(self.inflight) + sum(map(len, self._queued.values()))

    def job(self, job_id: str, attempt: int) -> Registration | None:
        return self.tracker.job(job_id, attempt)

    def committable(self, positions: dict) -> dict:
        return self.tracker.committable(positions)

    # -- inside -----------------------------------------------------------------
    def _dispatch(self, win: ReadyWindow) -> None:
        """Hand a ready window to the analyzer; a window that cannot even be submitted is stored as failed."""
        t0 = self.clock.monotonic()
        try:
            info = self.tracker.job(win.key[0], win.key[1]) or unregistered(win, self.max_world_size)
            args = (win.ops, info, win.key, win.complete, win.note, win.ccl, win.tcp, self._context(win))
            handle = self._submit(*args) if self._submit else analyze_window_for_shard(*args)
        except Exception as e:
            log.warning("%s: dispatching %s failed: %s", self.name, win.key, e)
            handle = self._failed(win, f"dispatch failed: {type(e).__name__}: {e}")
        self.inflight.append((handle, win, t0))

    def _context(self, win: ReadyWindow) -> WindowContext:
        """What this shard knows of the window's job beyond its records: its ranks' latest GPU samples (they live
        in the shard's hang reducer) and what its latest analysed window before found. Never fails the window:
        without them it is analysed alone."""
        samples = {}
        if self._gpu_of is not None and win.ops.num_rows:
            try:
                samples = self._gpu_of(win.key[0], win.key[1])
            except Exception as e:  # evidence is a bonus
                log.warning("%s: the GPU samples of %s could not be read: %s", self.name, win.key, e)
        hosts, ports = {}, ()
        has_links = (win.ccl is not None and win.ccl.num_rows) or (win.tcp is not None and win.tcp.num_rows)
        if has_links and self.hosts_of is not None and self.ports_of is not None:
            try:
                hosts = self.hosts_of(win.key[0], win.key[1])
                # Only the readings over the window's own records travel with the task (the reducer keeps
                # 15 minutes of every host's ports; the evidence reads the window's span alone).
                ports = tuple(self.ports_of(set(hosts.values()), *records_span(win.ccl, win.tcp))) if hosts else ()
            except Exception as e:  # evidence is a bonus
                log.warning("%s: the port counters of %s could not be read: %s", self.name, win.key, e)
                hosts, ports = {}, ()
        return WindowContext(gpu_samples=samples or {}, prior=self._findings.before(win.key), rank_hosts=hosts,
                             port_rows=ports)

    def _unit(self, tables: dict[str, pa.Table], win: ReadyWindow, t0: float) -> Unit:
        def stored():
            self.tracker.mark_stored(win.key)
            self.stored += 1
            took = self.clock.monotonic() - t0
            self.dispatch_to_stored_seconds += took
            self.latency_last_s = took

        def give_up(reason: str) -> Unit:
            return self._unit(self._failed(win, reason), win, t0)
        return Unit(f"window {win.key}", tables, on_stored=stored, give_up=give_up)

    def _failed(self, win: ReadyWindow, reason: str) -> dict[str, pa.Table]:
        """The tables of a window that could not be analysed or stored, with the reason (never raises)."""
        self.failed += 1
        try:
            info = self.tracker.job(win.key[0], win.key[1]) or unregistered(win, self.max_world_size)
        except Exception:
            info = _layoutless(win)
        return failed_window(win.ops, info, win.key, reason)

    def _spans_worth_keeping(self, tables: dict[str, pa.Table], win: ReadyWindow) -> Unit | None:
        """Raw spans of a window worth drilling into, for the console's timeline and `advise`.

        Kept: a window with a link fault; a window with a verdict when its job kept none within
        ``keep_op_spans_every_s`` of its own clock before, or kept one with another verdict. Raw spans
        are most of what a fleet writes (46M of 48M rows in a soak of 1,000 jobs), and one recent
        window per job and cause is what a drill-down needs. A best-effort unit: stored after the
        results so alerts never wait for it, and a failure costs the drill-down, not the window.
        """
        if not 0 < win.ops.num_rows <= self.cfg.keep_op_spans_max_rows:
            return None
        result = tables["window"]
        verdict = result["verdict"][0].as_py()
        link = "link_fault" in tables and tables["link_fault"].num_rows > 0
        if verdict in ("", "none") and not link:
            return None
        start = int(result["start_ns"][0].as_py())
        last = self._spans_kept.get(win.key[:2])
        every_ns = int(self.cfg.keep_op_spans_every_s * 1e9)
        if not link and every_ns > 0 and last is not None and last[1] == verdict and 0 <= start - last[0] < every_ns:
            return None
        self._spans_kept[win.key[:2]] = (start, verdict)

        def stored():
            self.spans_kept += 1
        return Unit(f"op spans of {win.key}", {"op_span": win.ops}, on_stored=stored, best_effort=True)


def _layoutless(win: ReadyWindow) -> Registration:
    """A stand-in registration of one worker, for a window whose layout cannot be told."""
    return Registration(job_id=win.key[0], attempt=win.key[1], layout=JobLayout(1, 1), profiled_steps=1,
                        registered=False)


def unregistered(win: ReadyWindow, max_workers: int = 1 << 18) -> Registration:
    """Layout inferred from the ranks seen, for a job whose registration never came.

    Raises ValueError when the ranks imply more than ``max_workers`` workers (the caller
    stores the window as failed): a grid that large would be allocated by the analyzer.
    """
    if win.ops.num_rows == 0:  # CCL records only: no worker layout to infer
        return _layoutless(win)
    dp = int(pa.compute.max(win.ops["dp_rank"]).as_py()) + 1
    pp = int(pa.compute.max(win.ops["pp_rank"]).as_py()) + 1
    if dp * pp > max_workers:
        raise ValueError(f"unregistered job: ranks imply {dp} x {pp} workers, over validation.max_world_size "
                         f"({max_workers}); register the job")
    steps = len(set(win.ops["step"].to_pylist()))
    return Registration(job_id=win.key[0], attempt=win.key[1], layout=JobLayout(dp, pp), profiled_steps=steps,
                        registered=False)


def resolve_ready(inflight: list[tuple[Any, Any, float]], timeout_s: float):
    """Split in-flight analyses into (done, pending).

    Each entry is (handle, window, t0). A handle is either a Ray ObjectRef or
    an already computed result (the shard ran the analysis inline). Done
    entries come back as ((tables, error), window, t0); ``tables`` is None when
    the task failed for good.
    """
    refs = [h for h, _, _ in inflight if _is_ref(h)]
    ready_ids: set = set()
    if refs:
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ready_ids = {r.hex() for r in ready}
    done, pending = [], []
    for entry in inflight:
        h, win, t0 = entry
        if not _is_ref(h):
            done.append(((h, None), win, t0))
        elif h.hex() in ready_ids:
            import ray

            try:
                done.append(((ray.get(h), None), win, t0))
            except Exception as e:  # task died after its retries (killed worker, OOM)
                done.append(((None, f"{type(e).__name__}: {str(e)[:300]}"), win, t0))
        else:
            pending.append(entry)
    return done, pending


def _is_ref(h: Any) -> bool:
    """Whether ``h`` is a Ray task's result to wait for (Ray is imported only where tasks run)."""
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(h, ray.ObjectRef)
