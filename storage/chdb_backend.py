"""The embedded backend: chDB (ClickHouse engine 26.x in this process), data under a path.

chDB allows one data path per process, and one process per path. Here:

- Stores of the same path in one process share one chDB session and one
  lock (every call is serialised: chDB is not used from two threads at once).
- Opening a second path while one is open raises StoreError.
- A process that opens a path holds an exclusive ``flock`` on ``PATH/.lock``
  for as long as it has it open; another process gets StoreError naming the
  holder's pid. To share a path between processes, serve it with the store
  daemon (``storage.daemon``); ``open_store("chdb://PATH")`` finds a running
  daemon by its discovery file and talks to it instead.

Inserts pass Arrow tables straight to the engine through chDB's ``Python()``
table function; parameters are bound by the engine (``{name:Type}``).

Free SQL (``Store.query``) runs in a second chDB session of the same path,
beside the writes and outside their lock: a long free query never holds up
the pipeline's inserts and offset commits. That session is read-only at the
session level (``SET readonly = 1`` after its limits, so a query can neither
write nor change them); free queries take their own lock and run one at a
time (a second waits at most its time limit). Sessions are kept per set of
limits (a few).
"""
from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa

from storage import ddl
from storage.errors import StoreError, first_line
from storage.keys import HighWater
from storage.sandbox import SQLLimits, limit_error, limited
from storage.sqltext import WRAPPABLE, replace_identifier
from storage.store import SQLStore

DATABASE = "stragglerscope"
LOCK_FILE = ".lock"
MAX_READERS = 4


class _Shared:
    """One chDB session of this process, with its lock and the path lock file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.refs = 0
        self.lock = threading.RLock()
        self.read_lock = threading.Lock()  # free SQL: one query at a time, beside the writes
        self._readers: dict[SQLLimits, object] = {}
        # Every writer of this path goes through this process (the flock below), so the marks are exact.
        self.high_water = HighWater()
        Path(path).mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            raise StoreError(f"chDB path {path} is in use by process {holder}; chDB allows one process per path: "
                             f"serve it with `stragglerscope store` and open http://127.0.0.1:PORT") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, str(os.getpid()).encode(), 0)
        try:
            from chdb import session as chdb_session

            self.session = chdb_session.Session(path)
            self.session.query(f"CREATE DATABASE IF NOT EXISTS {DATABASE}")
            self.session.query(f"USE {DATABASE}")
            # Exact because inserts check keys under this process's lock (see storage.store).
            self.session.query("SET do_not_merge_across_partitions_select_final = 1")
            self.version = str(self.session.query("SELECT version()", "CSV")).strip().strip('"')
        except StoreError:
            self._unlock()
            raise
        except Exception as e:
            self._unlock()
            raise StoreError(f"cannot open chDB at {path}: {first_line(e)}") from e

    def _unlock(self) -> None:
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)

    def reader(self, limits: SQLLimits):
        """The read-only session for free SQL within ``limits`` (the caller holds ``read_lock``)."""
        session = self._readers.pop(limits, None)
        if session is None:
            from chdb import session as chdb_session

            session = chdb_session.Session(self.path)
            try:
                session.query(f"USE {DATABASE}")
                session.query("SET do_not_merge_across_partitions_select_final = 1")
                for name, value in limits.settings().items():
                    session.query(f"SET {name} = {int(value)}")
                session.query("SET readonly = 1")  # last: from here on no setting changes, no writes
            except Exception as e:
                session.close()
                raise StoreError(f"cannot open a read-only chDB session at {self.path}: {first_line(e)}") from e
            while len(self._readers) >= MAX_READERS:
                self._readers.pop(next(iter(self._readers))).close()  # the least recently used
        self._readers[limits] = session
        return session

    def drop_reader(self, limits: SQLLimits) -> None:
        """Close the session of ``limits`` (the caller holds ``read_lock``); the next query opens a new one."""
        session = self._readers.pop(limits, None)
        if session is not None:
            try:
                session.close()
            except Exception:
                pass

    def close(self) -> None:
        try:
            with self.read_lock:
                for session in self._readers.values():
                    session.close()
                self._readers.clear()
            self.session.close()
        finally:
            self._unlock()


_REGISTRY: dict[str, _Shared] = {}
_REGISTRY_LOCK = threading.Lock()


def _acquire(path: str) -> _Shared:
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(path)
        if shared is None:
            if _REGISTRY:
                other = next(iter(_REGISTRY))
                raise StoreError(f"chDB allows one data path per process: {other} is open here, cannot open {path}")
            shared = _REGISTRY[path] = _Shared(path)
        shared.refs += 1
        return shared


def _release(shared: _Shared) -> None:
    with _REGISTRY_LOCK:
        shared.refs -= 1
        if shared.refs <= 0:
            _REGISTRY.pop(shared.path, None)
            shared.close()


class ChdbStore(SQLStore):
    """Store on an embedded chDB at ``path``."""

    def __init__(self, path: str, url: str | None = None, **kw) -> None:
        self.path = os.path.abspath(path)
        super().__init__(url or f"chdb://{path}", **kw)
        self._shared = _acquire(self.path)
        self._lock = self._shared.lock
        self.caps = ddl.Capabilities.from_version(self._shared.version, embedded=True)
        # A backfill batch may span many day partitions (op spans); the engine's default limit is 100.
        # Blocks of 128k rows instead of the default 1M: the engine then writes one block's part while the
        # Python() source converts the next, on both cores. 875k window rows: 0.43-0.66 s instead of 0.9 s.
        # The price: 7 parts per 875k rows instead of 1, and the slowest fleet query over a bulk-loaded year
        # (10.5M windows) went from 0.72-0.92 s to 0.92-0.97 s (BENCHMARKS.md, Storage).
        settings = {"max_partitions_per_insert_block": 0, "min_insert_block_size_rows": 1 << 17,
                    **self.caps.insert_settings()}
        self._insert_settings = ", ".join(f"{k} = {v}" for k, v in settings.items())

    def _run(self, sql: str, fmt: str, params: dict | None = None, tables: dict[str, pa.Table] | None = None):
        self._check_open()
        # chDB's Python() table function finds Arrow tables by variable name in this frame.
        tables = tables or {}
        _ext_keys = tables.get("_ext_keys")  # noqa: F841 - read by chDB
        _ext_rows = tables.get("_ext_rows")  # noqa: F841 - read by chDB
        for name in tables:
            sql = replace_identifier(sql, name, f"Python({name})")
        with self._lock:
            try:
                return self._shared.session.query(sql, fmt, params=params or None)
            except Exception as e:
                raise StoreError(first_line(e)) from e

    def _execute(self, sql: str) -> None:
        self._run(sql, "CSV")

    def _high_water(self) -> HighWater:
        return self._shared.high_water

    @staticmethod
    def _values(params: dict[str, tuple[str, Any]] | None) -> dict:
        return {n: (v.isoformat() if hasattr(v, "isoformat") else v) for n, (_t, v) in (params or {}).items()}

    def _select(self, sql: str, params: dict[str, tuple[str, Any]] | None = None,
                tables: dict[str, pa.Table] | None = None) -> pa.Table:
        return self._run(sql, "ArrowTable", self._values(params), tables)

    def _free_select(self, sql: str, params: dict[str, tuple[str, Any]], first: str, limits: SQLLimits) -> pa.Table:
        self._check_open()
        if first in WRAPPABLE:
            sql = limited(sql, limits)
        values = self._values(params) or None
        shared = self._shared
        if not shared.read_lock.acquire(timeout=limits.max_execution_time_s):
            raise StoreError("another free SQL query is still running on this store; try again")
        try:
            self._check_open()
            session = shared.reader(limits)
            try:
                return session.query(sql, "ArrowTable", params=values)
            except Exception as e:
                # chDB 4.4: the query after a cancelled one (time limit) on the same session can get a
                # corrupt Arrow answer ("Invalid flatbuffers message"); a failed query's session is replaced.
                shared.drop_reader(limits)
                raise StoreError(limit_error(first_line(e), limits)) from e
        finally:
            shared.read_lock.release()

    def _insert(self, table_name: str, rows: pa.Table) -> None:
        cols = ", ".join(ddl.quote(c) for c in rows.column_names)
        self._run(f"INSERT INTO {ddl.quote(table_name)} ({cols}) SELECT * FROM _ext_rows "
                  f"SETTINGS {self._insert_settings}", "CSV", tables={"_ext_rows": rows})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _release(self._shared)
