"""Hosts' port counters inside a shard: summed into a row a minute per port for the store, the recent ones kept.

A reducer (``ray_jobs.checkpoint.Reducer``). The exporters send a row per port
with every heartbeat (2 s); a fleet of 1,000 hosts of 8 ports would store 4,000
rows a second. Differences add up, so the rows of each (job attempt, host,
device, port) are summed (``analyzers.fabric.merge``) and stored every
``every_s``: nothing of the errors or waits is lost, only their timing finer
than a minute. The raw rows of the last ``keep_s`` stay here per host
(``ports_of``), for the evidence of a window's link findings
(``analyzers.fabric.with_fabric_evidence``), which needs the window's own span.

The sums waiting for their minute are not part of the shard's saved state: a
shard that restarts loses at most a minute of them.
"""
from __future__ import annotations

import collections
import json
from typing import Iterable

import pyarrow as pa

from analyzers.fabric import COUNTS, merge
from core import codec
from core import schema as S
from ray_jobs.checkpoint import Unit


class PortCounterReducer:
    consumes = frozenset({"port_counter"})

    def __init__(self, every_s: float = 60.0, keep_s: float = 900.0, max_rows_per_host: int = 4096,
                 max_hosts: int = 100_000):
        self.every_s = every_s
        self.keep_ns = int(keep_s * 1e9)
        self.max_rows_per_host = max_rows_per_host
        self.max_hosts = max_hosts
        self._pending: dict[tuple, list[dict]] = {}
        self._recent: dict[str, collections.deque] = {}
        self._next = 0.0
        self.stored_rows = 0

    def add(self, kind: str, table: pa.Table, at=None, now: float = 0.0) -> None:
        if at is None:  # our own summed rows, fed back by the shard once emitted: they are not new input
            return
        for row in table.to_pylist():
            key = (row["job_id"], row["attempt"], row["host"], row["device"], row["port"])
            self._pending.setdefault(key, []).append(row)
            recent = self._recent.get(row["host"])
            if recent is None:
                if len(self._recent) >= self.max_hosts:  # bounded: the host heard from longest ago goes
                    del self._recent[next(iter(self._recent))]
                recent = self._recent[row["host"]] = collections.deque(maxlen=self.max_rows_per_host)
            recent.append(row)
            while recent and recent[0]["ts_ns"] < row["ts_ns"] - self.keep_ns:
                recent.popleft()

    def ports_of(self, hosts: Iterable[str], start_ns: int | None = None, end_ns: int | None = None) -> list[dict]:
        """The raw rows kept of ``hosts`` that overlap (start_ns, end_ns) (each covers ts_ns - elapsed_ns to ts_ns):
        what ``analyzers.fabric.with_fabric_evidence`` takes for a window."""
        out = []
        for host in set(hosts):
            for r in self._recent.get(host, ()):
                if (start_ns is None or r["ts_ns"] > start_ns) and \
                        (end_ns is None or r["ts_ns"] - r["elapsed_ns"] < end_ns):
                    out.append(r)
        return out

    def _summed(self, key: tuple, rows: list[dict]) -> dict:
        m = merge(rows)
        last = max(rows, key=lambda r: r["ts_ns"])
        return dict({c: m[c] for c in COUNTS}, job_id=key[0], attempt=key[1], rank=last["rank"], host=key[2],
                    device=key[3], port=key[4], ts_ns=m["ts_ns"], elapsed_ns=m["elapsed_ns"], state=m["state"],
                    hw_counters_json=json.dumps(dict(sorted(m["hw"].items())), separators=(",", ":")),
                    reset=m["reset"])

    def due(self, now: float) -> list[Unit]:
        """Every port's sum since the last unit, once per ``every_s``."""
        if now < self._next or not self._pending:
            return []
        self._next = now + self.every_s
        pending, self._pending = self._pending, {}
        table = codec.from_rows(S.PORT_COUNTER, [self._summed(k, rows) for k, rows in pending.items()])

        def stored(n=table.num_rows):
            self.stored_rows += n
        return [Unit(f"{table.num_rows} port counter row(s)", {"port_counter": table}, on_stored=stored)]

    def snapshot(self) -> dict:
        return {}
