"""The shard's result sink: result tables batched per kind, written through the storage API.

``ResultWriter.write`` only buffers; ``flush()`` returns only once everything
written is stored. Offsets, registrations and shard state go straight
through. Clients are created in ``setup()``, as for the source
(docs/architecture.md, "Conventions" 4). ``ray_jobs.transports.ResultSink`` is the
contract.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import pyarrow as pa

from ray_jobs.transports import TopicPartition

log = logging.getLogger(__name__)

# A flush longer than this holds up the shard loop (hang checks included): it is logged per table.
SLOW_FLUSH_S = 1.0


class ResultWriter:
    """Batches result tables per kind and writes them through ``storage``.

    ``write`` only buffers; ``flush`` writes every buffered kind (one insert
    each) and returns once the store has them. Offsets and job registrations
    go straight through: they are small and their order matters.
    """

    def __init__(self, store_url: str, open_store: Callable[[str], Any] | None = None, store=None):
        # ``open_store`` is injected (``storage.open_store`` in production): ray_jobs depends on
        # the Store API, not on the storage package (README, "Layers").
        self.store_url = store_url
        self._open_store = open_store
        self._store = store
        self._buf: dict[str, list[pa.Table]] = {}

    def setup(self) -> None:
        if self._store is None:
            if self._open_store is None:
                raise ValueError("ResultWriter needs open_store or an opened store")
            self._store = self._open_store(self.store_url)
        self._store.setup()

    @property
    def store(self):
        return self._store

    def write(self, kind: str, table: pa.Table) -> None:
        if table.num_rows:
            self._buf.setdefault(kind, []).append(table)

    def flush(self) -> None:
        """Insert everything buffered. On failure the buffer is discarded and the error raised:
        the caller retries the whole window, and the store's idempotent keys absorb what was
        already inserted."""
        buf, self._buf = self._buf, {}
        # The window row goes last: once it is stored the window counts as done
        # (``window_stored``), so a crash mid-flush re-analyses the window.
        took = []
        for kind in sorted(buf, key=lambda k: k == "window"):
            tables = buf[kind]
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
            t0 = time.perf_counter()
            self._store.insert(kind, table)
            took.append((kind, table.num_rows, time.perf_counter() - t0))
        if sum(t for _, _, t in took) > SLOW_FLUSH_S:
            log.warning("slow store flush: %s", ", ".join(f"{k} {n} rows {t:.2f} s" for k, n, t in took))

    def window_stored(self, key) -> bool:
        return self._store.window_stored(key)

    def load_offsets(self, source_id: str, topics, partitions) -> dict[TopicPartition, int]:
        return self._store.load_offsets(source_id, topics, partitions)

    def store_offsets(self, source_id: str, offsets: dict[TopicPartition, int],
                      log_ids: dict[TopicPartition, str] | None = None) -> None:
        self._store.store_offsets(source_id, offsets, log_ids)

    def load_offset_logs(self, source_id: str, topics, partitions) -> dict[TopicPartition, str]:
        return self._store.load_offset_logs(source_id, topics, partitions)

    def store_state(self, source_id: str, shard: str, fmt: int, state: bytes) -> None:
        self._store.store_state(source_id, shard, fmt, state)

    def load_state(self, source_id: str, shard: str) -> tuple[int, bytes] | None:
        return self._store.load_state(source_id, shard)

    def load_jobs(self) -> list[dict]:
        return self._store.load_jobs()

    def close(self) -> None:
        self.flush()
        if self._store is not None:
            self._store.close()
