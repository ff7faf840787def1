"""The store daemon: one process owns a chDB path and serves the store API over HTTP on 127.0.0.1.

chDB allows one process per data path, but the pipeline has several writer
processes (Ray shard actors) and the console and ``stragglerscope sql`` read
at the same time. The daemon opens the path once and serves every call of
the ``Store`` API; ``open_store("http://127.0.0.1:PORT?token_file=...")`` is
a client with the same API (``HttpStore``), and ``open_store("chdb://PATH")``
becomes one whenever ``PATH/daemon.json`` names a live daemon.

- ``wire``: framing, and ``REMOTE``, the Store methods the daemon serves
  and how each crosses the wire (the server and the client both follow it);
- ``files``: ``daemon.json`` (discovery) and ``daemon.token`` (mode 0600);
- ``server``: ``serve``, the HTTP server: token check, dispatch;
- ``client``: ``HttpStore``;
- ``__main__``: ``python -m storage.daemon``.

The daemon as a child process (``StoreDaemon``) is a launcher: ``services/store_daemon.py``.
"""
from __future__ import annotations

from storage.daemon.client import HttpStore
from storage.daemon.files import DISCOVERY_FILE, TOKEN_FILE, daemon_url, discover, read_token, token_path
from storage.daemon.server import serve

__all__ = ["HttpStore", "serve", "discover", "daemon_url", "token_path", "read_token",
           "DISCOVERY_FILE", "TOKEN_FILE"]
