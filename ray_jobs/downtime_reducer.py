"""Fault downtime inside a shard: the accountant of ``analyzers.downtime`` as a reducer.

Registrations, checkpoints and heartbeats come from the input; hangs and
their alerts from the other reducers. Every ``every_s`` the incidents the
accountant closed are emitted as one unit of DOWNTIME rows (each once; the
table's key drops what a replay emits again).
"""
from __future__ import annotations

import pyarrow as pa

from analyzers.downtime import DowntimeAccountant, to_tables
from ray_jobs.checkpoint import Clock, Unit


class DowntimeReducer:
    consumes = frozenset({"job", "checkpoint", "heartbeat", "hang", "alert"})

    def __init__(self, clock: Clock, every_s: float = 10.0, accountant: DowntimeAccountant | None = None):
        self.clock = clock
        self.every_s = every_s
        self.accountant = accountant or DowntimeAccountant()
        self._due = 0.0
        self.incidents = 0  # stored

    def add(self, kind: str, table: pa.Table, at=None, now: float = 0.0) -> None:
        self.accountant.add(table, kind)

    def due(self, now: float) -> list[Unit]:
        if now < self._due:
            return []
        self._due = now + self.every_s
        rows = self.accountant.emit(self.clock.wall_ns())
        if not rows:
            return []

        def stored(n=len(rows)):
            self.incidents += n
        return [Unit(f"{len(rows)} downtime incident(s)", to_tables(rows), on_stored=stored)]

    def state(self):
        """What a restarted shard resumes from (``ray_jobs.state``): the accountant with its open incidents."""
        return self.accountant.state()

    def restore(self, state) -> None:
        self.accountant.restore(state)  # its settings are this process's

    def snapshot(self) -> dict:
        return dict(downtime_incidents=self.incidents)
