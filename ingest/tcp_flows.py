"""What the kernel knows of this process's TCP connections: per-connection counters for the link diagnosis.

A flat data-parallel ring has one observation per window, its all-reduce, in
which every rank takes part: enter and exit times cannot say whose NIC, link
or receiver is slow. The kernel can: for every connection it counts the
bytes acknowledged and received, the time data was in flight ("busy"), how
much of it the receive window or the send buffer limited, the smoothed RTT
and the retransmissions (``TCP_INFO``, Linux 4.10 and later for the busy
times). gloo keeps one TCP connection per pair of ranks, NCCL's socket
transport a few; this module reads them for the exporter.

``TcpFlowSampler.read()`` returns a snapshot of every established TCP
connection of this process, keyed by (local, remote) endpoint; ``delta``
turns two snapshots into the rows of ``core.schema.TCP_FLOW``. Which rank is
at the other end is not known here: that rank's own records have the same
two endpoints the other way round, and the analyzer pairs them
(``analyzers/links/tcp.py``). Nothing is sent over the network to learn it.

Cost, kept off the training thread (the exporter's own thread reads): the
socket file descriptors are found by listing ``/proc/self/fd`` at most every
``rescan_s`` (a connection opened since is found then); each reading is one
``getsockopt`` per connection on a duplicate of its descriptor (the training
code's socket is never touched), 10-25 us each on the 2-core VM, and a
connection idle for ``IDLE_READS`` readings is skipped until the next scan. Where ``/proc`` or ``TCP_INFO`` is missing
(not Linux) the sampler reads nothing and says so once in ``unavailable``.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import struct
import time

# Offsets in struct tcp_info (linux/tcp.h); a kernel returns a prefix of it, as long as it knows.
_FIELDS = {
    "rtt_us": (68, "I"),
    "total_retrans": (100, "I"),
    "bytes_acked": (120, "Q"),
    "bytes_received": (128, "Q"),
    "notsent_bytes": (144, "I"),
    "min_rtt_us": (148, "I"),
    "busy_us": (168, "Q"),
    "rwnd_limited_us": (176, "Q"),
    "sndbuf_limited_us": (184, "Q"),
}
IDLE_READS = 3
"""Readings a connection may carry nothing in before it is skipped until the next scan of the descriptors."""
TCP_INFO_LEN = 192
"""Bytes of tcp_info asked for: through ``tcpi_sndbuf_limited`` (Linux 4.10)."""
_ESTABLISHED = 1


@dataclasses.dataclass(frozen=True)
class Reading:
    """One connection's counters at one moment (``time.monotonic_ns``)."""
    at_ns: int
    values: dict[str, int]


def endpoint(addr) -> str:
    """'ip:port' of a socket address; IPv6 as '[ip]:port'; an IPv4-mapped IPv6 address as plain IPv4, so both
    ends of a connection name each other alike whichever family each socket has."""
    host, port = addr[0], addr[1]
    if ":" in host:
        if host.startswith("::ffff:") and "." in host:
            host = host[len("::ffff:"):]
        else:
            return f"[{host}]:{port}"
    return f"{host}:{port}"


def parse_tcp_info(raw: bytes) -> dict[str, int] | None:
    """The counters we read, from a ``getsockopt(TCP_INFO)`` answer; None for a connection not established or
    a kernel too old to have the busy times."""
    if len(raw) < 192 or raw[0] != _ESTABLISHED:
        return None
    return {name: struct.unpack_from("<" + fmt, raw, off)[0] for name, (off, fmt) in _FIELDS.items()}


class TcpFlowSampler:
    """Readings of this process's TCP connections. Not thread-safe: one thread reads."""

    def __init__(self, rescan_s: float = 5.0, fd_dir: str = "/proc/self/fd"):
        self.rescan_s = rescan_s
        self.fd_dir = fd_dir
        self.unavailable = "" if hasattr(socket, "TCP_INFO") and os.path.isdir(fd_dir) else \
            "TCP_INFO or /proc is not available here: no per-connection evidence"
        self._fds: dict[int, tuple[str, str]] = {}  # fd -> (local, remote) of a connected TCP socket
        self._scanned = -1e18
        # gloo keeps a connection to every peer and a ring uses two: the others are skipped once idle for
        # IDLE_READS readings, until the next scan (a 1,024-rank job's rank holds 1,023 connections).
        self._last_bytes: dict[int, tuple[int, int]] = {}
        self._idle: dict[int, int] = {}
        # Endpoints whose connections are not the job's (the path probe's listener and the peer listener it
        # sends to, ingest/path_probe.py, which measures its own): a connection with either end here is skipped.
        self.ignore: frozenset[str] = frozenset()

    def _rescan(self) -> None:
        """Find the connected TCP sockets among the descriptors (a socket's descriptor may have been reused)."""
        found: dict[int, tuple[str, str]] = {}
        try:
            names = os.listdir(self.fd_dir)
        except OSError:
            return
        for name in names:
            if not name.isdigit():
                continue
            fd = int(name)
            try:
                if not os.readlink(os.path.join(self.fd_dir, name)).startswith("socket:["):
                    continue
            except OSError:
                continue
            ends = self._ends(fd)
            if ends is not None:
                found[fd] = ends
        self._fds = found
        self._idle.clear()

    @staticmethod
    def _ends(fd: int) -> tuple[str, str] | None:
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None
        try:
            if dup.type != socket.SOCK_STREAM or dup.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            return endpoint(dup.getsockname()), endpoint(dup.getpeername())
        except OSError:  # a listening socket, or one not connected yet
            return None
        finally:
            dup.close()

    def connections(self) -> list[tuple[str, str]]:
        """(local, remote) of every connected TCP socket of this process now (a fresh scan)."""
        if self.unavailable:
            return []
        self._rescan()
        return list(self._fds.values())

    def read(self) -> dict[tuple[str, str], Reading]:
        """Every established TCP connection of this process now: (local, remote) -> its counters."""
        if self.unavailable:
            return {}
        now = time.monotonic_ns()
        if now - self._scanned > self.rescan_s * 1e9:
            self._scanned = now
            self._rescan()
        out: dict[tuple[str, str], Reading] = {}
        gone = []
        ignore = self.ignore
        for fd, ends in self._fds.items():
            if self._idle.get(fd, 0) >= IDLE_READS or (ignore and (ends[0] in ignore or ends[1] in ignore)):
                continue
            try:
                dup = socket.socket(fileno=os.dup(fd))
            except OSError:
                gone.append(fd)
                continue
            try:
                if (endpoint(dup.getsockname()), endpoint(dup.getpeername())) != ends:
                    gone.append(fd)  # the descriptor now names another socket: found again at the next scan
                    continue
                values = parse_tcp_info(dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN))
            except OSError:
                gone.append(fd)
                continue
            finally:
                dup.close()
            if values is not None:
                out[ends] = Reading(time.monotonic_ns(), values)
                moved = (values["bytes_acked"], values["bytes_received"])
                self._idle[fd] = self._idle.get(fd, 0) + 1 if self._last_bytes.get(fd) == moved else 0
                self._last_bytes[fd] = moved
        for fd in gone:
            self._fds.pop(fd, None)
            self._last_bytes.pop(fd, None)
        return out


def counters(local: str, remote: str, a: dict[str, int], b: dict[str, int], elapsed_ns: int) -> dict:
    """TCP_FLOW fields (less job, rank, window and step) of one connection between two TCP_INFO readings
    ``a`` and ``b``: the counters are differences, RTT and unsent bytes as of ``b``."""
    def d(k: str) -> int:
        return max(0, b[k] - a[k])
    return dict(local=local, remote=remote, elapsed_ns=max(0, elapsed_ns), bytes_acked=d("bytes_acked"),
                bytes_received=d("bytes_received"), busy_us=d("busy_us"), rwnd_limited_us=d("rwnd_limited_us"),
                sndbuf_limited_us=d("sndbuf_limited_us"), rtt_us=b["rtt_us"], min_rtt_us=b["min_rtt_us"],
                retrans=d("total_retrans"), notsent_bytes=b["notsent_bytes"])


def delta(before: dict[tuple[str, str], Reading], after: dict[tuple[str, str], Reading]) -> list[dict]:
    """``counters`` of the connections in both readings that carried data in between."""
    rows = []
    for ends, b in after.items():
        a = before.get(ends)
        if a is None:
            continue
        now, was = b.values, a.values
        if now["bytes_acked"] <= was["bytes_acked"] and now["bytes_received"] <= was["bytes_received"]:
            continue  # idle: gloo keeps a connection to every peer, most carry nothing in a ring
        rows.append(counters(ends[0], ends[1], a.values, b.values, b.at_ns - a.at_ns))
    return rows
