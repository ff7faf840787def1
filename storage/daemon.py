"""The store daemon: one process owns a chDB path and serves the store API over HTTP on 127.0.0.1.

chDB allows one process per data path, but the pipeline has several writer
processes (Ray shard actors) and the console and ``stragglerscope sql`` read
at the same time. The daemon opens the path once and serves every call of
the ``Store`` API; ``open_store("http://127.0.0.1:PORT")`` is a client with
the same API (``HttpStore``), and ``open_store("chdb://PATH")`` becomes one
whenever ``PATH/daemon.json`` names a live daemon.

Wire format (stdlib only): ``POST /v1/<method>``; the body is one line of
JSON (the arguments) followed, for inserts, by an Arrow IPC stream. The
answer has the same shape: a JSON line (``{"ok": true, ...}`` or
``{"error": "one line"}``, HTTP 400 for a refused call) and, for results,
an Arrow IPC stream. Calls run one at a time (the chDB store's lock), except
free SQL (``query``): it runs in a read-only session of its own, beside the
writes, within the daemon's SQL limits (``--max-execution-time-s``,
``--max-memory-mb``, ``--max-result-rows``; a client may ask for less, not
more), so a long free query cannot hold up the pipeline's inserts.

Discovery file ``PATH/daemon.json``: ``{"url": ..., "pid": ..., "store": ...}``,
written once the server listens and removed when it stops; a file whose pid
is gone is stale and removed by the next ``open_store``.

Token: the daemon serves only callers that show its token. At start it
makes a random one (``secrets.token_urlsafe``) and writes it, with its own
address, to ``PATH/daemon.token``, created with mode 0600 (only its owner
may read it), before anything names the daemon. Every request must carry
``Authorization: Bearer TOKEN`` (compared in constant time); without one the
answer is 401, with a wrong one 403, and nothing runs. The daemon's URL
names the file, not the token: ``http://127.0.0.1:PORT?token_file=PATH/daemon.token``
(``StoreDaemon.url``, ``daemon.json``), so it can travel to Ray actors, the
console and logs; ``HttpStore`` reads the file when it opens and again once
after a refusal (a daemon restarted on the same port has a new token). It
refuses a token file that other users may read or write (the token would
not be a secret; ``chmod 600`` mends it) and one written by a daemon at
another address (the URL is stale: sending that token to whatever now
listens on the old port would give it away).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hmac
import http.client
import io
import json
import os
import secrets
import select
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qsl, quote, urlparse

import pyarrow as pa

from storage.errors import StoreError, first_line
from storage.sandbox import SQLLimits
from storage.store import Store, filter_offsets

DISCOVERY_FILE = "daemon.json"
TOKEN_FILE = "daemon.token"
_MAX_REFUSED_BODY = 1 << 20  # a refused request's body is read (and dropped) up to this size, then the socket closes
_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------
# framing
# --------------------------------------------------------------------------
def _encode(envelope: dict, table: pa.Table | None = None) -> bytes:
    head = json.dumps(envelope, separators=(",", ":"), default=_json_default).encode() + b"\n"
    if table is None:
        return head
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return head + sink.getvalue()


def _decode(body: bytes) -> tuple[dict, pa.Table | None]:
    head, _, rest = body.partition(b"\n")
    envelope = json.loads(head or b"{}")
    table = None
    if rest:
        with pa.ipc.open_stream(pa.py_buffer(rest)) as r:
            table = r.read_all()
    return envelope, table


def _json_default(o):
    if isinstance(o, (dt.date, dt.datetime)):
        return o.isoformat()
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if hasattr(o, "isoformat"):  # pandas.Timestamp
        return o.isoformat()
    return str(o)


# --------------------------------------------------------------------------
# discovery
# --------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an unreaped child of ours is a zombie: dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def discover(path: str | os.PathLike) -> str | None:
    """URL of the live daemon serving ``path``, or None; removes a stale discovery file."""
    file = Path(path) / DISCOVERY_FILE
    try:
        info = json.loads(file.read_text())
        pid, url = int(info["pid"]), str(info["url"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # half-written or foreign: ignore, the chDB lock still protects the path
    if pid == os.getpid():
        return None  # we are the daemon: use the path directly
    if _pid_alive(pid):
        return url
    try:
        file.unlink()
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------
# token
# --------------------------------------------------------------------------
def token_path(store_path: str | os.PathLike) -> Path:
    """Where the daemon serving ``store_path`` keeps its token (absolute)."""
    return Path(os.path.abspath(os.fspath(store_path))) / TOKEN_FILE


def daemon_url(host: str, port: int, store_path: str | os.PathLike) -> str:
    """The URL of the daemon serving ``store_path`` on ``host:port``: it names the token file, not the token."""
    return f"http://{host}:{port}?token_file={quote(str(token_path(store_path)), safe='/')}"


def _write_token(file: Path, address: str) -> str:
    """A new random token for the daemon at ``address``, written to ``file`` (mode 0600) atomically."""
    token = secrets.token_urlsafe(32)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    # O_EXCL | O_NOFOLLOW: never write through a file or link someone else put there; 0600 from the start.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, json.dumps({"url": address, "pid": os.getpid(), "token": token}).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, file)
    from stragglerscope.redact import add_secret

    add_secret(token)
    return token


def read_token(path: str, address: str) -> str:
    """The token in ``path`` for the daemon at ``address``; StoreError when it cannot be trusted or read."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise StoreError(f"cannot read the store daemon's token file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"the store daemon's token file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise StoreError(f"the store daemon's token file {path} is open to other users (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}): anyone who reads it may write to the store; "
                         f"chmod 600 {path}, or restart the daemon, which writes a new one with mode 0600")
    try:
        with open(path, encoding="utf-8") as f:
            info = json.loads(f.read(65536))
        token, written_for = str(info["token"]), str(info["url"])
    except OSError as e:
        raise StoreError(f"cannot read the store daemon's token file {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError):
        raise StoreError(f"the store daemon's token file {path} is not one a daemon wrote") from None
    if written_for != address:
        raise StoreError(f"the token file {path} is for the store daemon at {written_for}, not {address}: the "
                         "daemon moved; open the store by its chdb:// path (that finds the daemon and its token)")
    from stragglerscope.redact import add_secret

    add_secret(token)
    return token


# --------------------------------------------------------------------------
# server
# --------------------------------------------------------------------------
def _dispatch(store: Store, method: str, args: dict, table: pa.Table | None,
              sql_limits: SQLLimits | None = None) -> tuple[dict, pa.Table | None]:
    if method == "ping":
        return {"ok": True, "pid": os.getpid(), "store": store.url}, None
    if method == "setup":
        store.setup(args.get("target_version"))
        return {"ok": True}, None
    if method == "insert":
        if table is None:
            raise StoreError("insert needs an Arrow table")
        store.insert(str(args.get("kind")), table)
        return {"ok": True}, None
    if method == "query":
        ceiling = sql_limits or SQLLimits()
        asked = args.get("limits")
        limits = ceiling if asked is None else SQLLimits.of(asked).capped(ceiling)
        return {"ok": True}, store.query(str(args.get("sql", "")), args.get("params"), limits)
    if method == "run_named":
        return {"ok": True}, store.run_named(str(args.get("name", "")), args.get("params"))
    if method == "window_stored":
        job_id, attempt, window_id = args["key"]
        return {"ok": True, "stored": store.window_stored((job_id, attempt, window_id))}, None
    if method == "load_offsets":
        offs = store.load_offsets(args["source_id"], args.get("topics"), args.get("partitions"))
        return {"ok": True, "offsets": [[t, p, o] for (t, p), o in offs.items()]}, None
    if method == "store_offsets":
        store.store_offsets(args["source_id"], {(t, int(p)): int(o) for t, p, o in args["offsets"]})
        return {"ok": True}, None
    if method == "load_jobs":
        jobs = store.load_jobs()
        return {"ok": True}, pa.Table.from_pylist(jobs) if jobs else None
    if method == "enforce_retention":
        return {"ok": True, "dropped": store.enforce_retention(args.get("now_ns"))}, None
    raise StoreError(f"unknown store method {method!r}")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "stragglerscope-store"

    def log_message(self, fmt, *args):  # quiet: one line per call would flood the pipeline's logs
        pass

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        """True when the request shows the daemon's token; otherwise answers 401 or 403 and closes."""
        given = self.headers.get("Authorization")
        scheme, _, value = (given or "").strip().partition(" ")
        expected = self.server.token.encode()
        if given and scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode("utf-8", "replace"),
                                                                        expected):
            return True
        with self.server.refused_lock:
            self.server.refused += 1
            first = self.server.refused == 1
        if first:
            print(f"store daemon: refused a request without the right token from {self.client_address[0]} "
                  f"(more are counted, not logged)", file=sys.stderr, flush=True)
        try:  # drop a small body, so that closing does not reset the connection before the client reads why
            length = int(self.headers.get("Content-Length") or 0)
            if 0 < length <= _MAX_REFUSED_BODY:
                self.connection.settimeout(5.0)  # a caller without the token holds no thread for long
                self.rfile.read(length)
        except (ValueError, OSError):
            pass
        status, why = (401, "a request without a token") if not given else (403, "a request with a wrong token")
        body = _encode({"error": f"store daemon refused {why}; every request needs Authorization: Bearer TOKEN, "
                                 f"the token in {self.server.token_file} (readable by the daemon's user only)",
                        "token_file": str(self.server.token_file)})
        self.close_connection = True
        self.send_response(status)
        self.send_header("WWW-Authenticate", 'Bearer realm="stragglerscope-store"')
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        return False

    def do_GET(self):
        if not self._authorized():
            return
        if self.path.rstrip("/") in ("", "/ping", "/v1/ping"):
            self._reply(200, _encode({"ok": True, "pid": os.getpid(), "store": self.server.store.url}))
        else:
            self._reply(404, _encode({"error": f"no such path {self.path}"}))

    def do_POST(self):
        if not self._authorized():
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if not self.path.startswith("/v1/"):
                raise StoreError(f"no such path {self.path}")
            args, table = _decode(body)
            envelope, result = _dispatch(self.server.store, self.path[4:], args, table, self.server.sql_limits)
            self._reply(200, _encode(envelope, result))
        except StoreError as e:
            self._reply(400, _encode({"error": str(e)}))
        except Exception as e:  # a bug or a broken request: answer, keep serving
            self._reply(500, _encode({"error": f"{type(e).__name__}: {first_line(e)}"}))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(url: str, host: str = "127.0.0.1", port: int = 0, ready: Callable[[int], None] | None = None,
          stop: threading.Event | None = None, sql_limits=None) -> None:
    """Serve the chDB store at ``url`` (``chdb://PATH``) until SIGINT/SIGTERM.

    ``sql_limits`` (SQLLimits or ``[sql]``'s SQLConfig; default: its
    defaults) bound every free query; clients may ask for lower limits.

    Opens the path (failing with StoreError if another process holds it),
    runs ``setup()``, listens on ``host:port`` (0: a free port), writes a new
    token to ``PATH/daemon.token`` (mode 0600) and ``PATH/daemon.json``
    (whose URL, ``daemon_url``, names the token file), calls ``ready(port)``,
    and on shutdown removes both files and closes the store. It also stops when ``stop`` is set (chDB's
    engine takes over SIGTERM in its process, so a parent stops its daemon
    child by closing the child's stdin, which sets this event).
    """
    from storage.chdb_backend import ChdbStore

    if not isinstance(url, str) or not url.startswith("chdb://") or not url[len("chdb://"):]:
        raise StoreError(f"the store daemon serves chdb://PATH stores, got {url!r}")
    path = url[len("chdb://"):]
    other = discover(path)
    if other:
        raise StoreError(f"{url} is already served at {other}")
    limits = SQLLimits.of(sql_limits)
    store = ChdbStore(path, url, sql_limits=limits)
    file = Path(path) / DISCOVERY_FILE
    tokens = token_path(path)
    token = None
    httpd = None
    try:
        store.setup()
        httpd = _Server((host, port), _Handler)
        httpd.store = store
        httpd.sql_limits = limits
        httpd.refused, httpd.refused_lock = 0, threading.Lock()
        bound = httpd.server_address[1]
        # The token first: once daemon.json names the daemon, its token must be there.
        try:
            token = httpd.token = _write_token(tokens, f"http://{host}:{bound}")
        except OSError as e:
            raise StoreError(f"cannot write the store daemon's token file {tokens}: {e.strerror or e}") from None
        httpd.token_file = tokens
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"url": daemon_url(host, bound, path), "pid": os.getpid(), "store": url}))
        os.replace(tmp, file)
        stop = stop or threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        threading.Thread(target=lambda: (stop.wait(), httpd.shutdown()), name="store-stop", daemon=True).start()
        if ready:
            ready(bound)
        try:
            httpd.serve_forever(poll_interval=0.2)
        except KeyboardInterrupt:
            pass
    finally:
        try:
            if file.exists() and json.loads(file.read_text()).get("pid") == os.getpid():
                file.unlink()
        except (OSError, ValueError):
            pass
        try:  # ours only: a daemon started since may have written its own
            if token and json.loads(tokens.read_text()).get("token") == token:
                tokens.unlink()
        except (OSError, ValueError):
            pass
        if httpd is not None:
            httpd.server_close()
        store.close()


# --------------------------------------------------------------------------
# client
# --------------------------------------------------------------------------
class HttpStore(Store):
    """The Store API over a store daemon at ``http://127.0.0.1:PORT``."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        u = urlparse(url)
        if u.scheme != "http" or not u.hostname or u.path not in ("", "/"):
            raise StoreError(f"bad store daemon URL {url!r}: write http://127.0.0.1:PORT?token_file=PATH")
        try:
            self.port = u.port
        except ValueError:
            raise StoreError(f"bad port in store daemon URL {url!r}") from None
        if not self.port:
            raise StoreError(f"store daemon URL {url!r} needs a port")
        query = parse_qsl(u.query, keep_blank_values=True)
        for key, _value in query:
            if key != "token_file":
                raise StoreError(f"unknown parameter {key!r} in store daemon URL {url}: it takes token_file= only")
        files = [v for _k, v in query]
        if len(files) > 1 or (files and not files[0]):
            raise StoreError(f"store daemon URL {url} needs one token_file=PATH")
        self.token_file = files[0] if files else None
        self.address = f"http://{u.hostname}:{self.port}"  # what messages show
        self.url = self.address + (f"?token_file={quote(self.token_file, safe='/')}" if self.token_file else "")
        self.host = u.hostname
        self.timeout = timeout
        self._token = read_token(self.token_file, self.address) if self.token_file else None
        self._local = threading.local()
        self._closed = False
        self._call("ping", {}, timeout=5.0)

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _post(self, method: str, body: bytes, timeout: float | None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/octet-stream"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        for attempt in (0, 1):  # a kept-alive connection the daemon closed: reconnect once (calls are idempotent)
            try:
                conn = self._conn(timeout or self.timeout)
                conn.request("POST", f"/v1/{method}", body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if resp.will_close:
                    self._drop_conn()
                return resp.status, data
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                self._drop_conn()
                if attempt or isinstance(e, (ConnectionRefusedError, TimeoutError)):
                    raise StoreError(f"store daemon at {self.address} is unreachable: {first_line(e)}") from e
        raise AssertionError("unreachable")

    def _call(self, method: str, args: dict, table: pa.Table | None = None,
              timeout: float | None = None) -> tuple[dict, pa.Table | None]:
        if self._closed:
            raise StoreError(f"store {self.address} is closed")
        body = _encode(args, table)
        status, data = self._post(method, body, timeout)
        if status in (401, 403) and self.token_file:
            # A daemon restarted on this port has a new token in the same file: read it once more.
            token = read_token(self.token_file, self.address)
            if token != self._token:
                self._token = token
                status, data = self._post(method, body, timeout)
        try:
            envelope, result = _decode(data)
        except (ValueError, pa.ArrowInvalid) as e:
            raise StoreError(f"store daemon at {self.address} sent a bad answer (HTTP {status})") from e
        if status == 401:
            raise StoreError(f"store daemon at {self.address} wants its token (add ?token_file="
                             f"{envelope.get('token_file') or 'PATH/daemon.token'} to the URL, or open the store by "
                             "its chdb:// path)")
        if status == 403:
            raise StoreError(f"store daemon at {self.address} refused the token from {self.token_file}")
        if status != 200 or "error" in envelope:
            raise StoreError(envelope.get("error") or f"store daemon at {self.address}: HTTP {status}")
        return envelope, result

    @staticmethod
    def _params(params: dict | None) -> dict | None:
        if params is None:
            return None
        return json.loads(json.dumps(dict(params), default=_json_default))

    def setup(self, target_version: int | None = None) -> None:
        self._call("setup", {"target_version": target_version})

    def insert(self, kind: str, table: pa.Table) -> None:
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise StoreError(f"insert({kind!r}) needs a pyarrow Table, got {type(table).__name__}")
        if table.num_rows:
            self._call("insert", {"kind": kind}, table)

    def _table(self, method: str, args: dict) -> pa.Table:
        _env, table = self._call(method, args)
        return table if table is not None else pa.table({})

    def query(self, sql: str, params: dict | None = None, limits=None) -> pa.Table:
        """Free SQL on the daemon; ``limits`` may lower the daemon's SQL limits (None: the daemon's)."""
        asked = None if limits is None else SQLLimits.of(limits).as_dict()
        return self._table("query", {"sql": sql, "params": self._params(params), "limits": asked})

    def run_named(self, name: str, params: dict | None = None) -> pa.Table:
        return self._table("run_named", {"name": name, "params": self._params(params)})

    def window_stored(self, key: tuple[str, int, int]) -> bool:
        job_id, attempt, window_id = key
        env, _ = self._call("window_stored", {"key": [str(job_id), int(attempt), int(window_id)]})
        return bool(env["stored"])

    def load_offsets(self, source_id: str, topics, partitions) -> dict[tuple[str, int], int]:
        env, _ = self._call("load_offsets", {"source_id": source_id, "topics": None if topics is None else list(topics),
                                             "partitions": None if partitions is None else
                                             [int(p) for p in partitions]})
        rows = [{"topic": t, "partition": p, "next_offset": o} for t, p, o in env["offsets"]]
        return filter_offsets(rows, topics, partitions)

    def store_offsets(self, source_id: str, offsets: dict[tuple[str, int], int]) -> None:
        if offsets:
            self._call("store_offsets", {"source_id": source_id,
                                         "offsets": [[t, int(p), int(o)] for (t, p), o in offsets.items()]})

    def load_jobs(self) -> list[dict]:
        _env, table = self._call("load_jobs", {})
        return table.to_pylist() if table is not None else []

    def enforce_retention(self, now_ns: int | None = None) -> list[str]:
        env, _ = self._call("enforce_retention", {"now_ns": now_ns})
        return env["dropped"]

    def close(self) -> None:
        self._drop_conn()
        self._closed = True


# --------------------------------------------------------------------------
# a daemon in a child process
# --------------------------------------------------------------------------
class StoreDaemon:
    """Runs ``serve(url)`` in a child process; ``start()`` returns once it answers.

    The child also stops when this process dies (it watches its stdin pipe),
    so a crashed parent leaves no daemon holding the path.

        with StoreDaemon("chdb:///data/store") as d:
            store = open_store(d.url)        # or open_store("chdb:///data/store") anywhere
    """

    def __init__(self, url: str, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0,
                 stop_timeout: float = 20.0, sql_limits=None) -> None:
        if not isinstance(url, str) or not url.startswith("chdb://"):
            raise StoreError(f"the store daemon serves chdb://PATH stores, got {url!r}")
        self.store_url = url
        self.sql_limits = SQLLimits.of(sql_limits)
        self.host = host
        self.port = port
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT?token_file=PATH/daemon.token``: the file is the daemon's token, 0600."""
        if not self._proc:
            raise StoreError("store daemon not started")
        return daemon_url(self.host, self.port, self.store_url[len("chdb://"):])

    @property
    def token_file(self) -> Path:
        return token_path(self.store_url[len("chdb://"):])

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> "StoreDaemon":
        if self._proc is not None:
            return self
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if p])
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "storage.daemon", self.store_url, "--host", self.host, "--port", str(self.port),
             "--watch-stdin", "--max-execution-time-s", repr(float(self.sql_limits.max_execution_time_s)),
             "--max-memory-mb", str(int(self.sql_limits.max_memory_mb)),
             "--max-result-rows", str(int(self.sql_limits.max_result_rows))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=os.getcwd(),
            start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        line = b""
        # poll(), not select(): a long-lived caller (a test run, the console) may hold more than 1,024 fds.
        waiting = select.poll()
        waiting.register(self._proc.stdout, select.POLLIN)
        while time.monotonic() < deadline:
            ready = waiting.poll(100)
            if ready:
                line = self._proc.stdout.readline()
                if line.startswith(b"READY "):
                    self.port = int(line.split()[1])
                    return self
                if not line:
                    break
            elif self._proc.poll() is not None:
                break
        tail = self._stderr_tail()
        self.stop()
        raise StoreError(f"store daemon for {self.store_url} did not start: {tail}")

    def _stderr_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        text = self._log.read().decode(errors="replace").strip().splitlines()
        errors = [t for t in text if t.strip()]
        return errors[-1][:500] if errors else "(no output)"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # the child's stdin watcher stops the server
        except OSError:
            pass
        try:
            proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "StoreDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _watch_stdin(stop: threading.Event) -> None:
    def run():
        try:
            while sys.stdin.buffer.read(1):
                pass
        except (OSError, ValueError):
            pass
        stop.set()

    threading.Thread(target=run, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m storage.daemon", description="Serve a chDB store on 127.0.0.1.")
    p.add_argument("url", help="chdb://PATH")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--watch-stdin", action="store_true", help="stop when stdin closes (the parent died)")
    base = SQLLimits()
    p.add_argument("--max-execution-time-s", type=float, default=base.max_execution_time_s,
                   help="free SQL: longest run, seconds")
    p.add_argument("--max-memory-mb", type=int, default=base.max_memory_mb, help="free SQL: most memory, MiB")
    p.add_argument("--max-result-rows", type=int, default=base.max_result_rows, help="free SQL: most result rows")
    args = p.parse_args(argv)
    out = sys.stdout

    def ready(port: int) -> None:
        out.write(f"READY {port}\n")
        out.flush()

    stop = threading.Event()
    if args.watch_stdin:
        _watch_stdin(stop)
    try:
        limits = SQLLimits(args.max_execution_time_s, args.max_memory_mb, args.max_result_rows)
        serve(args.url, args.host, args.port, ready, stop, sql_limits=limits)
    except StoreError as e:
        print(f"store daemon: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
