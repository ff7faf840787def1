"""The daemon's client: ``HttpStore``, the Store API over a store daemon at ``http://127.0.0.1:PORT``.

Its Store methods are made from ``wire.REMOTE`` and the ``Store`` class
(name, signature, docstring), not written out one by one. The token comes
from the URL's ``token_file``, read when the store opens and again once
after a refusal (a daemon restarted on the same port has a new token).
"""
from __future__ import annotations

import abc
import http.client
import inspect
import threading
from urllib.parse import parse_qsl, quote, urlparse

import pyarrow as pa

from storage.daemon.files import read_token
from storage.daemon.wire import REMOTE, Remote, decode, encode
from storage.errors import StoreError, first_line
from storage.store import Store


def _forwarded(name: str, remote: Remote):
    """``HttpStore.<name>``: ``Store.<name>``'s signature, its call sent to the daemon as ``remote`` says."""
    abstract = getattr(Store, name)
    signature = inspect.signature(abstract)
    params = list(signature.parameters)[1:]  # less self
    if params != list(remote.args):
        raise TypeError(f"storage.daemon.wire declares {name}({', '.join(remote.args)}), "
                        f"but the Store API has {name}({', '.join(params)})")

    def method(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = {p: bound.arguments[p] for p in params}
        sent = remote.send(values)
        if sent is None:
            return None
        envelope, table = self._call(name, *sent)
        return remote.answer.unpack(envelope, table, values)

    method.__name__ = name
    method.__qualname__ = f"HttpStore.{name}"
    method.__doc__ = abstract.__doc__ or f"``Store.{name}``, run by the store daemon."
    method.__signature__ = signature
    return method


def _remote_methods(cls):
    """Give ``cls`` one method per name in ``REMOTE`` (the Store API's other abstract methods, ``wire.LOCAL``,
    it writes itself)."""
    for name, remote in REMOTE.items():
        setattr(cls, name, _forwarded(name, remote))
    abc.update_abstractmethods(cls)
    return cls


@_remote_methods
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
        body = encode(args, table)
        status, data = self._post(method, body, timeout)
        if status in (401, 403) and self.token_file:
            # A daemon restarted on this port has a new token in the same file: read it once more.
            token = read_token(self.token_file, self.address)
            if token != self._token:
                self._token = token
                status, data = self._post(method, body, timeout)
        try:
            envelope, result = decode(data)
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

    def close(self) -> None:
        self._drop_conn()
        self._closed = True
