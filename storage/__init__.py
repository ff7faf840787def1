"""Storage: ClickHouse tables derived from ``core.schema``, one Store API, the named query library.

    store = open_store("chdb://./.stragglerscope/store")   # embedded chDB
    store = open_store("clickhouse://default:@127.0.0.1:9000/default")  # a server (native protocol)
    store = open_store("clickhouse://admin@ch:9000/db?password_file=/run/secrets/ch")  # password read at open
    store = open_store("clickhouse://admin@ch:9440/db?password_file=/run/secrets/ch&secure=1&ca_certs=/etc/ca.pem")
    store = open_store("clickhouse://admin@ch-0:9000/db?cluster=ss")  # spread over cluster ss (its remote_servers)
    store = open_store("http://127.0.0.1:8123?token_file=/data/store/daemon.token")  # a store daemon (storage.daemon)
    store.setup()                                         # tables, views, forward migrations; idempotent
    store.insert("window", table)                         # a table of core.schema.WINDOW
    store.run_named("fleet_summary", {"team": "llm"})     # -> pyarrow.Table
    store.query("SELECT job_id FROM windows WHERE slowdown > {s:Float64}", {"s": 1.2})

A clickhouse:// URL takes ``secure``, ``verify``, ``ca_certs``, ``certfile``,
``keyfile``, ``server_hostname``, ``connect_timeout`` and ``password_file``
(``storage.server_backend.tls_options``), and ``cluster`` (the tables spread
over that cluster's shards: infra/clickhouse/cluster/README.md); an http:// URL takes ``token_file``,
the file where the daemon keeps its token (``storage.daemon``). Neither
carries a secret itself, so both may travel to other processes and logs.

Store methods (the same behaviour on every backend):

- ``setup()``: create the database, tables and views; apply forward migrations.
- ``insert(kind, table)``: ``kind`` is a key of ``core.schema.ALL_SCHEMAS``
  that has a table (every result kind, ``job``, ``op_span``);
  the table is conformed to the schema (StoreError otherwise). Writing the
  same keys again stores nothing new (see ``storage.store``).
- ``query(sql, params, limits)``: free SQL, a sandbox (``storage.sandbox``):
  one reading statement over the project's tables with pure functions
  (``storage.sqlfuncs``), anything else refused with StoreError; run
  read-only within ``limits`` (time, memory, result rows: ``[sql]``),
  beside writes; parameters are ``{name:Type}`` placeholders, bound by the
  engine.
- ``run_named(name, params)``: a query of ``NAMED_QUERIES``.
- ``window_stored((job_id, attempt, window_id))``, ``load_offsets``,
  ``store_offsets`` (latest stored value wins), ``load_jobs`` (latest
  registration per (job_id, attempt)), ``close()``.
- ``enforce_retention(now_ns)``: drop op-span day partitions older than the
  retention; returns the dropped days (op-span inserts run it at most hourly).

Tables readers query: jobs, windows, optype_slowdown, worker_slowdown,
step_slowdown, hangs, link_faults, alerts, dead_letters, op_spans,
optype_waste, offsets, schema_version.
"""
from __future__ import annotations

from storage.errors import StoreError
from storage.store import Store

DEFAULT_URL = "chdb://./.stragglerscope/store"

__all__ = ["open_store", "Store", "StoreError", "NAMED_QUERIES", "NamedQuery", "serve", "DEFAULT_URL"]


def open_store(url: str = DEFAULT_URL) -> Store:
    """Open a store by URL (see the module docstring); StoreError with one line when it cannot.

    ``chdb://PATH`` uses the daemon serving PATH when ``PATH/daemon.json``
    names a live one, and opens the path in this process otherwise.
    """
    if not isinstance(url, str) or not url.strip():
        raise StoreError("empty store URL: use chdb://PATH, clickhouse://user:pass@host:port/db "
                         "or http://127.0.0.1:PORT")
    url = url.strip()
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "chdb":
        path = url[len("chdb://"):]
        if not path:
            raise StoreError(f"bad store URL {url!r}: chdb:// needs a path, e.g. chdb://./.stragglerscope/store")
        from storage.daemon import HttpStore, discover

        served = discover(path)
        if served:
            return HttpStore(served)
        from storage.chdb_backend import ChdbStore

        return ChdbStore(path, url)
    if scheme == "clickhouse":
        from core.redact import redact_url
        from storage.server_backend import ServerStore

        store = ServerStore(_server_credentials(url))
        store.url = redact_url(url)  # what messages and repr() show; the connection keeps the password
        return store
    if scheme == "http":
        from storage.daemon import HttpStore

        return HttpStore(url)
    raise StoreError(f"unsupported store URL {url!r}: use chdb://PATH, clickhouse://user:pass@host:port/db "
                     "or http://127.0.0.1:PORT")


def _server_credentials(url: str) -> str:
    """``url`` with its password in place: ``?password_file=PATH`` is read now (and dropped from the URL).

    The password, however it came, is registered with ``core.redact``
    so that no message shows it. StoreError when the file cannot be read or
    the URL has a password as well.
    """
    from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

    from core.redact import add_secret

    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    userinfo, _, host = parts.netloc.rpartition("@")
    user, has_pw, raw_pw = userinfo.partition(":")
    files = [v for k, v in query if k == "password_file"]
    if not files:
        add_secret(unquote(raw_pw))
        return url
    if has_pw and raw_pw:
        raise StoreError("the store URL has a password and a password_file: keep one")
    path = files[-1]
    try:
        with open(path, encoding="utf-8") as f:
            password = f.read().rstrip("\r\n")
    except OSError as e:
        raise StoreError(f"cannot read the store password file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise StoreError(f"the store password file {path} is not UTF-8 text") from None
    if not password:
        raise StoreError(f"the store password file {path} is empty")
    add_secret(password)
    netloc = f"{user or 'default'}:{quote(password, safe='')}@{host}"
    rest = urlencode([(k, v) for k, v in query if k != "password_file"])
    return urlunsplit(parts._replace(netloc=netloc, query=rest))


def __getattr__(name: str):
    # Lazy: importing storage must not import chDB, clickhouse-driver or http.server.
    if name in ("NAMED_QUERIES", "NamedQuery"):
        from storage import queries

        return getattr(queries, name)
    if name in ("serve", "HttpStore"):
        from storage import daemon

        return getattr(daemon, name)
    raise AttributeError(f"module 'storage' has no attribute {name!r}")
