"""Per-peer transfer times of NCCL collectives, from NCCL's profiler plugin interface (NCCL 2.23 and later).

On a GPU fleet the host sees a collective enter and leave at once, and the GPU
events of ``RankExporter.gpu_mark`` time the whole collective, not each
connection. Where each peer's share comes from on InfiniBand or RoCE is NCCL's
own proxy thread: with a profiler plugin loaded (``NCCL_PROFILER_PLUGIN``),
NCCL reports a *ProxyOp* event per channel and peer of every collective (its
peer, channel, direction and bytes, with state changes such as a sender
waiting for the receiver's credits or a receiver waiting for data), under the
collective's event (its communicator's hash and name and the collective's
sequence number in that communicator, its element count and type).

The plugin we run (``ingest/nccl_profiler/plugin.c``, armed by ``stragglerscope
trace`` on CUDA jobs) writes one fixed-size ``RECORD`` per communicator it sees
(``KIND_COMM``) and per finished ProxyOp (``KIND_PROXY_OP``; ``KIND_P2P_OP``
for the ProxyOps of point-to-point calls) to ``nccl-peers-<pid>.bin`` in the
directory ``STRAGGLERSCOPE_NCCL_PEERS_DIR`` names, appending, from a writer
thread of its own, and a ``KIND_DROPS`` record with the count of records it
dropped (its queue full) whenever that count grew. Times are
``CLOCK_MONOTONIC`` nanoseconds (Python's ``time.perf_counter_ns``). NCCL
before 2.27 (profiler interface v1-v3) does not tell the plugin a
communicator's size: its records have ``nranks`` 0, and such a communicator is
matched by this rank's place in it and the bytes of a collective. This module reads that file off the training thread
and folds it into the collective records the exporter already sends
(``peer_transfer_ns``, ``peer_bytes``, one per peer in ``peers`` order; -1 and
0 for a peer the collective did not talk to, as in a ring), which the link
diagnosis reads as a measured matrix (``analyzers/links/reported.py``).

Which of our groups a communicator is: the one whose size and this rank's
place in it match, named alike, or else the one whose collective at the same
sequence number moved the same bytes, once that singles one out. A record that
cannot be matched (an unbound communicator, a sequence number whose bytes
disagree: a collective counted on one side only) is left as it was, and
counted in ``stats``. Not mapped yet: point-to-point calls. The plugin numbers
them per communicator, peer and direction (``seq``), but which of our
``p2p:a>b`` pairs a communicator's peer is needs the communicator's members,
which NCCL does not tell a profiler; they are counted (``stats.p2p_records``).
"""
from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any

import numpy as np

VERSION = 1
KIND_COMM, KIND_PROXY_OP, KIND_P2P_OP, KIND_DROPS = 0, 1, 2, 3

RECORD = np.dtype([
    ("version", "<u2"), ("kind", "u1"), ("is_send", "u1"), ("channel", "<i4"),
    ("comm_hash", "<u8"), ("seq", "<u8"),       # the communicator; the collective's number in it
    ("rank", "<i4"), ("nranks", "<i4"),         # this rank's place in the communicator, and its size
    ("peer", "<i4"), ("reserved", "<i4"),       # the peer's rank in the communicator
    ("coll_bytes", "<u8"),                      # the collective's count x its datatype's size
    ("bytes", "<u8"),                           # moved to or from the peer on this channel
    ("start_ns", "<i8"), ("wait_ns", "<i8"), ("end_ns", "<i8"),  # wait: for credits (send), for data (recv)
    ("name", "S32"),                            # the communicator's name (KIND_COMM), as NCCL was told it
])
"""One record of the plugin's file, little-endian, 112 bytes. ``seq``: the collective's number among the
communicator's collectives of every kind (NCCL's own numbers count each kind apart); for ``KIND_P2P_OP``
its number among the calls to or from that peer in that direction, and ``reserved`` the peer of the call.
``KIND_DROPS``: ``bytes`` is how many records the plugin dropped so far."""

ENV_DIR = "STRAGGLERSCOPE_NCCL_PEERS_DIR"


def path_for(directory: str, pid: int | None = None) -> str:
    """The file the plugin in process ``pid`` (default: this one) writes."""
    return os.path.join(directory, f"nccl-peers-{os.getpid() if pid is None else pid}.bin")


@dataclasses.dataclass
class PeerTimingStats:
    records: int = 0
    bad_records: int = 0
    """Records of another version or kind, or with impossible fields: skipped."""
    filled: int = 0
    """Collective records given per-peer times."""
    unmatched: int = 0
    """Collective records no communicator could be matched to, or whose sequence number's bytes disagreed."""
    p2p_records: int = 0
    """ProxyOps of point-to-point calls read (not mapped to records yet)."""
    plugin_dropped: int = 0
    """Records the plugin dropped, its queue full (its last KIND_DROPS record)."""


class _Op:
    __slots__ = ("coll_bytes", "sends", "recvs")

    def __init__(self, coll_bytes: int):
        self.coll_bytes = coll_bytes
        self.sends: dict[int, list[int]] = {}  # peer -> [bytes, transfer ns, wait ns]
        self.recvs: dict[int, list[int]] = {}


class PeerTimingFeed:
    """Reads the plugin's file as it grows and fills collective records with per-peer times."""

    def __init__(self, path: str, max_ops: int = 65_536):
        self.path = path
        self.max_ops = max_ops
        self.stats = PeerTimingStats()
        self._offset = 0
        self._rest = b""
        self._comms: dict[int, tuple[str, int, int]] = {}  # hash -> (name, rank, nranks)
        self._ops: collections.OrderedDict[tuple[int, int], _Op] = collections.OrderedDict()
        self._bound: dict[str, int] = {}  # our group -> communicator hash

    @classmethod
    def from_env(cls) -> "PeerTimingFeed | None":
        directory = os.environ.get(ENV_DIR)
        return cls(path_for(directory)) if directory else None

    # -- reading ----------------------------------------------------------------
    def poll(self) -> int:
        """Read what the plugin appended since the last call; returns the records read. Never raises for a
        missing file (the plugin writes it on its first communicator)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return 0
        self._offset += len(data)
        data = self._rest + data
        n = len(data) // RECORD.itemsize
        self._rest = data[n * RECORD.itemsize:]
        if n:
            self._take(np.frombuffer(data, RECORD, count=n))
        return n

    def _take(self, recs: np.ndarray) -> None:
        self.stats.records += len(recs)
        # nranks 0: a communicator whose size NCCL did not tell (profiler interface v1-v3).
        sized = recs["nranks"] > 0
        ok = (recs["version"] == VERSION) & (recs["nranks"] >= 0) & (recs["rank"] >= 0) \
            & (~sized | (recs["rank"] < recs["nranks"]))
        self.stats.bad_records += int((~ok).sum())
        drops = recs[ok & (recs["kind"] == KIND_DROPS)]
        if len(drops):
            self.stats.plugin_dropped = max(self.stats.plugin_dropped, int(drops["bytes"].max()))
        self.stats.p2p_records += int((ok & (recs["kind"] == KIND_P2P_OP)).sum())
        for r in recs[ok & (recs["kind"] == KIND_COMM)]:
            self._comms[int(r["comm_hash"])] = (r["name"].split(b"\0")[0].decode("utf-8", "replace"),
                                                int(r["rank"]), int(r["nranks"]))
        ops = recs[ok & (recs["kind"] == KIND_PROXY_OP)]
        good = (ops["peer"] >= 0) & ((ops["nranks"] == 0) | (ops["peer"] < ops["nranks"])) \
            & (ops["end_ns"] >= ops["start_ns"])
        self.stats.bad_records += int((~good).sum()) + int((ok & (recs["kind"] > KIND_DROPS)).sum())
        for r in ops[good]:
            key = (int(r["comm_hash"]), int(r["seq"]))
            op = self._ops.get(key)
            if op is None:
                op = self._ops[key] = _Op(int(r["coll_bytes"]))
                if len(self._ops) > self.max_ops:
                    self._ops.popitem(last=False)
            side = op.sends if r["is_send"] else op.recvs
            # A channel's transfer is its span less its wait (a sender waiting for the receiver's credits,
            # a receiver for the first data): the wait is the other end's lateness, not this path's speed.
            # The channels of one peer run side by side: the slowest of them, their bytes summed.
            wait = max(0, int(r["wait_ns"]))
            took = max(0, int(r["end_ns"]) - int(r["start_ns"]) - wait)
            peer, b = int(r["peer"]), int(r["bytes"])
            cur = side.get(peer)
            if cur is None:
                side[peer] = [b, took, wait]
            else:
                cur[0] += b
                cur[1], cur[2] = max(cur[1], took), max(cur[2], wait)

    # -- matching -----------------------------------------------------------------
    def _comm_of(self, group: str, ranks: list[int], rank: int, seq: int, nbytes: int) -> int | None:
        if group in self._bound:
            return self._bound[group]
        if rank not in ranks:
            return None
        me, size = ranks.index(rank), len(ranks)
        taken = set(self._bound.values())
        fits = [h for h, (_, r, n) in self._comms.items() if r == me and n in (size, 0) and h not in taken]
        named = [h for h in fits if self._comms[h][0] == group]
        agree = [h for h in fits if (h, seq) in self._ops and self._ops[(h, seq)].coll_bytes == nbytes]
        # A communicator of unknown size is never bound by its name alone: its size could differ.
        named = [h for h in named if self._comms[h][2] or h in agree]
        pick = named or agree
        if len(pick) == 1:
            self._bound[group] = pick[0]
            return pick[0]
        return None

    def fill_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``fill`` of each row, after one read of the file (the exporter calls it once a step)."""
        self.poll()
        return [self.fill(r) for r in rows]

    def fill(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` (a CCL record as ``ccl_exit`` builds it) with ``peer_transfer_ns`` and ``peer_bytes`` from
        what was read of the plugin's file (``poll``), where its collective is found; else ``row`` unchanged.
        Point-to-point rows pass as they are."""
        if row.get("peer_transfer_ns") or str(row.get("group", "")).startswith("p2p:"):
            return row
        ranks = list(row["group_ranks"])
        comm = self._comm_of(row["group"], ranks, row["rank"], row["seq"], row["nbytes"])
        op = self._ops.get((comm, row["seq"])) if comm is not None else None
        if op is None or op.coll_bytes != row["nbytes"]:
            self.stats.unmatched += 1
            return row
        index = {g: i for i, g in enumerate(ranks)}
        times, sizes = [], []
        for p in row["peers"]:
            sent = op.sends.get(index.get(p, -1))
            times.append(sent[1] if sent else -1)
            sizes.append(sent[0] if sent else 0)
        waits = [v[2] for v in op.recvs.values()]
        self.stats.filled += 1
        return dict(row, peer_transfer_ns=times, peer_bytes=sizes,
                    recv_wait_ns=max(waits) if waits else row.get("recv_wait_ns", -1))


def write_records(path: str, rows: list[dict[str, Any]]) -> None:
    """Append ``rows`` (fields of ``RECORD``; the others 0) to the file as the plugin does: tests and the
    fake plugin of ``tests/`` use it."""
    recs = np.zeros(len(rows), RECORD)
    for i, r in enumerate(rows):
        recs[i]["version"] = r.get("version", VERSION)
        for k, v in r.items():
            if k != "version":
                recs[i][k] = v.encode() if isinstance(v, str) else v
    with open(path, "ab") as f:
        f.write(recs.tobytes())
