"""A second path out of every rank: what tells a slow NIC from a slow link where a rank sends to one peer only.

In gloo's ring all-reduce (the flat data-parallel job, the most common there
is) each rank sends to one peer, so its NIC and that one link carry exactly
the same traffic and nothing the job does tells them apart
(``analyzers/links/tcp.py``). Once a window each rank therefore sends
``nbytes`` to one other rank (``peer_of``: half the ring away, never a ring
neighbour) over a connection of its own, on the address its job's
connections use, and both ends measure that transfer with ``TCP_INFO`` as
the job's own connections are measured. The rows go out as TCP_FLOW records
marked ``probe``: the analysis compares the probes with each other (the
same size, the same moment), never with the job's flows. A sender whose
probe ran at the others' rate has a healthy NIC; one whose probe crawled
has a slow one.

Cost: ``nbytes`` (256 KB) a window per rank, a listening socket, and two
daemon threads that sleep on a queue and a selector; nothing runs on the
training thread but ``fire`` (a queue put). Errors are counted and logged
once, never raised: a probe that cannot connect or times out is skipped.
Where NCCL runs over InfiniBand the probe measures the hosts' IP network,
not the fabric the job uses; it is meant for jobs whose transfers are TCP
(gloo, NCCL over sockets), where ``ingest/tcp_flows.py`` found connections
between ranks.
"""
from __future__ import annotations

import collections
import logging
import queue
import selectors
import socket
import struct
import threading
import time

from ingest.tcp_flows import TCP_INFO_LEN, TcpFlowSampler, counters, endpoint, parse_tcp_info

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<qqq")  # payload bytes, window, step
PROBE_BYTES = 256 << 10
"""Bytes a rank sends a window: several round trips of a healthy path (slow start included), a tenth of a
second over a 20mbit one; next to a window's gradients (megabytes to gigabytes a step) it is noise."""


def peer_of(rank: int, world: int) -> int | None:
    """The rank ``rank`` probes: half the ring away, so never the neighbour a ring sends to (either way)."""
    if world < 3:
        return None  # a pair has no second peer: nothing to tell apart
    return (rank + world // 2) % world


def job_host(fd_dir: str = "/proc/self/fd") -> str | None:
    """The local address most of this process's established TCP connections use (the job's own network), or
    None without any. Read once, when the probe is made."""
    hosts = collections.Counter(local.rpartition(":")[0].strip("[]")
                                for local, _ in TcpFlowSampler(fd_dir=fd_dir).connections())
    return hosts.most_common(1)[0][0] if hosts else None


def _tcp_info(sock: socket.socket) -> dict[str, int] | None:
    try:
        return parse_tcp_info(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN))
    except OSError:
        return None


def _row(local: str, remote: str, window: int, step: int, before: dict, after: dict, elapsed_ns: int,
         sent: bool) -> dict:
    """TCP_FLOW fields (less job, attempt and rank) of one probe transfer, from two TCP_INFO readings.

    The sender's busy time is the transfer's own wall time, from its first byte written to the receiver's
    word that it read the last (one round trip more than the data took): the kernel keeps busy time in
    jiffies, and a 300 KB probe over loopback came out 0 or 4,000 us."""
    row = counters(local, remote, before, after, elapsed_ns)
    return dict(row, window_id=window, step=step, busy_us=max(1, elapsed_ns // 1000) if sent else 0, probe=True)


class PathProbe:
    """One rank's probe: a listener that receives and measures its peers' probes, and a sender for its own."""

    def __init__(self, host: str, nbytes: int = PROBE_BYTES, timeout_s: float = 5.0):
        self.nbytes = nbytes
        self.timeout_s = timeout_s
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=64)
        self._listener.setblocking(False)
        self.address = endpoint(self._listener.getsockname())
        self._peer: tuple[str, int] | None = None
        self._fires: queue.SimpleQueue = queue.SimpleQueue()
        self._rows: collections.deque = collections.deque(maxlen=1024)  # measured, not yet taken
        self._closed = threading.Event()
        self.sent = self.received = self.errors = 0
        self._said: set[str] = set()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._threads = [threading.Thread(target=self._receive_loop, name="ss-probe-recv", daemon=True),
                         threading.Thread(target=self._send_loop, name="ss-probe-send", daemon=True)]
        for t in self._threads:
            t.start()

    def aim(self, peer: str) -> None:
        """Probe the rank listening on ``peer`` (its claim's ``ip:port``) from now on."""
        host, _, port = peer.rpartition(":")
        self._peer = (host.strip("[]"), int(port))

    def endpoints(self) -> set[str]:
        """Its listener's address and the one it sends to: every connection of the probe has one of them."""
        return {self.address} | ({endpoint(self._peer)} if self._peer is not None else set())

    def fire(self, window: int, step: int) -> None:
        """Send one probe, labelled with the step it is sent in (non-blocking; the sender thread sends)."""
        if self._peer is not None and not self._closed.is_set():
            self._fires.put((window, step))

    def take_rows(self) -> list[dict]:
        """The measured probes (both ends': what this rank sent and what it received) since the last call."""
        out = []
        while self._rows:
            out.append(self._rows.popleft())
        return out

    def close(self) -> None:
        self._closed.set()
        self._fires.put(None)
        for t in self._threads:
            t.join(timeout=2.0)
        try:
            self._sel.close()
        except Exception:
            pass
        self._listener.close()

    def _failed(self, what: str, e: BaseException) -> None:
        self.errors += 1
        if what not in self._said:  # once per kind: a peer that is gone would fill the log every window
            self._said.add(what)
            log.warning("path probe: %s failed: %s", what, e)

    # -- sending ------------------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        sock = None
        payload = bytes(self.nbytes)
        while True:
            item = self._fires.get()
            if item is None:
                break
            while True:  # only the latest fire counts: a backlog would send probes into the wrong steps
                try:
                    nxt = self._fires.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._fires.put(None)
                    break
                item = nxt
            window, step = item
            try:
                if sock is None:
                    sock = socket.create_connection(self._peer, timeout=self.timeout_s)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                before, t0 = _tcp_info(sock), time.monotonic_ns()
                sock.sendall(_HEAD.pack(self.nbytes, window, step) + payload)
                if sock.recv(1) != b"\x01":  # the receiver read it all: every byte is acknowledged by now
                    raise ConnectionError("the receiver closed the probe connection")
                after, t1 = _tcp_info(sock), time.monotonic_ns()
                if before is not None and after is not None:
                    self._rows.append(_row(endpoint(sock.getsockname()), endpoint(sock.getpeername()), window,
                                           step, before, after, t1 - t0, sent=True))
                self.sent += 1
            except (OSError, ValueError) as e:
                self._failed("sending a probe", e)
                if sock is not None:
                    sock.close()
                sock = None
        if sock is not None:
            sock.close()

    # -- receiving ----------------------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        state: dict[socket.socket, list] = {}  # conn -> [buffer, needed, header, TCP_INFO at its first byte, t0]
        while not self._closed.is_set():
            try:
                events = self._sel.select(timeout=0.5)
            except (OSError, ValueError):
                return  # closed
            for key, _ in events:
                if key.fileobj is self._listener:
                    try:
                        conn, _ = self._listener.accept()
                        conn.setblocking(False)
                        self._sel.register(conn, selectors.EVENT_READ, None)
                        state[conn] = [bytearray(), _HEAD.size, None, None, 0]
                    except OSError as e:
                        self._failed("accepting a probe", e)
                    continue
                conn = key.fileobj
                try:
                    self._read(conn, state[conn])
                except (OSError, ValueError, struct.error) as e:
                    if not isinstance(e, ConnectionError) or str(e) != "closed":
                        self._failed("receiving a probe", e)
                    self._sel.unregister(conn)
                    state.pop(conn, None)
                    conn.close()
        for conn in state:
            conn.close()

    def _read(self, conn: socket.socket, st: list) -> None:
        if st[3] is None and not st[0]:
            st[3], st[4] = _tcp_info(conn), time.monotonic_ns()  # before this probe's first byte is taken
        chunk = conn.recv(1 << 20)
        if not chunk:
            raise ConnectionError("closed")
        st[0] += chunk
        while len(st[0]) >= st[1]:
            if st[2] is None:
                nbytes, window, step = _HEAD.unpack_from(st[0])
                if not 0 < nbytes <= 64 << 20:
                    raise ValueError(f"a probe of {nbytes} bytes")
                st[2] = (window, step)
                del st[0][:_HEAD.size]
                st[1] = nbytes
                continue
            del st[0][:st[1]]
            after, t1 = _tcp_info(conn), time.monotonic_ns()
            conn.setblocking(True)
            conn.sendall(b"\x01")
            conn.setblocking(False)
            if st[3] is not None and after is not None:
                self._rows.append(_row(endpoint(conn.getsockname()), endpoint(conn.getpeername()), *st[2],
                                       st[3], after, t1 - st[4], sent=False))
            self.received += 1
            st[1], st[2], st[3] = _HEAD.size, None, None
