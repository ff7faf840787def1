"""Per-job window state: a reducer with explicit state, no Ray, no Kafka.

The shard actor feeds decoded op-span tables in (``add_ops``), asks which
windows are ready (``ready``), hands them to the analyzers and, once their
results are stored, marks them stored (``mark_stored``). ``committable``
tells, per Kafka partition, the offset below which every record is covered by
stored results; only that offset may be committed, so a crash replays what
was not yet stored and nothing is lost.

Close policy (docs/architecture.md, "Windows and delivery"): a window is ready when
every worker (dp, pp) of the registered layout has reported the end of every
profiled step of the window (its ``optimizer`` op), or after ``idle_timeout_s``
without new records (then it is analysed as incomplete and says what is
missing). Collective records travel on their own topic and can be read after
the op spans they go with: a window whose op spans are complete also waits,
at most ``ccl_grace_s``, until every rank's collectives of its last step are
in (the link diagnosis compares each collective across all its members, and
records read after the analysis are dropped as late). Records for a window
that was already stored are late: counted and dropped. Exact duplicate ops
are dropped by the analyzer's dedup.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.registration import Registration
from core.schema import OP_SPAN
from ray_jobs.transports import TopicPartition

WindowKey = tuple[str, int, int]  # (job_id, attempt, window_id)


@dataclasses.dataclass
class OpenWindow:
    key: WindowKey
    tables: list[pa.Table] = dataclasses.field(default_factory=list)
    ccl_tables: list[pa.Table] = dataclasses.field(default_factory=list)
    tcp_tables: list[pa.Table] = dataclasses.field(default_factory=list)
    n_rows: int = 0
    first_offset: dict[TopicPartition, int] = dataclasses.field(default_factory=dict)
    step_ends: set = dataclasses.field(default_factory=set)  # (dp, pp, step) with an optimizer op
    steps: set = dataclasses.field(default_factory=set)
    ccl_ranks_at: dict = dataclasses.field(default_factory=dict)  # step -> ranks with collective records of it
    tcp_ranks_at: dict = dataclasses.field(default_factory=dict)  # step -> ranks with TCP connection records of it
    ops_complete_at: float | None = None  # when the op spans were first seen complete
    last_seen: float = 0.0
    dispatched: bool = False


def _ranks_by_step(part: pa.Table, into: dict) -> None:
    """Add the ranks that have records of each step in ``part`` to ``into`` (step -> set of ranks)."""
    steps = part["step"].to_numpy()
    ranks = part["rank"].to_numpy()
    for step in np.unique(steps).tolist():
        into.setdefault(step, set()).update(np.unique(ranks[steps == step]).tolist())


@dataclasses.dataclass(frozen=True)
class ReadyWindow:
    key: WindowKey
    ops: pa.Table
    complete: bool
    note: str
    ccl: pa.Table | None = None
    tcp: pa.Table | None = None


@dataclasses.dataclass
class WindowCounters:
    records: int = 0
    late_records: int = 0


class WindowTracker:
    """All open windows of the jobs one shard owns.

    ``is_stored(key)`` is consulted the first time a window key is seen, so a
    restarted shard that replays records of an already stored window drops
    them as late instead of storing a partial re-analysis over a good one.
    """

    def __init__(self, idle_timeout_s: float = 30.0, is_stored: Callable[[WindowKey], bool] | None = None,
                 max_stored_keys: int = 200_000, ccl_grace_s: float = 5.0):
        self.idle_timeout_s = idle_timeout_s
        self.ccl_grace_s = ccl_grace_s
        self._ccl_jobs: set[tuple[str, int]] = set()  # (job, attempt) that sent collective records
        self._is_stored = is_stored or (lambda key: False)
        self.jobs: dict[tuple[str, int], Registration] = {}
        self.open: dict[WindowKey, OpenWindow] = {}
        self._stored: dict[WindowKey, None] = {}  # insertion-ordered, bounded
        self._max_stored = max_stored_keys
        self.counters = WindowCounters()

    # -- input --------------------------------------------------------------
    def register(self, info: Registration) -> None:
        self.jobs[(info.job_id, info.attempt)] = info

    def add_ops(self, table: pa.Table, tp: TopicPartition, offset: int, now: float) -> None:
        """Route one decoded op-span table (possibly several jobs and windows)."""
        parts = _split_by_window(table)
        stored = self._stored_among([key for key, _ in parts])
        self.counters.records += table.num_rows
        for key, part in parts:
            self._add(key, part, tp, offset, now, key in stored)

    def add_ccl(self, table: pa.Table, tp: TopicPartition, offset: int, now: float) -> None:
        """Route CCL records of profiled windows (``window_id >= 0``) for link diagnosis."""
        table = table.filter(pc.greater_equal(table["window_id"], 0))
        parts = _split_by_window(table)
        stored = self._stored_among([key for key, _ in parts])
        for key, part in parts:
            win = self._open(key, part.num_rows, tp, offset, now, key in stored)
            if win is not None:
                win.ccl_tables.append(part)
                self._ccl_jobs.add(key[:2])
                _ranks_by_step(part, win.ccl_ranks_at)

    def add_tcp(self, table: pa.Table, tp: TopicPartition, offset: int, now: float) -> None:
        """Route TCP connection records of profiled windows for link diagnosis (they travel with the collectives,
        so a window that waits for its collectives has them too)."""
        table = table.filter(pc.greater_equal(table["window_id"], 0))
        parts = _split_by_window(table)
        stored = self._stored_among([key for key, _ in parts])
        for key, part in parts:
            win = self._open(key, part.num_rows, tp, offset, now, key in stored)
            if win is not None:
                win.tcp_tables.append(part)
                _ranks_by_step(part, win.tcp_ranks_at)

    def _stored_among(self, keys: list[WindowKey]) -> set[WindowKey]:
        """The keys whose windows are stored already, asking ``is_stored`` about keys never seen.

        Asked for all keys of a table before any state changes: when the store cannot
        answer, the error leaves the tracker as it was and the record can be handled again.
        """
        return {k for k in keys if k not in self.open and (k in self._stored or self._is_stored(k))}

    def _open(self, key: WindowKey, n_rows: int, tp: TopicPartition, offset: int, now: float,
              stored: bool) -> OpenWindow | None:
        """The open window that takes ``n_rows`` records of ``key`` (opened now if new), with its
        bookkeeping done; None when the records are late (counted, to be dropped)."""
        win = self.open.get(key)
        if win is None:
            if stored:
                self._remember_stored(key)
                self.counters.late_records += n_rows
                return None
            win = self.open[key] = OpenWindow(key)
        elif win.dispatched:
            # Arrived after the window was handed to the analyzer: late.
            self.counters.late_records += n_rows
            return None
        win.n_rows += n_rows
        win.first_offset.setdefault(tp, offset)
        win.last_seen = now
        return win

    def _add(self, key: WindowKey, part: pa.Table, tp: TopicPartition, offset: int, now: float,
             stored: bool) -> None:
        win = self._open(key, part.num_rows, tp, offset, now, stored)
        if win is None:
            return
        win.tables.append(part)
        steps = part["step"].to_numpy()
        win.steps.update(np.unique(steps).tolist())
        opt = pc.equal(part["optype"], "optimizer").to_numpy(zero_copy_only=False)
        if opt.any():
            dp = part["dp_rank"].to_numpy()[opt]
            pp = part["pp_rank"].to_numpy()[opt]
            win.step_ends.update(zip(dp.tolist(), pp.tolist(), steps[opt].tolist()))

    # -- output -------------------------------------------------------------
    def job(self, job_id: str, attempt: int) -> Registration | None:
        return self.jobs.get((job_id, attempt))

    def ready(self, now: float) -> list[ReadyWindow]:
        """Windows to analyse now; each is returned once (then marked dispatched)."""
        out = []
        for key, win in self.open.items():
            if win.dispatched:
                continue
            info = self.jobs.get(key[:2])
            complete, note = self._completeness(win, info)
            idle = now - win.last_seen >= self.idle_timeout_s
            if complete and not idle and not self._collectives_in(win, info, now):
                continue
            if complete or idle:
                win.dispatched = True
                ops = pa.concat_tables(win.tables) if win.tables else OP_SPAN.empty_table()
                win.tables = [ops]
                ccl = pa.concat_tables(win.ccl_tables) if win.ccl_tables else None
                tcp = pa.concat_tables(win.tcp_tables) if win.tcp_tables else None
                out.append(ReadyWindow(key, ops, complete, "" if complete else f"closed on idle timeout: {note}",
                                       ccl, tcp))
        return out

    def _completeness(self, win: OpenWindow, info: Registration | None) -> tuple[bool, str]:
        if info is None:
            return False, "job never registered"
        want_steps = info.profiled_steps
        if len(win.steps) < want_steps:
            return False, f"{len(win.steps)} of {want_steps} steps seen"
        need = info.layout.n_workers * len(win.steps)
        if len(win.step_ends) < need:
            return False, f"{need - len(win.step_ends)} of {need} worker-steps did not finish"
        return True, ""

    def _collectives_in(self, win: OpenWindow, info: Registration, now: float) -> bool:
        """Whether the window may go to the analysis as far as its collective records are concerned: every
        rank has some of its last step, or ``ccl_grace_s`` passed since its op spans were complete. Only
        windows of jobs that send collective records wait (replays, imports and hand-instrumented loops
        without ``instrument_distributed`` send none); a rank without collectives in the last step costs
        its window the grace.

        The TCP connection records of a step are read and sent by each exporter's own thread after the step's
        collectives (``ingest.exporter``), so they can come later still: within the same grace, every rank
        that sent TCP records for an earlier step of the window must have sent some for its last step too.
        Found on a real 8-rank run on the loaded 2-core VM: window 6 analysed without rank 7's last step of TCP
        records stated a capped NIC at 0.47 (0.97 with them), under what is printed."""
        if not win.ccl_ranks_at and win.key[:2] not in self._ccl_jobs:
            return True
        if win.ops_complete_at is None:
            win.ops_complete_at = now
        if now - win.ops_complete_at >= self.ccl_grace_s:
            return True
        last = max(win.steps)
        if len(win.ccl_ranks_at.get(last, ())) < info.n_gpus:
            return False
        tcp_ranks = set().union(*(r for step, r in win.tcp_ranks_at.items() if step < last))
        return tcp_ranks <= win.tcp_ranks_at.get(last, set())

    def mark_stored(self, key: WindowKey) -> None:
        self.open.pop(key, None)
        self._remember_stored(key)

    def _remember_stored(self, key: WindowKey) -> None:
        self._stored[key] = None
        if len(self._stored) > self._max_stored:
            self._stored.pop(next(iter(self._stored)))

    def committable(self, positions: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Per partition: the offset up to which every record's results are stored.

        ``positions`` is the next offset the consumer will read per partition.
        """
        out = dict(positions)
        for win in self.open.values():
            for tp, off in win.first_offset.items():
                if tp in out and off < out[tp]:
                    out[tp] = off
        return out

    def forget_partition(self, tp: TopicPartition) -> None:
        """Open windows hold back no offset of ``tp`` any more: its log was lost and it is read anew from the
        start of another (their rows are kept and analysed; only a crash before they are stored loses them)."""
        for win in self.open.values():
            win.first_offset.pop(tp, None)

    def buffered_rows(self) -> int:
        return sum(w.n_rows for w in self.open.values())


def _split_by_window(table: pa.Table) -> list[tuple[WindowKey, pa.Table]]:
    """(window key, rows) for each (job_id, attempt, window_id) in ``table``; one pass when there is one key."""
    if table.num_rows == 0:
        return []
    keys = pa.Table.from_arrays(
        [table["job_id"], table["attempt"], table["window_id"]], names=["j", "a", "w"]
    ).group_by(["j", "a", "w"]).aggregate([])
    if keys.num_rows == 1:
        return [((keys["j"][0].as_py(), keys["a"][0].as_py(), keys["w"][0].as_py()), table)]
    parts = []
    for j, a, w in zip(keys["j"].to_pylist(), keys["a"].to_pylist(), keys["w"].to_pylist()):
        mask = pc.and_(pc.and_(pc.equal(table["job_id"], j), pc.equal(table["attempt"], a)),
                       pc.equal(table["window_id"], w))
        parts.append(((j, a, w), table.filter(mask)))
    return parts
