"""A loopback port of the root network namespace, reachable at the same address inside other namespaces.

Why: the traced training processes run in their own network namespaces (``fabric.py``) but must reach
the Kafka broker, which listens on 127.0.0.1 of the root namespace and advertises 127.0.0.1:PORT to
its clients. So each namespace gets a listener on its own 127.0.0.1:PORT, and every accepted
connection is relayed to 127.0.0.1:PORT of the root namespace. Both ends stay on loopback: the
telemetry never crosses the veths whose traffic a test shapes.

A socket keeps the network namespace it was created in, and ``setns`` moves only the calling thread.
So a short-lived thread enters the target namespace, creates and binds the listening socket there,
and exits; every other thread of the forwarder (accepting, connecting upstream, relaying) stays in
the root namespace, where it was started.
"""
from __future__ import annotations

import ctypes
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)  # Python 3.11 has no os.setns


def in_netns(path: str, fn, *args):
    """``fn(*args)`` called in a fresh thread that first joined the network namespace at ``path``.

    The calling thread's namespace is unchanged; the helper thread ends with the call. What ``fn``
    raises is raised here.
    """
    def entered():
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({path}): {os.strerror(err)}")
        finally:
            os.close(fd)
        return fn(*args)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="netns-enter") as pool:
        return pool.submit(entered).result()


def _listen_loopback(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(128)
    return s


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until src ends, then pass the end on (half-close), so the peer sees EOF too."""
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass  # reset by either side, or shut down by close()
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class LoopbackForwarder:
    """Relays 127.0.0.1:port inside each added namespace to 127.0.0.1:port of the root namespace.

    ``add(path)`` returns once the namespace's listener is bound, so a process started afterwards
    can connect at once. Each connection gets two relay threads (one per direction) and lasts until
    both directions ended. ``close()`` stops the listeners and cuts the open connections; it is
    idempotent. A connection whose upstream refuses is closed at once (the client sees EOF).
    """

    def __init__(self, port: int):
        self.port = port
        self._lock = threading.Lock()
        self._listeners: list[socket.socket] = []
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def add(self, netns_path: str) -> None:
        listener = in_netns(netns_path, _listen_loopback, self.port)
        t = threading.Thread(target=self._accept, args=(listener,), daemon=True,
                             name=f"forward-{self.port}-accept")
        with self._lock:
            if self._closed:
                listener.close()
                raise RuntimeError("forwarder is closed")
            self._listeners.append(listener)
            self._threads.append(t)
        t.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was shut down by close()
            threading.Thread(target=self._relay, args=(client,), daemon=True,
                             name=f"forward-{self.port}-relay").start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        pair = (client, upstream)
        with self._lock:
            if self._closed:
                for s in pair:
                    s.close()
                return
            self._conns.update(pair)
        for s in pair:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # Kafka is request/response
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True,
                                name=f"forward-{self.port}-back")
        back.start()
        _pump(client, upstream)
        back.join()
        with self._lock:  # close() shuts down what is in _conns: never a socket closed here
            self._conns.difference_update(pair)
            for s in pair:
                s.close()

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for s in self._listeners + list(self._conns):
                try:
                    s.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept() or recv()
                except OSError:
                    pass
        for t in self._threads:
            t.join(timeout)
        for s in self._listeners:
            s.close()
