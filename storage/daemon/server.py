"""The daemon's server: one process owns a chDB path and serves the Store API over HTTP on 127.0.0.1.

Calls run one at a time (the chDB store's lock), except free SQL
(``query``): it runs in a read-only session of its own, beside the writes,
within the daemon's SQL limits (``--max-execution-time-s``,
``--max-memory-mb``, ``--max-result-rows``; a client may ask for less, not
more), so a long free query cannot hold up the pipeline's inserts.

Every request must carry ``Authorization: Bearer TOKEN``, the token in
``PATH/daemon.token`` (``storage.daemon.files``; compared in constant
time); without one the answer is 401, with a wrong one 403, and nothing
runs. Besides ``ping``, a call runs only when ``wire.REMOTE`` names it;
anything else is refused (HTTP 400).
"""
from __future__ import annotations

import hmac
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pyarrow as pa

from storage.daemon.files import DISCOVERY_FILE, daemon_url, discover, token_path, write_token
from storage.daemon.wire import REMOTE, decode, encode
from storage.errors import StoreError, first_line
from storage.sandbox import SQLLimits
from storage.store import Store

_MAX_REFUSED_BODY = 1 << 20  # a refused request's body is read (and dropped) up to this size, then the socket closes


def dispatch(store: Store, method: str, args: dict, table: pa.Table | None,
             sql_limits: SQLLimits | None = None) -> tuple[dict, pa.Table | None]:
    """Run the call ``method`` on ``store``: the answer's envelope and table. StoreError for a name
    ``REMOTE`` does not serve: only those reach the store (never ``close``, nor a private method)."""
    if method == "ping":  # the daemon's own call, not the store's
        return {"ok": True, "pid": os.getpid(), "store": store.url}, None
    remote = REMOTE.get(method)
    if remote is None:
        raise StoreError(f"unknown store method {method!r}")
    values = remote.take(args, table)
    for name, arg in remote.args.items():
        if arg.capped:  # free SQL: a client may ask for lower limits than the daemon's, never higher
            ceiling = sql_limits or SQLLimits()
            asked = values[name]
            values[name] = ceiling if asked is None else SQLLimits.of(asked).capped(ceiling)
    fields, result = remote.answer.pack(getattr(store, method)(*values.values()))
    return {"ok": True, **fields}, result


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
        body = encode({"error": f"store daemon refused {why}; every request needs Authorization: Bearer TOKEN, "
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
            self._reply(200, encode({"ok": True, "pid": os.getpid(), "store": self.server.store.url}))
        else:
            self._reply(404, encode({"error": f"no such path {self.path}"}))

    def do_POST(self):
        if not self._authorized():
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if not self.path.startswith("/v1/"):
                raise StoreError(f"no such path {self.path}")
            args, table = decode(body)
            envelope, result = dispatch(self.server.store, self.path[4:], args, table, self.server.sql_limits)
            self._reply(200, encode(envelope, result))
        except StoreError as e:
            self._reply(400, encode({"error": str(e)}))
        except Exception as e:  # a bug or a broken request: answer, keep serving
            self._reply(500, encode({"error": f"{type(e).__name__}: {first_line(e)}"}))


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
            token = httpd.token = write_token(tokens, f"http://{host}:{bound}")
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
