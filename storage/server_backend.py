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

TLS and authentication: ``clickhouse://user@host:9440/db?secure=1&ca_certs=PATH``
speaks TLS to the server's secure native port and checks its certificate
(``tls_options`` lists the parameters); the password comes from the URL,
``password_file=`` or ``STRAGGLERSCOPE_STORE_PASSWORD`` (``storage.open_store``).
Opening a store connects at once, and the TCP connect, the TLS handshake
and the server's hello each finish within the connect timeout (5 s,
``connect_timeout=``) or fail with one line that says which.
"""
from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Any
from urllib.parse import parse_qsl, unquote, urlparse

import numpy as np
import pyarrow as pa

from storage import ddl
from storage.errors import StoreBusy, StoreError, first_line
from storage.sandbox import SQLLimits, limit_error, limited
from storage.sqltext import WRAPPABLE, external_params_sql
from storage.store import SQLStore

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SEND_RECEIVE_TIMEOUT_S = 300  # a long query's reads; the connect and the hello use the connect timeout
# Server error codes that mean "not now" rather than "not this": a replicated shard short of live
# replicas (285), a quorum still pending (286), an insert whose fate is unknown (319), a replicated table
# read-only while ZooKeeper is away (242), ZooKeeper errors (999).
TRANSIENT_CODES = frozenset({242, 285, 286, 319, 999})
QUORUM_RETRY_CODES = frozenset({286, 319})
"""Retried here at once: replicated tables drop a block they hold already, so sending it again is safe."""
QUORUM_TIMEOUT_S = 30.0
"""How long a replicated write waits for its quorum before it fails (the caller retries it; the server's
default is 600 s, past the client's own timeout, and a shard's loop would hang that long)."""


# Query parameters of a clickhouse:// URL (``password_file`` is read by ``storage.open_store`` first).
_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
_TLS_FILES = ("ca_certs", "certfile", "keyfile")
URL_PARAMS = ("secure", "verify", "ca_certs", "certfile", "keyfile", "server_hostname", "connect_timeout",
              "password_file", "cluster", "insert_quorum")


def parse_server_url(url: str) -> dict:
    """``clickhouse://user:pass@host:port/db?secure=1&ca_certs=PATH`` into client arguments.

    StoreError (one line, password masked) when the URL is malformed or a
    TLS parameter is bad; see ``tls_options`` for the parameters.
    """
    u = urlparse(url)
    if u.scheme != "clickhouse" or not u.hostname:
        raise StoreError(f"bad ClickHouse URL {url!r}: write clickhouse://user:pass@host:port/db")
    query = dict(parse_qsl(u.query, keep_blank_values=True))  # tls_options refuses repeated and unknown keys
    cluster = query.get("cluster")
    if cluster is not None and not _IDENT.fullmatch(cluster):
        raise StoreError(f"bad cluster={cluster!r} in store URL {url}: the name of a cluster in the server's "
                         "remote_servers (letters, digits and _)")
    quorum = query.get("insert_quorum")
    if quorum is not None and (not quorum.isdigit() or int(quorum) < 1 or cluster is None):
        raise StoreError(f"bad insert_quorum={quorum!r} in store URL {url}: replicas per shard that must hold "
                         "a write before it returns, 1 or more, with cluster=")
    tls, timeout = tls_options(url, u.query)
    try:
        port = u.port or (9440 if tls["secure"] else 9000)
    except ValueError:
        raise StoreError(f"bad port in ClickHouse URL {url!r}") from None
    database = (u.path or "/").lstrip("/") or "default"
    if not _IDENT.fullmatch(database):
        raise StoreError(f"bad database name {database!r} in {url!r}: letters, digits and _ only")
    return dict(host=u.hostname, port=port, user=unquote(u.username or "default"),
                password=unquote(u.password or ""), database=database, tls=tls, connect_timeout=timeout,
                cluster=cluster, insert_quorum=int(quorum) if quorum else None)


def tls_options(url: str, query: str) -> tuple[dict, float | None]:
    """The TLS arguments of clickhouse-driver and the connect timeout from a URL's query string.

    ``secure=1`` (default 0) speaks TLS to the server's secure native port
    (``tcp_port_secure``; 9440 when the URL names no port). ``verify=1``
    (the default) checks the server's certificate against ``ca_certs=PATH``
    (a PEM bundle; without it, the system's CAs) and its name against the
    host, or against ``server_hostname=NAME``; ``verify=0`` encrypts without
    knowing who answers. ``certfile=PATH`` (and ``keyfile=PATH`` when the key
    is a file of its own) is a client certificate for a server that asks for
    one; the key must not be encrypted. ``connect_timeout=SECONDS`` bounds
    the TCP connect, the TLS handshake and the server's hello.

    Every file is read here, so a missing or wrong one is a StoreError now,
    not a handshake failure later. Unknown parameters are refused: a typo in
    ``secure`` must not fall back to plain text.
    """
    import ssl

    pairs = parse_qsl(query, keep_blank_values=True)
    seen: dict[str, str] = {}
    for key, value in pairs:
        if key not in URL_PARAMS:
            raise StoreError(f"unknown parameter {key!r} in store URL {url}: known are {', '.join(URL_PARAMS)}")
        if key in seen:
            raise StoreError(f"parameter {key!r} given twice in store URL {url}")
        seen[key] = value.strip()

    def flag(name: str, default: bool) -> bool:
        if name not in seen:
            return default
        value = _BOOL.get(seen[name].lower())
        if value is None:
            raise StoreError(f"bad {name}={seen[name]!r} in store URL {url}: use 1 or 0")
        return value

    secure, verify = flag("secure", False), flag("verify", True)
    timeout = None
    if "connect_timeout" in seen:
        try:
            timeout = float(seen["connect_timeout"])
        except ValueError:
            timeout = -1.0
        if not 0 < timeout <= 3600:
            raise StoreError(f"bad connect_timeout={seen['connect_timeout']!r} in store URL {url}: "
                             "seconds, above 0 and at most 3600")
    tls_given = [k for k in (*_TLS_FILES, "server_hostname", "verify") if k in seen]
    if not secure:
        if tls_given:
            raise StoreError(f"{tls_given[0]}= in store URL {url} needs secure=1 (without it the connection "
                             "is plain text)")
        return {"secure": False}, timeout
    for name in _TLS_FILES:
        if name in seen and not seen[name]:
            raise StoreError(f"empty {name}= in store URL {url}: name a file")
    if not verify and ("ca_certs" in seen or "server_hostname" in seen):
        raise StoreError(f"store URL {url} has verify=0 and {'ca_certs' if 'ca_certs' in seen else 'server_hostname'}"
                         "=: verify=0 checks nothing; drop one")
    if "keyfile" in seen and "certfile" not in seen:
        raise StoreError(f"keyfile= in store URL {url} needs certfile= (the client certificate)")
    hostname = seen.get("server_hostname")
    if hostname is not None and not re.fullmatch(r"[A-Za-z0-9.:_-]{1,253}", hostname):
        raise StoreError(f"bad server_hostname={hostname!r} in store URL {url}: a DNS name or an IP address")
    for name in _TLS_FILES:
        if name in seen:
            _readable(url, name, seen[name])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if "ca_certs" in seen:
        try:
            context.load_verify_locations(cafile=seen["ca_certs"])
        except (ssl.SSLError, ValueError) as e:
            raise StoreError(f"ca_certs={seen['ca_certs']} holds no usable PEM certificate: {first_line(e)}") from None
    if "certfile" in seen:
        def no_passphrase():
            raise ValueError("the key is encrypted")

        try:
            context.load_cert_chain(seen["certfile"], seen.get("keyfile"), password=no_passphrase)
        except (ssl.SSLError, ValueError) as e:
            which = f"certfile={seen['certfile']}" + (f" and keyfile={seen['keyfile']}" if "keyfile" in seen else "")
            raise StoreError(f"{which}: not a usable client certificate and unencrypted key ({first_line(e)})") \
                from None
    tls = {"secure": True, "verify": verify}
    for name in (*_TLS_FILES, "server_hostname"):
        if name in seen:
            tls[name] = seen[name]
    return tls, timeout


def _readable(url: str, name: str, path: str) -> None:
    import os

    try:
        with open(path, "rb") as f:
            f.read(1)
    except IsADirectoryError:
        raise StoreError(f"{name}={path} in store URL {url} is a directory: name a PEM file") from None
    except OSError as e:
        raise StoreError(f"cannot read {name}={path} from store URL {url}: {e.strerror or e}") from None
    if not os.path.isfile(path):
        raise StoreError(f"{name}={path} in store URL {url} is not a regular file")


def describe_tls_error(text: str, tls: dict, connecting: bool = True) -> str | None:
    """A one-line explanation of a TLS failure in a connection error's ``text``, or None when it is none.

    A connection closed at once is read as a TLS failure only while ``connecting``.
    """
    t = text.upper()
    if "CERTIFICATE_VERIFY_FAILED" in t:
        if "MISMATCH" in t:
            return ("the server's certificate does not name this host (set server_hostname= to the name it "
                    "was issued for)")
        where = f"ca_certs={tls['ca_certs']}" if tls.get("ca_certs") else "the default CA bundle (set ca_certs=)"
        return f"the server's certificate is not signed by a CA in {where}"
    if any(k in t for k in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
                            "UNKNOWN_PROTOCOL", "HTTP_REQUEST")):
        return "the port does not speak TLS: use the server's secure native port (tcp_port_secure, often 9440)"
    if "CERTIFICATE_REQUIRED" in t or ("HANDSHAKE_FAILURE" in t and not tls.get("certfile")):
        return "the server asks for a client certificate: set certfile= (and keyfile=)"
    if connecting and not tls.get("certfile") and any(k in t for k in ("EOF OCCURRED IN VIOLATION", "UNEXPECTED_EOF",
                                                        "CONNECTION RESET", "UNEXPECTED EOF")):
        # TLS 1.3: the server checks the client's certificate after the client's handshake is done, and
        # its alert may be lost to the connection's reset; a server asking for one is the likely reason.
        return ("the server closed the TLS connection at once; if it asks for a client certificate, set "
                "certfile= (and keyfile=)")
    if "[SSL" in t or "SSL:" in t or "TLSV1" in t:
        return "the TLS handshake failed"
    return None


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
        self.secure = self._args["tls"]["secure"]
        self._timeout = self._args["connect_timeout"] or connect_timeout
        self._read_client = None  # free SQL's connection, made on first use
        self._read_lock = threading.Lock()
        self._client = self._connect("default")
        version = self._call(self._client, "SELECT version()")[0][0][0]
        self.caps = ddl.Capabilities.from_version(str(version))
        self.cluster: str | None = self._args["cluster"]
        self.replicated = False
        """Shards of more than one server: the data tables are Replicated (ZooKeeper), one per replica."""
        self.insert_quorum: int | None = None
        peers = self._peer_addresses() if self.cluster else []
        if self.database != "default":
            for address in peers:
                client = self._connect("default", address)
                self._call(client, f"CREATE DATABASE IF NOT EXISTS {ddl.quote(self.database)}")
                client.disconnect()
            self._call(self._client, f"CREATE DATABASE IF NOT EXISTS {ddl.quote(self.database)}")
            self._client.disconnect()
            self._client = self._connect(self.database)
        self._peers: list[tuple[str, Any]] = [(a, self._connect(self.database, a)) for a in peers]
        """(address, client) of the cluster's other servers, each holding its shard of every data table."""
        if self.cluster and self.replicated:
            self._check_macros()

    # -- a ClickHouse cluster (cluster= in the URL) -------------------------------------------
    # Each server holds its shard of every data table; a Distributed table in front of each
    # (``ddl.distributed_sql``) takes the writes, with insert_distributed_sync so that an insert
    # returns only once every shard has its rows, and the views read through it. Statements
    # that change tables run on every server from here: that needs no distributed DDL queue,
    # which 18.16 keeps in ZooKeeper (ON CLUSTER). With several replicas per shard the data
    # tables are ReplicatedReplacingMergeTree: each replica's table is created here, an ALTER
    # reaches a shard's other replicas through ZooKeeper as well (their "already exists" is
    # expected), and a write returns once ``insert_quorum`` replicas hold it (default: a
    # majority). Why exactly-once still holds: RELIABILITY.md.
    def _peer_addresses(self) -> list[str]:
        """host:port of the cluster's other servers, from this server's ``system.clusters``."""
        rows = self._call(self._client, "SELECT shard_num, replica_num, host_address, port, is_local "
                          "FROM system.clusters WHERE cluster = %(c)s", params={"c": self.cluster})[0]
        if not rows or not len(rows[0]):
            raise StoreError(f"cluster {self.cluster!r} is not in the remote_servers of the ClickHouse server at "
                             f"{self.address}: name one of its clusters (SELECT DISTINCT cluster FROM system.clusters)")
        shards, replicas, hosts, ports, local = (list(c) for c in rows)
        self.replicated = max(replicas) > 1
        fewest = min(sum(1 for s in shards if s == shard) for shard in set(shards))
        # A write returns once a majority of its shard's replicas hold it: the offsets stored after it
        # then never cover rows that one lost replica took with it.
        self.insert_quorum = self._args["insert_quorum"] or (fewest // 2 + 1 if self.replicated else None)
        # This server: local and on the URL's port (18.16 marks every replica of the local shard is_local).
        me = [bool(is_local) and int(p) == self._args["port"] for p, is_local in zip(ports, local)]
        if not any(me):
            raise StoreError(f"the server at {self.address} is not itself in cluster {self.cluster!r}: connect to "
                             "one of its servers")
        return [f"{h}:{p}" for h, p, mine in zip(hosts, ports, me) if not mine]

    def _check_macros(self) -> None:
        """Every server of a replicated cluster names its shard and replica (the tables' ZooKeeper paths)."""
        for address, client in self._servers():
            cols, _types = self._call(client, "SELECT macro FROM system.macros")
            missing = {"shard", "replica"} - {str(m) for m in (cols[0] if cols else [])}
            if missing:
                raise StoreError(f"the ClickHouse server at {address} of replicated cluster {self.cluster!r} does "
                                 f"not define the macro {sorted(missing)[0]!r} (<macros> in its config): "
                                 "replicated tables are named by shard and replica")

    def setup(self, target_version: int | None = None) -> None:
        super().setup(target_version)
        if self.replicated:
            self._wait_replicas_active()

    def _wait_replicas_active(self, timeout_s: float = 60.0) -> None:
        """Until every replica of every data table is active: a new replica joins its shard in ZooKeeper a
        moment after its table is created, and a quorum write before that fails ("alive replicas (1)")."""
        deadline = time.monotonic() + timeout_s
        pending = list(self._servers())
        while pending:
            address, client = pending[0]
            cols, _types = self._call(client, "SELECT count(), sum(active_replicas < total_replicas OR is_readonly) "
                                      "FROM system.replicas WHERE database = currentDatabase()")
            n, behind = int(cols[0][0]), int(cols[1][0])
            if n and not behind:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise StoreError(f"the replicas of cluster {self.cluster!r} are not all active after {timeout_s:.0f} s "
                                 f"({behind} of {n} tables on {address} lack some): is ZooKeeper reachable "
                                 "from every server?")
            time.sleep(0.2)

    def create_table_sql(self, spec, **kw) -> str:
        if self.replicated:
            kw["replicated_in"] = self.database
        return super().create_table_sql(spec, **kw)

    def _servers(self):
        """(address, client) of every server: this one first, then the cluster's others."""
        return [(self.address, self._client), *self._peers]

    def _data(self, spec) -> str:
        return ddl.distributed_name(ddl.TABLE_BY_NAME[spec] if isinstance(spec, str) else spec) if self.cluster \
            else super()._data(spec)

    def prepare_reads(self, columns: dict[str, dict[str, str]]) -> bool:
        """A Distributed table in front of each data table, with every column the data table has."""
        if not self.cluster:
            return False
        changed = False
        for spec in ddl.TABLES:
            have = columns.get(spec.data)
            if not have:
                continue
            front = columns.get(ddl.distributed_name(spec))
            if front is None:
                self._execute(ddl.distributed_sql(spec, self.cluster))
                changed = True
                continue
            for name, typ in have.items():
                if name not in front:
                    self._execute(f"ALTER TABLE {ddl.quote(ddl.distributed_name(spec))} ADD COLUMN "
                                  f"{ddl.quote(name)} {typ}")
                    changed = True
        return changed

    def table_columns(self) -> dict[str, dict[str, str]]:
        """On a cluster, the tables and columns that every server has (a server added later lacks some)."""
        mine = super().table_columns()
        for cols in self._on_peers("SELECT table, name FROM system.columns WHERE database = currentDatabase()"):
            theirs = {(str(t), str(n)) for t, n in zip(*cols)}
            mine = {t: {n: typ for n, typ in c.items() if (t, n) in theirs} for t, c in mine.items()}
            mine = {t: c for t, c in mine.items() if c}
        return mine

    def table_names(self) -> set[str]:
        names = super().table_names()
        for cols in self._on_peers("SELECT name FROM system.tables WHERE database = currentDatabase()"):
            names &= {str(n) for n in cols[0]}
        return names

    def active_partitions(self, table: str) -> list[str]:
        parts = set(super().active_partitions(table))
        for cols in self._on_peers("SELECT DISTINCT partition FROM system.parts "
                                   f"WHERE database = currentDatabase() AND table = '{table}' AND active"):
            parts.update(cols[0])
        return sorted(parts)

    def _on_peers(self, sql: str):
        """``sql``'s columns from each of the cluster's other servers (empty lists for no rows)."""
        for _address, client in self._peers:
            cols, types = self._call(client, sql)
            yield cols or [[] for _ in types]

    def _connect(self, database: str, address: str | None = None):
        """A connected client: TCP connect, TLS handshake and the server's hello all within the connect timeout.

        clickhouse-driver waits for the hello with the send/receive timeout
        (300 s, for long queries); a port that accepts and never answers
        would hold an open that long, so the first connect runs with the
        connect timeout and the long one is set afterwards.
        """
        from clickhouse_driver import Client

        a = self._args
        host, port = (address.rsplit(":", 1) if address else (a["host"], a["port"]))
        client = Client(host=host, port=int(port), user=a["user"], password=a["password"], database=database,
                        connect_timeout=self._timeout, send_receive_timeout=self._timeout,
                        sync_request_timeout=self._timeout, client_name="stragglerscope",
                        settings={"use_numpy": True}, **a["tls"])
        conn = client.connection
        try:
            self._guard(client, conn.connect, connecting=True)
        finally:
            conn.send_receive_timeout = _SEND_RECEIVE_TIMEOUT_S
            if conn.connected and conn.socket is not None:
                conn.socket.settimeout(_SEND_RECEIVE_TIMEOUT_S)
        return client

    def _call(self, client, sql: str, data=None, **kw):
        if data is not None:
            return self._guard(client, lambda: client.execute(sql, data, columnar=True, **kw))
        return self._guard(client, lambda: client.execute(sql, columnar=True, with_column_types=True, **kw))

    def _guard(self, client, fn, connecting: bool = False):
        """``fn()``, with clickhouse-driver's errors as one-line StoreErrors."""
        from clickhouse_driver import errors as ch_errors

        try:
            return fn()
        except (ch_errors.NetworkError, ch_errors.SocketTimeoutError, OSError, EOFError) as e:
            client.disconnect()
            text = first_line(e)
            why = describe_tls_error(text, self._args["tls"], connecting) if self.secure else None
            if why:
                raise StoreError(f"TLS to ClickHouse server at {self.address} failed: {why} ({text})") from e
            if self.secure and isinstance(e, ch_errors.SocketTimeoutError):
                raise StoreError(f"ClickHouse server at {self.address} did not complete the TLS handshake and "
                                 f"its hello within {self._timeout:g} s: is it the secure native port? ({text})") from e
            hint = ""
            hung_up = any(k in text.upper() for k in ("CONNECTION RESET", "UNEXPECTED EOF"))
            if connecting and not self.secure and hung_up:
                hint = " (if that is the server's secure port, add secure=1)"  # it hung up on our plain-text hello
            raise StoreError(f"ClickHouse server at {self.address} is unreachable: {text}{hint}") from e
        except ch_errors.ServerException as e:
            message = re.sub(r"\s*Stack trace:$", "", first_line(Exception(e.message)))
            if e.code in (192, 193, 194, 516):  # unknown user, wrong password, password required, auth failed
                client.disconnect()
                raise StoreError(f"ClickHouse server at {self.address} refused the login: Code: {e.code}. "
                                 f"{message}") from e
            raise (StoreBusy if e.code in TRANSIENT_CODES else StoreError)(f"Code: {e.code}. {message}") from e
        except ch_errors.Error as e:
            raise StoreError(first_line(e)) from e
        except (TypeError, ValueError, KeyError) as e:  # data clickhouse-driver could not encode
            raise StoreError(f"ClickHouse client error: {type(e).__name__}: {first_line(e)}") from e

    def _execute(self, sql: str) -> None:
        """On a cluster, on every server: they all hold the same tables (their own shard of the rows)."""
        self._check_open()
        with self._lock:
            if not self._peers:
                self._call(self._client, sql)
                return
            for address, client in self._servers():
                try:
                    self._call(client, sql)
                except StoreError as e:
                    # A column one server has already (a setup interrupted half-way, a server added later):
                    # code 15 on new servers, 44 ("already exists") on 18.16.
                    if not (str(e).startswith(("Code: 15.", "Code: 44.")) and "already exists" in str(e)):
                        raise StoreError(f"on {address}: {e}") from e

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
        settings = self.caps.insert_settings()
        if self.cluster and table_name.endswith("_all"):
            # Return only once every shard has written its rows: results are stored before the offsets
            # that cover them (an asynchronous insert would return with the rows still queued here).
            settings = {**settings, "insert_distributed_sync": 1}
            if self.insert_quorum and self.replicated:
                settings["insert_quorum"] = self.insert_quorum
                settings["insert_quorum_timeout"] = int(QUORUM_TIMEOUT_S * 1000)
        sql = f"INSERT INTO {ddl.quote(table_name)} ({cols}) VALUES"
        deadline = time.monotonic() + QUORUM_TIMEOUT_S
        with self._lock:
            while True:
                try:
                    self._call(self._client, sql, data, settings=settings)
                    return
                except StoreError as e:
                    # Only quorum writes end so: another writer's quorum is still pending, or this one's fate
                    # is unknown.
                    if getattr(e.__cause__, "code", None) not in QUORUM_RETRY_CODES or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for client in (self._client, self._read_client, *(c for _a, c in self._peers)):
                try:
                    if client is not None:
                        client.disconnect()
                except Exception:
                    pass
