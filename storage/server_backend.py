"""The server backend: a ClickHouse server over the native protocol (clickhouse-driver).

Inserts are columnar (numpy columns, one block per call). Parameters and
Arrow tables that a query reads travel as external tables beside the query
(``storage.params`` explains why: 18.16 has no server-side parameters).
One connection per store for its own queries and writes, serialised by the
store's lock (clickhouse-driver clients are not thread-safe). Free SQL
(``Store.query``) has a second connection with a lock of its own, so a long
free query never holds up writes, and runs with the ``[sql]`` limits as
per-query settings (``max_execution_time``, ``max_memory_usage``, then
``readonly = 1``, which also forbids changing them).
"""
from __future__ import annotations

import contextlib
import re
import threading
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
import pyarrow as pa

from storage import ddl
from storage.errors import StoreError, first_line
from storage.sandbox import SQLLimits, limit_error, limited
from storage.sqltext import WRAPPABLE, external_params_sql
from storage.store import SQLStore

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_server_url(url: str) -> dict:
    """``clickhouse://user:pass@host:port/db`` into client arguments; StoreError when malformed."""
    u = urlparse(url)
    if u.scheme != "clickhouse" or not u.hostname:
        raise StoreError(f"bad ClickHouse URL {url!r}: write clickhouse://user:pass@host:port/db")
    try:
        port = u.port or 9000
    except ValueError:
        raise StoreError(f"bad port in ClickHouse URL {url!r}") from None
    database = (u.path or "/").lstrip("/") or "default"
    if not _IDENT.fullmatch(database):
        raise StoreError(f"bad database name {database!r} in {url!r}: letters, digits and _ only")
    return dict(host=u.hostname, port=port, user=unquote(u.username or "default"),
                password=unquote(u.password or ""), database=database)


def _structure(table: pa.Table) -> list[tuple[str, str]]:
    return [(f.name, ddl.clickhouse_type(f.type)) for f in table.schema]


def _column(values, ch_type: str) -> pa.Array:
    typ = ddl.arrow_type(ch_type)
    if isinstance(values, np.ndarray) and values.dtype.kind == "M":  # datetime64: Date / DateTime
        if pa.types.is_date32(typ):
            return pa.array(values.astype("datetime64[D]"), pa.date32())
        return pa.array(values.astype("datetime64[s]").astype(np.int64), pa.int64()).cast(typ)
    if pa.types.is_list(typ):
        values = [None if v is None else list(v) for v in values]
    elif pa.types.is_string(typ) and len(values) and not isinstance(values[0], (str, type(None))):
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else (None if v is None else str(v))
                  for v in values]
    try:
        return pa.array(values, typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return pa.array([None if v is None else str(v) for v in values], pa.string())


def _params_frame(params: dict[str, tuple[str, Any]]):
    import pandas as pd

    cols = {}
    for n, (t, v) in params.items():
        if t == "Date":
            cols[n] = np.array([np.datetime64(v, "D")])
        elif t.startswith(("Int", "UInt")):
            cols[n] = np.array([v], dtype=t.lower())
        elif t.startswith("Float"):
            cols[n] = np.array([v], dtype=t.lower())
        else:
            cols[n] = np.array([v], dtype=object)
    return pd.DataFrame(cols)


class ServerStore(SQLStore):
    """Store on a ClickHouse server; the database is created when missing."""

    def __init__(self, url: str, connect_timeout: float = 5.0, **kw) -> None:
        super().__init__(url, **kw)
        self._args = parse_server_url(url)
        self.address = f"{self._args['host']}:{self._args['port']}"
        self.database = self._args["database"]
        self._timeout = connect_timeout
        self._read_client = None  # free SQL's connection, made on first use
        self._read_lock = threading.Lock()
        self._client = self._connect("default")
        version = self._call(self._client, "SELECT version()")[0][0][0]
        self.caps = ddl.Capabilities.from_version(str(version))
        if self.database != "default":
            self._call(self._client, f"CREATE DATABASE IF NOT EXISTS {ddl.quote(self.database)}")
            self._client.disconnect()
            self._client = self._connect(self.database)

    def _connect(self, database: str):
        from clickhouse_driver import Client

        a = self._args
        return Client(host=a["host"], port=a["port"], user=a["user"], password=a["password"], database=database,
                      connect_timeout=self._timeout, send_receive_timeout=300, sync_request_timeout=self._timeout,
                      client_name="stragglerscope", settings={"use_numpy": True})

    def _call(self, client, sql: str, data=None, **kw):
        from clickhouse_driver import errors as ch_errors

        try:
            if data is not None:
                return client.execute(sql, data, columnar=True, **kw)
            return client.execute(sql, columnar=True, with_column_types=True, **kw)
        except (ch_errors.NetworkError, ch_errors.SocketTimeoutError, OSError, EOFError) as e:
            client.disconnect()
            raise StoreError(f"ClickHouse server at {self.address} is unreachable: {first_line(e)}") from e
        except ch_errors.ServerException as e:
            raise StoreError(f"Code: {e.code}. {first_line(Exception(e.message))}") from e
        except ch_errors.Error as e:
            raise StoreError(first_line(e)) from e
        except (TypeError, ValueError, KeyError) as e:  # data clickhouse-driver could not encode
            raise StoreError(f"ClickHouse client error: {type(e).__name__}: {first_line(e)}") from e

    def _execute(self, sql: str) -> None:
        self._check_open()
        with self._lock:
            self._call(self._client, sql)

    def _select(self, sql: str, params: dict[str, tuple[str, Any]] | None = None,
                tables: dict[str, pa.Table] | None = None) -> pa.Table:
        self._check_open()
        return self._select_on(self._client, self._lock, sql, params, tables, {})

    def _free_select(self, sql: str, params: dict[str, tuple[str, Any]], first: str, limits: SQLLimits) -> pa.Table:
        self._check_open()
        if first in WRAPPABLE:
            sql = limited(sql, limits)
        settings = {**limits.settings(), "readonly": 1}  # readonly last: the query cannot change the others
        if not self._read_lock.acquire(timeout=limits.max_execution_time_s):
            raise StoreError("another free SQL query is still running on this store; try again")
        try:
            self._check_open()
            if self._read_client is None:
                self._read_client = self._connect(self.database)
            try:
                return self._select_on(self._read_client, contextlib.nullcontext(), sql, params, None, settings)
            except StoreError as e:
                raise StoreError(limit_error(str(e), limits)) from e
        finally:
            self._read_lock.release()

    def _select_on(self, client, lock, sql: str, params: dict[str, tuple[str, Any]] | None,
                   tables: dict[str, pa.Table] | None, settings: dict) -> pa.Table:
        """Run a query on ``client``, holding ``lock`` while the client is in use."""
        ext = []
        limit = None
        if params:
            sql, limit_name = external_params_sql(sql, "_params")
            if limit_name:
                limit = int(params[limit_name][1])
            ext.append({"name": "_params", "structure": [(n, t) for n, (t, _v) in params.items()],
                        "data": _params_frame(params)})
        for name, table in (tables or {}).items():
            # numpy mode of clickhouse-driver takes external data as a DataFrame
            ext.append({"name": name, "structure": _structure(table), "data": table.to_pandas()})
        settings = dict(settings)
        if not self.caps.partition_local_final:
            # Old servers read FINAL from every part at once with a 1 MiB buffer per column and part:
            # a year of day partitions then needs gigabytes. Small buffers keep it bounded.
            settings = {"max_read_buffer_size": 65536, **settings}
        with lock:
            cols, types = self._call(client, sql, external_tables=ext or None, settings=settings)
        arrays = [_column(c, t) for c, (_n, t) in zip(cols, types)] if cols else \
            [pa.array([], ddl.arrow_type(t)) for _n, t in types]
        out = pa.Table.from_arrays(arrays, names=[n for n, _t in types])
        return out.slice(0, limit) if limit is not None else out

    def _insert(self, table_name: str, rows: pa.Table) -> None:
        self._check_open()
        cols = ", ".join(ddl.quote(c) for c in rows.column_names)
        data = []
        for col in rows.columns:
            data.append(col.to_pylist() if pa.types.is_list(col.type) else col.to_numpy(zero_copy_only=False))
        with self._lock:
            self._call(self._client, f"INSERT INTO {ddl.quote(table_name)} ({cols}) VALUES", data,
                       settings=self.caps.insert_settings())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for client in (self._client, self._read_client):
                try:
                    if client is not None:
                        client.disconnect()
                except Exception:
                    pass
