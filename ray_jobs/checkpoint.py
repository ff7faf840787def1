"""Where results become durable and offsets move: the shard's one exactly-once step.

The shard's state lives in reducers (``Reducer`` below: windows, hangs,
alerts, downtime); what they emit is a ``Unit``: rows that must be stored
before the input offsets that produced them may be stored. ``Checkpoint.commit`` is the only place that flushes the
sink and the only place that stores offsets, in this order:

1. Write every pending unit and flush, one insert per table kind. If the store
   refuses the batch, write each unit alone, so one unit the store refuses
   (a row it cannot take) does not hold the others back.
2. Run each stored unit's ``on_stored`` (a window counts as done, its alerts
   are published): never before its rows are stored.
3. Write the best-effort units (raw spans kept for drill-down): after step 2
   so alerts never wait for them; a failure costs them, nothing else.
4. When no unit is left pending: store the reducers' state when a snapshot is
   due (``ray_jobs.state.StateKeeper``), then the committable offsets, capped
   at the positions the last stored snapshot covers, with the log each was
   read from, at most once per commit interval (``force`` on stop). A restart
   restores the snapshot and re-reads from the offsets, and the tables' keys
   absorb what a replay stores twice.

A unit the store refuses ``max_attempts`` times while it answers (``probe``)
is given up: its ``give_up`` returns what to store instead (a window becomes
a failed window with the reason) or nothing (the rows are dropped, logged and
counted). A store that is down pins everything: nothing is given up, nothing
is lost, and the offsets wait. So does a refusal that says "not now"
(``core.errors.RetryLater``: a replicated shard short of its write quorum): it
is not the rows' fault.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Protocol

import pyarrow as pa

from core.errors import RetryLater
from ray_jobs.transports import OffsetStore, RecordSource, ResultSink

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Clock:
    """The shard's one source of time, injected so tests drive every reducer from one place.

    ``monotonic`` (seconds) times intervals, timeouts and due times; ``wall_ns``
    is the job clock (exporters align ranks to wall time): hang durations,
    stored timestamps and alert cool-downs are measured on it.
    """
    monotonic: Callable[[], float] = time.monotonic
    wall_ns: Callable[[], int] = time.time_ns


@dataclasses.dataclass(eq=False)
class Unit:
    """Rows that must be stored before the offsets of the input that produced them."""
    what: str
    """For logs: what these rows are (``window job/0/100``, ``3 hangs``)."""
    tables: dict[str, pa.Table]
    on_stored: Callable[[], None] | None = None
    give_up: Callable[[str], "Unit | None"] | None = None
    """What to store instead once the store refused these rows ``max_attempts`` times (None: drop them)."""
    best_effort: bool = False
    """Written after the rest, never retried and never holding offsets back (raw spans for drill-down)."""
    attempts: int = 0

    @property
    def rows(self) -> int:
        return sum(t.num_rows for t in self.tables.values())


class Reducer(Protocol):
    """Incremental state of a shard: records in, units out when due, a snapshot for status.

    The shard routes every record table of a kind in ``consumes`` to ``add``
    (input records, and the rows other reducers emit: alerts follow hangs and
    window results), asks ``due`` once per loop pass, and hands the units to
    the ``Checkpoint``. A reducer never writes to the store itself.
    """
    consumes: frozenset[str]

    def add(self, kind: str, table: pa.Table, at: tuple[tuple[str, int], int] | None, now: float) -> None: ...

    def due(self, now: float) -> list[Unit]: ...

    def snapshot(self) -> dict[str, Any]: ...


class Checkpoint:
    """Flushes pending units, then stores the offsets they cover (the module docstring has the steps)."""

    def __init__(self, results: ResultSink, offsets: OffsetStore, source: RecordSource,
                 committable: Callable[[dict], dict], source_id: str,
                 commit_interval_s: float, clock: Clock, probe: Callable[[], Any] | None = None,
                 max_attempts: int = 3, state=None):
        """``results`` and ``offsets`` are one store in production (``ResultWriter``), held by the two roles
        used here; ``source`` tells the positions read. ``state``: a ``ray_jobs.state.StateKeeper`` (None: no
        reducer state to keep, offsets uncapped)."""
        self.results = results
        self.offsets = offsets
        self.source = source
        self._committable = committable
        self.source_id = source_id
        self.commit_interval_s = commit_interval_s
        self.clock = clock
        self._probe = probe
        self.max_attempts = max_attempts
        self.state = state
        self.pending: list[Unit] = []
        self.committed: dict = {}
        self._due = 0.0
        self.commits = 0
        self.units_dropped = 0
        self.last_error = ""
        """The store's last refusal, until a write succeeds again (for the shard's status)."""
        self._down_since: float | None = None

    def add(self, unit: Unit) -> None:
        if unit.rows or unit.on_stored is not None:
            self.pending.append(unit)

    def commit(self, now: float, force: bool = False) -> None:
        required = [u for u in self.pending if not u.best_effort]
        extra = [u for u in self.pending if u.best_effort]
        self.pending = []
        stored = self._store(required)
        for u in stored:  # 2. only now are they done
            if u.on_stored is not None:
                u.on_stored()
        self._store_best_effort(extra)
        if self.pending:
            return
        positions = self.source.positions()
        if self.state is not None:
            try:  # every unit emitted so far is stored: a snapshot now hides no result
                self.state.save(now, positions, force)
            except Exception as e:  # the offsets stay where the last stored snapshot is
                self.last_error = f"store: saving the shard's state failed: {type(e).__name__}: {e}"[:500]
                log.warning("%s", self.last_error)
        if not force and now < self._due:
            return
        committable = self._committable(positions)
        if self.state is not None:
            committable = self.state.cap(committable)
        if committable != self.committed:  # an idle shard writes nothing
            logs = self.source.log_ids()
            self.offsets.store_offsets(self.source_id, committable, {tp: logs[tp] for tp in committable if tp in logs})
            self.committed = committable
            self.commits += 1
            self._due = now + self.commit_interval_s

    def _store(self, units: list[Unit]) -> list[Unit]:
        """Step 1: the units stored; the others stay pending (or are given up)."""
        if not units:
            return []
        try:
            self._write(units)
            self._back(units)
            self.last_error = ""  # the store takes writes again: the status stops showing the old failure
            return units
        except Exception as e:
            error = e
        self.last_error = f"store: {type(error).__name__}: {error}"[:500]
        # RetryLater: the store answers but cannot take writes for now (storage.errors.StoreBusy).
        if isinstance(error, RetryLater) or not self._reachable():
            # Down: everything waits as it is, and one write plus one probe per pass is all it costs
            # (a unit-by-unit retry would pay a connect timeout per unit). A refusal counts only
            # while the store answers.
            if self._down_since is None:
                self._down_since = self.clock.monotonic()
                log.warning("the store is unreachable; %d unit(s) wait, offsets are held: %s", len(units), error)
            self.pending.extend(units)
            return []
        if len(units) == 1:
            self._refused(units[0], error)
            return []
        stored = []
        for u in units:  # the store answers: one unit's rows may be what it refuses, the rest one by one
            try:
                self._write([u])
                stored.append(u)
            except Exception as e:
                self._refused(u, e)
        self._back(stored)
        if len(stored) == len(units):  # it was the batch, not a unit: nothing is refused now
            self.last_error = ""
        return stored

    def down_s(self) -> float:
        """Seconds the store has been unreachable (writes waiting on it); 0 while it takes them."""
        return 0.0 if self._down_since is None else max(0.0, self.clock.monotonic() - self._down_since)

    def windows_waiting(self) -> int:
        """Analysed windows whose results wait for the store."""
        return sum(1 for u in self.pending if "window" in u.tables)

    def _back(self, stored: list[Unit]) -> None:
        if stored and self._down_since is not None:
            log.warning("the store is back after %.0f s", self.clock.monotonic() - self._down_since)
            self._down_since = None

    def _write(self, units: list[Unit]) -> None:
        for u in units:
            for kind, table in u.tables.items():
                if table.num_rows:
                    self.results.write(kind, table)
        self.results.flush()

    def _refused(self, unit: Unit, e: Exception) -> None:
        """The store answers but refused these rows: retried, and given up after ``max_attempts``
        (retrying forever would pin the offsets)."""
        unit.attempts += 1
        log.warning("storing %s failed (attempt %d of %d): %s", unit.what, unit.attempts, self.max_attempts, e)
        if unit.attempts >= self.max_attempts:
            instead = unit.give_up(f"the store refused the results {unit.attempts} times") if unit.give_up else None
            if instead is None:
                self.units_dropped += 1
                log.error("dropped %s (%d rows): the store refused them %d times: %s",
                          unit.what, unit.rows, unit.attempts, e)
                return
            unit = instead
        self.pending.append(unit)

    def _reachable(self) -> bool:
        if self._probe is None:
            return True
        try:
            self._probe()
            return True
        except Exception:
            return False

    def _store_best_effort(self, units: list[Unit]) -> None:
        if not units:
            return
        try:
            self._write(units)
        except Exception as e:
            log.warning("storing %s failed, dropped (best effort): %s", ", ".join(u.what for u in units), e)
            return
        for u in units:
            if u.on_stored is not None:
                u.on_stored()
