"""The store API and its SQL implementation shared by the chDB and server backends.

``Store`` is the one API (see ``storage/__init__.py``). ``SQLStore``
implements it over four primitives a backend provides: the engine version,
executing a statement, selecting into an Arrow table (with bound parameters
and Arrow tables sent along as external data) and inserting an Arrow table.

Idempotence (a crash replays and nothing is counted twice):

1. Check before insert. For every kind keyed by its natural key (windows and
   their per-op-type, per-worker and per-step rows, hangs, link faults,
   alerts, dead letters) ``insert`` drops rows whose key is in the batch
   twice or is stored already, under the store's lock. With chDB every
   writer goes through one process (the store daemon), so check and insert
   are atomic and a key is stored at most once. There, rows above a job
   attempt's stored high-water mark of window_id skip the read-back of
   stored keys (``storage.keys``).
2. Deduplication on read. Data tables are ReplacingMergeTree on the natural
   key, and readers query views that read ``FINAL`` (or the latest row per
   key for jobs and offsets). Two servers' clients racing on the same key
   (which check-before-insert cannot exclude) still count once.
   On chDB the views merge within a day partition only
   (``do_not_merge_across_partitions_select_final``), which is exact
   because (1) is atomic there; the server merges across partitions.

Job registrations and offsets are "latest wins": every write is kept and the
view (and ``load_*``) return the row with the largest ``ts_ns`` /
``stored_ns``.
"""
from __future__ import annotations

import abc
import base64
import datetime as dt
import re
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core import codec
from core import schema as S
from core.topics import family_of
from storage import ddl
from storage.errors import StoreError
from storage.keys import GROWING_KEY, Encoded, HighWater, PendingMarks, first_of_each_key
from storage.params import bind, bind_free
from storage.sandbox import PROJECT_TABLES, SQLLimits, check_free_sql, is_show_tables
from storage.sqltext import placeholders

DEFAULT_RETENTION_DAYS = 7
RETENTION_CHECK_S = 3600.0


class Store(abc.ABC):
    """One API over every backend; see ``storage/__init__.py`` for the contract of each method."""

    url: str = ""

    @abc.abstractmethod
    def setup(self, target_version: int | None = None) -> None: ...

    @abc.abstractmethod
    def insert(self, kind: str, table: pa.Table) -> None: ...

    @abc.abstractmethod
    def query(self, sql: str, params: dict | None = None, limits=None) -> pa.Table: ...

    @abc.abstractmethod
    def run_named(self, name: str, params: dict | None = None) -> pa.Table: ...

    @abc.abstractmethod
    def window_stored(self, key: tuple[str, int, int]) -> bool: ...

    @abc.abstractmethod
    def load_offsets(self, source_id: str, topics, partitions) -> dict[tuple[str, int], int]: ...

    @abc.abstractmethod
    def store_offsets(self, source_id: str, offsets: dict[tuple[str, int], int],
                      log_ids: dict[tuple[str, int], str] | None = None) -> None: ...

    @abc.abstractmethod
    def load_offset_logs(self, source_id: str, topics, partitions) -> dict[tuple[str, int], str]: ...

    @abc.abstractmethod
    def store_state(self, source_id: str, shard: str, fmt: int, state: bytes) -> None: ...

    @abc.abstractmethod
    def load_state(self, source_id: str, shard: str) -> tuple[int, bytes] | None: ...

    @abc.abstractmethod
    def load_jobs(self) -> list[dict]: ...

    @abc.abstractmethod
    def enforce_retention(self, now_ns: int | None = None) -> list[str]: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def normalise(table: pa.Table) -> pa.Table:
    """Results look the same from every backend: plain (non-dictionary) types, nullable fields, no metadata."""
    fields, cols = [], []
    for f, col in zip(table.schema, table.columns):
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        fields.append(pa.field(f.name, col.type, nullable=True))
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def filter_offsets(rows: list[dict], topics, partitions, value=int) -> dict[tuple[str, int], Any]:
    """``next_offset`` (made ``value``) per (topic, partition) of the rows of ``topics`` and ``partitions``."""
    topics = None if topics is None else {str(t) for t in topics}
    parts = None if partitions is None else {int(p) for p in partitions}
    out = {}
    for r in rows:
        # An input topic's generations ("ss.ops.g5912", core.topics) belong to it.
        if (topics is None or family_of(r["topic"]) in topics) and (parts is None or r["partition"] in parts):
            out[(r["topic"], int(r["partition"]))] = value(r["next_offset"])
    return out


class SQLStore(Store):
    """The store over a ClickHouse engine; subclasses provide the primitives below."""

    def __init__(self, url: str, retention_days: int = DEFAULT_RETENTION_DAYS, sql_limits=None) -> None:
        self.url = url
        self.retention_days = retention_days
        self.sql_limits = SQLLimits.of(sql_limits)  # free SQL's limits where a call gives none
        self.caps: ddl.Capabilities | None = None
        self._lock = threading.RLock()
        self._last_ns = 0
        self._last_retention = 0.0
        self._closed = False

    # -- primitives -------------------------------------------------------
    @abc.abstractmethod
    def _execute(self, sql: str) -> None:
        """Run a statement that returns nothing (DDL, ALTER); errors raise StoreError."""

    @abc.abstractmethod
    def _select(self, sql: str, params: dict[str, tuple[str, Any]] | None = None,
                tables: dict[str, pa.Table] | None = None) -> pa.Table:
        """Run one of the store's own queries; ``params`` bind ``{name:Type}`` placeholders; ``tables``
        are sent as external data named ``_ext_keys`` / ``_ext_rows``."""

    @abc.abstractmethod
    def _insert(self, table_name: str, rows: pa.Table) -> None:
        """Insert ``rows`` (columns named as in the table) into a data table."""

    @abc.abstractmethod
    def _free_select(self, sql: str, params: dict[str, tuple[str, Any]], first: str, limits: SQLLimits) -> pa.Table:
        """Run free SQL that ``check_free_sql`` passed (``first``: its first keyword) read-only within
        ``limits``, beside the store's writes: never under the lock that inserts take."""

    # -- helpers ----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store {self.url} is closed")

    def _now_ns(self) -> int:
        """Wall clock, strictly increasing within this store (``stored_ns`` orders writes)."""
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def _with_stored_ns(self, spec: ddl.TableSpec, table: pa.Table) -> pa.Table:
        target = ddl.storage_schema(spec)
        cols = []
        for f in target:
            if f.name == "stored_ns":
                cols.append(pa.array(np.full(table.num_rows, self._now_ns(), dtype=np.int64)))
            else:
                col = table.column(f.name)
                cols.append(col if col.type.equals(f.type) else col.cast(f.type))
        return pa.Table.from_arrays(cols, schema=target.remove_metadata())

    def _data(self, spec: ddl.TableSpec | str) -> str:
        """The table the store writes a kind's rows into and reads its stored keys from: the data table.

        On a ClickHouse cluster, the Distributed table in front of every
        shard's data table (``ServerStore`` with ``cluster=``).
        """
        return (ddl.TABLE_BY_NAME[spec] if isinstance(spec, str) else spec).data

    def create_table_sql(self, spec: ddl.TableSpec, **kw) -> str:
        """The DDL of a data table on this store's engine (``ddl.create_table_sql``)."""
        return ddl.create_table_sql(spec, self.caps, **kw)

    # -- for storage.migrations: schema changes, below the rows' conforming and keys ----------------------
    def run_ddl(self, sql: str) -> None:
        """A statement that changes the schema (CREATE, ALTER, DROP); errors raise StoreError."""
        self._execute(sql)

    def insert_bookkeeping(self, table_name: str, rows: pa.Table) -> None:
        """Rows of the store's own bookkeeping tables (the schema version), inserted as they are."""
        self._insert(table_name, rows)

    def data_table(self, spec: ddl.TableSpec | str) -> str:
        """The table a kind's rows are written into (``_data``), for the views migrations define over it."""
        return self._data(spec)

    def prepare_reads(self, columns: dict[str, dict[str, str]]) -> bool:
        """Make the tables the views read (``_data``) match the data tables; True if any changed.

        Nothing to do on one server: the views read the data tables themselves.
        """
        return False

    def active_partitions(self, table: str) -> list[str]:
        """The partitions of ``table`` that hold data (on every server of a cluster)."""
        t = self._select("SELECT DISTINCT partition FROM system.parts WHERE database = currentDatabase() "
                         "AND table = {t:String} AND active", {"t": ("String", table)})
        return t.column("partition").to_pylist()

    def table_names(self) -> set[str]:
        """Tables and views of the current database (on a cluster: those every server has)."""
        return {str(n) for n in self._select("SELECT name FROM system.tables WHERE database = currentDatabase()")
                .column("name").to_pylist()}

    def table_columns(self) -> dict[str, dict[str, str]]:
        """``{table: {column: type}}`` of the current database."""
        t = self._select("SELECT table, name, type FROM system.columns WHERE database = currentDatabase()")
        out: dict[str, dict[str, str]] = {}
        for table, name, typ in zip(*(t.column(i).to_pylist() for i in range(3))):
            out.setdefault(table, {})[name] = typ
        return out

    # -- API --------------------------------------------------------------
    def setup(self, target_version: int | None = None) -> None:
        """Create tables and views, apply forward migrations up to ``target_version`` (default: latest)."""
        from storage.migrations import migrate

        self._check_open()
        with self._lock:
            marks = self._high_water()
            if marks is not None:
                marks.forget()
            migrate(self, target_version)

    def schema_version(self) -> int:
        t = self._select("SELECT max(version) AS v, count() AS n FROM schema_version")
        return int(t.column("v")[0].as_py() or 0) if t.column("n")[0].as_py() else 0

    def insert(self, kind: str, table: pa.Table) -> None:
        self._check_open()
        spec = ddl.TABLE_OF_KIND.get(kind)
        if spec is None:
            raise StoreError(f"unknown record kind {kind!r}; known: {', '.join(sorted(ddl.TABLE_OF_KIND))}")
        if not isinstance(table, (pa.Table, pa.RecordBatch)):
            raise StoreError(f"insert({kind!r}) needs a pyarrow Table, got {type(table).__name__}")
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        try:
            table = codec.conform(table, spec.schema)
        except codec.DecodeError as e:
            raise StoreError(f"insert({kind!r}): {e}") from None
        if table.num_rows == 0:
            return
        rows = self._with_stored_ns(spec, table)
        with self._lock:
            pending = None
            if spec.mode == "first":
                rows, pending = self._drop_stored(spec, rows)
            if rows.num_rows:
                try:
                    self._insert(self._data(spec), rows)
                except BaseException:
                    if pending is not None:
                        pending.forget()  # the engine may have stored some blocks: learn the marks anew
                    raise
            if pending is not None:
                pending.commit()
            if spec.retention:
                self._maybe_enforce_retention()

    def _high_water(self) -> HighWater | None:
        """The high-water marks of growing keys, where this store is its tables' sole writer (see storage.keys)."""
        return None

    def _stored_high_water(self, spec: ddl.TableSpec, jobs: list[str]) -> dict[tuple[str, int], int]:
        t = self._select(f"SELECT job_id, attempt, max(window_id) AS hi FROM {ddl.quote(self._data(spec))} "
                         "WHERE job_id IN (SELECT job_id FROM _ext_keys) GROUP BY job_id, attempt",
                         tables={"_ext_keys": pa.table({"job_id": pa.array(jobs, pa.string())})})
        return {(j, int(a)): int(hi) for j, a, hi in zip(*(t.column(i).to_pylist() for i in range(3)))}

    def _drop_stored(self, spec: ddl.TableSpec, rows: pa.Table) -> tuple[pa.Table, PendingMarks | None]:
        """Rows whose key is neither earlier in the batch nor stored already (the caller holds the lock), and
        the high-water marks to commit once they are stored (None where the store keeps none)."""
        key = list(spec.key)
        enc = Encoded(rows)
        rows = first_of_each_key(rows, key, enc)
        pending, fresh = None, None
        marks = self._high_water()
        if marks is not None and spec.key[:len(GROWING_KEY)] == GROWING_KEY:
            fresh, rows, pending = marks.split(spec.data, rows, lambda jobs: self._stored_high_water(spec, jobs), enc)
        if rows.num_rows:
            rows = self._without_stored_keys(spec, rows)
        if fresh is not None and fresh.num_rows:
            rows = pa.concat_tables([fresh, rows]) if rows.num_rows else fresh
        return rows, pending

    def _without_stored_keys(self, spec: ddl.TableSpec, rows: pa.Table) -> pa.Table:
        """``rows`` less those whose key the table holds (rows' keys are distinct)."""
        key = list(spec.key)
        keys = rows.select(key)
        cols = ", ".join(ddl.quote(k) for k in key)
        # The ranges of the integer key columns let the engine skip most stored rows before the lookup.
        # The lookup uses two sets built from the batch: the values of the leading sort-key column (a small
        # batch then reads only its own jobs' granules) and 64-bit hashes of whole keys, which build 3-10x
        # faster than a set of string tuples (500k keys: 88 vs 292 ms). A hash collision can only return a
        # stored key that no batch row has; the exact anti-join below ignores it.
        ranges, params = [], {}
        for i, k in enumerate(key):
            if pa.types.is_integer(keys.schema.field(k).type):
                mm = pc.min_max(keys.column(k))
                params[f"lo{i}"], params[f"hi{i}"] = ("Int64", mm["min"].as_py()), ("Int64", mm["max"].as_py())
                ranges.append(f"{ddl.quote(k)} >= {{lo{i}:Int64}} AND {ddl.quote(k)} <= {{hi{i}:Int64}} AND ")
        lead = ddl.quote(key[0])
        stored = self._select(
            f"SELECT {cols} FROM {ddl.quote(self._data(spec))} WHERE {''.join(ranges)}"
            f"{lead} IN (SELECT {lead} FROM _ext_keys) AND "
            f"cityHash64({cols}) IN (SELECT cityHash64({cols}) FROM _ext_keys)", params, tables={"_ext_keys": keys})
        if stored.num_rows == 0:
            return rows
        stored = pa.Table.from_arrays([stored.column(i).cast(keys.schema.field(i).type) for i in range(len(key))],
                                      names=key)
        return rows.join(stored, keys=key, join_type="left anti", use_threads=False).select(rows.column_names)

    def _maybe_enforce_retention(self) -> None:
        if time.monotonic() - self._last_retention >= RETENTION_CHECK_S:
            self.enforce_retention()

    def enforce_retention(self, now_ns: int | None = None) -> list[str]:
        """Drop partitions older than ``retention_days`` (UTC days) of the tables with retention (op spans,
        GPU samples, window profiles).

        Runs on every engine (TTL, where the engine has it, also expires rows
        on merges). Returns the dropped partitions, e.g. ``['2024-01-01']``.
        """
        self._check_open()
        now_ns = time.time_ns() if now_ns is None else now_ns
        cutoff = dt.datetime.fromtimestamp(now_ns / 1e9, dt.timezone.utc).date() - dt.timedelta(
            days=self.retention_days)
        dropped = []
        with self._lock:
            self._last_retention = time.monotonic()
            for spec in ddl.TABLES:
                if not spec.retention:
                    continue
                for p in self.active_partitions(spec.data):
                    day = p.strip("'")
                    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", day) and dt.date.fromisoformat(day) < cutoff:
                        # The partition id comes from system.parts and matched a date pattern above.
                        self._execute(f"ALTER TABLE {ddl.quote(spec.data)} DROP PARTITION '{day}'")
                        dropped.append(day)
        return dropped

    def query(self, sql: str, params: dict | None = None, limits=None) -> pa.Table:
        """Free SQL: one reading statement over the project's tables (``storage.sandbox``).

        ``limits`` (SQLLimits, ``[sql]``'s SQLConfig or a dict) bound its time, memory and result rows;
        None takes ``self.sql_limits``. It runs beside writes, not under their lock.
        """
        self._check_open()
        if not isinstance(sql, str):
            raise StoreError("query() needs SQL text")
        text, first = check_free_sql(sql)
        bound = bind_free(placeholders(text), params)
        lim = self.sql_limits if limits is None else SQLLimits.of(limits)
        out = self._free_select(text, bound, first, lim)
        lim.check_rows(out.num_rows)
        if first == "SHOW" and is_show_tables(text) and out.num_columns:
            out = out.filter(pc.is_in(out.column(0), pa.array(sorted(PROJECT_TABLES))))
        return normalise(out)

    def run_named(self, name: str, params: dict | None = None) -> pa.Table:
        from storage.queries import NAMED_QUERIES

        self._check_open()
        q = NAMED_QUERIES.get(name)
        if q is None:
            raise StoreError(f"unknown query {name!r}; known: {', '.join(sorted(NAMED_QUERIES))}")
        bound = bind(q.params, params, name)
        with self._lock:
            return normalise(self._select(q.sql, bound))

    def window_stored(self, key: tuple[str, int, int]) -> bool:
        self._check_open()
        job_id, attempt, window_id = key
        marks = self._high_water()
        if marks is not None:
            # Window ids grow within a job attempt: a window above the job's high-water mark is not stored,
            # which answers a shard's question about every new window without a query (a query per window
            # was 17% of the store daemon's profile samples in the small-job soak). The first question of a
            # job learns its mark, which its first insert then finds known.
            spec = ddl.TABLE_OF_KIND["window"]
            with self._lock:
                hi = marks.mark(spec.data, str(job_id), int(attempt),
                                lambda jobs: self._stored_high_water(spec, jobs))
            if int(window_id) > hi:
                return False
        t = self._select(
            f"SELECT count() AS n FROM {self._data('windows')} WHERE job_id = {{job_id:String}} "
            "AND attempt = {attempt:Int32} AND window_id = {window_id:Int64}",
            {"job_id": ("String", str(job_id)), "attempt": ("Int32", int(attempt)),
             "window_id": ("Int64", int(window_id))})
        return bool(t.column("n")[0].as_py())

    def load_offsets(self, source_id: str, topics, partitions) -> dict[tuple[str, int], int]:
        self._check_open()
        t = self._select(
            "SELECT topic, `partition`, argMax(next_offset, stored_ns) AS next_offset "
            f"FROM {self._data('offsets')} WHERE source_id = {{source_id:String}} GROUP BY topic, `partition`",
            {"source_id": ("String", str(source_id))})
        return filter_offsets(t.to_pylist(), topics, partitions)

    def store_offsets(self, source_id: str, offsets: dict[tuple[str, int], int],
                      log_ids: dict[tuple[str, int], str] | None = None) -> None:
        """Store the next offset to read per partition; ``log_ids`` names the log each was read from
        (a partition left out is stored with '' = unknown, and is then not checked against its log)."""
        self._check_open()
        if not offsets:
            return
        items = sorted(offsets.items())
        log_ids = log_ids or {}
        spec = ddl.TABLE_BY_NAME["offsets"]
        table = pa.table({
            "source_id": pa.array([str(source_id)] * len(items)),
            "topic": pa.array([str(tp[0]) for tp, _ in items]),
            "partition": pa.array([int(tp[1]) for tp, _ in items], pa.int32()),
            "next_offset": pa.array([int(off) for _, off in items], pa.int64()),
            "log_id": pa.array([str(log_ids.get(tp, "") or "") for tp, _ in items]),
        }, schema=spec.schema)
        with self._lock:
            self._insert(self._data(spec), self._with_stored_ns(spec, table))

    def load_offset_logs(self, source_id: str, topics, partitions) -> dict[tuple[str, int], str]:
        """The log id stored with each partition's latest offset ('' where it was stored without one)."""
        self._check_open()
        t = self._select(
            "SELECT topic, `partition`, argMax(log_id, stored_ns) AS log_id "
            f"FROM {self._data('offsets')} WHERE source_id = {{source_id:String}} GROUP BY topic, `partition`",
            {"source_id": ("String", str(source_id))})
        rows = [dict(r, next_offset=r["log_id"]) for r in t.to_pylist()]
        return filter_offsets(rows, topics, partitions, value=str)

    def store_state(self, source_id: str, shard: str, fmt: int, state: bytes) -> None:
        """A shard's reducer state (``ray_jobs.state``); the latest stored wins."""
        self._check_open()
        spec = ddl.TABLE_BY_NAME["shard_state"]
        table = pa.table({"source_id": [str(source_id)], "shard": [str(shard)],
                          "format": pa.array([int(fmt)], pa.int32()),
                          "state": [base64.b64encode(bytes(state)).decode("ascii")]}, schema=spec.schema)
        with self._lock:
            self._insert(self._data(spec), self._with_stored_ns(spec, table))

    def load_state(self, source_id: str, shard: str) -> tuple[int, bytes] | None:
        """(format, state) last stored for the shard, or None."""
        self._check_open()
        t = self._select(
            "SELECT argMax(format, stored_ns) AS format, argMax(state, stored_ns) AS state, count() AS n "
            f"FROM {self._data('shard_state')} WHERE source_id = {{source_id:String}} AND shard = {{shard:String}}",
            {"source_id": ("String", str(source_id)), "shard": ("String", str(shard))})
        if not t.num_rows or not t.column("n")[0].as_py():
            return None
        state = t.column("state")[0].as_py()
        try:
            return int(t.column("format")[0].as_py()), base64.b64decode(state, validate=True)
        except (ValueError, TypeError) as e:
            raise StoreError(f"the stored state of shard {shard!r} is not base64: {e}") from None

    def load_jobs(self) -> list[dict]:
        self._check_open()
        cols = ", ".join(ddl.quote(f.name) for f in S.JOB)
        with self._lock:
            return self._select(f"SELECT {cols} FROM jobs ORDER BY job_id, attempt").to_pylist()

