"""What a host's InfiniBand/RoCE ports say of themselves: waits, discards, errors and flaps, sampled beside training.

A link finding names a rank pair; the NIC port behind it often says why: a
port that keeps data waiting for credits (``port_xmit_wait``) sits on a
congested link or switch, one whose link went down or retrained
(``link_downed``, ``link_error_recovery``) with symbol errors is a bad cable
or transceiver. The kernel keeps these counters per port in sysfs::

    /sys/class/infiniband/<device>/ports/<n>/counters/<name>      (IB PortCounters, all RDMA drivers)
    /sys/class/infiniband/<device>/ports/<n>/hw_counters/<name>   (driver counters where present: mlx5's
                                                                   out_of_buffer, np_cnp_sent, ...)
    /sys/class/infiniband/<device>/ports/<n>/state                ("4: ACTIVE")

Each file holds one decimal number. ``port_xmit_data`` and ``port_rcv_data``
count 4-octet words (the IB spec's PortXmitData/PortRcvData); the rows carry
bytes. ``port_xmit_wait`` counts ticks whose length the hardware defines.

``PortCounterSampler.sample()`` reads every port's counters and returns the
differences since its previous reading as rows of ``core.schema.PORT_COUNTER``
(less the job's identity, which the exporter adds). A counter that went
backwards was reset (or wrapped): it is counted from 0 and the row says
``reset``. A file that cannot be read or holds no number is left out of that
row (-1) and said once in the log: never an exception. A host without
InfiniBand reads nothing and says so once (``unavailable``, one log line).

Cost, kept off the training thread (the exporter's heartbeat thread reads): a
fixed list of files per port, at most ``max_ports`` ports, found once and again
every ``rescan_s``; and sampling backs off so that it never takes more than
``MAX_DUTY`` of that thread's time on a host whose reads are slow (a driver that
asks its firmware on every read). Measured by ``benchmarks/port_counters_cost.py``.

One rank per host reports (``reports_ports``): the host's ports are the same for
all its ranks.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

log = logging.getLogger(__name__)

SYSFS_ENV = "STRAGGLERSCOPE_SYSFS_IB"
"""Where the exporter looks instead of /sys/class/infiniband (tests lay out fake trees there)."""
DEFAULT_ROOT = "/sys/class/infiniband"

COUNTER_FILES = {
    "port_xmit_wait": "xmit_wait",
    "port_xmit_discards": "xmit_discards",
    "port_rcv_discards": "rcv_discards",
    "symbol_error": "symbol_errors",
    "port_rcv_errors": "rcv_errors",
    "link_downed": "link_downed",
    "link_error_recovery": "link_error_recovery",
    "port_xmit_data": "xmit_bytes",
    "port_rcv_data": "rcv_bytes",
}
"""File under ``ports/<n>/counters`` -> PORT_COUNTER field."""
WORD_COUNTERS = frozenset({"port_xmit_data", "port_rcv_data"})
"""Counters in units of 4 octets (IB spec): multiplied by 4 into bytes."""
HW_COUNTERS = (
    "out_of_buffer", "out_of_sequence", "packet_seq_err", "local_ack_timeout_err", "rnr_nak_retry_err",
    "implied_nak_seq_err", "duplicate_request", "np_cnp_sent", "rp_cnp_handled", "np_ecn_marked_roce_packets",
)
"""The ``hw_counters`` read where the driver has them (mlx5's names): drops for want of receive buffers,
retransmission causes and congestion notifications. A fixed list keeps the cost bounded: a driver has dozens."""
FIELDS = tuple(COUNTER_FILES.values())
MAX_PORTS = 16
"""Ports read at most (8 NICs of 2 ports is the largest common GPU host); the rest are ignored, and said once."""
MAX_DUTY = 0.01
"""Sampling takes at most this share of the reading thread's time: after a reading that took t seconds, the next
is not before t / MAX_DUTY later."""


@dataclasses.dataclass(frozen=True)
class Reading:
    """One port's counters at one moment (``time.monotonic_ns``); None where a file could not be read."""

    at_ns: int
    state: str
    values: dict[str, int | None]
    hw: dict[str, int | None]


@dataclasses.dataclass(frozen=True)
class _Port:
    device: str
    port: int
    path: str
    counters: tuple[str, ...]  # the COUNTER_FILES present
    hw: tuple[str, ...]        # the HW_COUNTERS present


def reports_ports(environ=None) -> bool:
    """Whether this process reads its host's ports: local rank 0 (``LOCAL_RANK``, as torchrun and most launchers
    set it), or a process that is not told its local rank (taken to be alone on its host)."""
    value = (os.environ if environ is None else environ).get("LOCAL_RANK", "").strip()
    try:
        return not value or int(value) == 0
    except ValueError:  # a launcher's odd value: one rank per host cannot be told, so no second reader is made
        return False


def counter_delta(before: int | None, after: int | None) -> tuple[int, bool]:
    """(difference, reset) of one counter between two readings; (-1, False) where either is unknown.

    A smaller value than before means the counter was reset (``perfquery -x -r``, a driver reload) or wrapped:
    what it counts since is the new value, from 0."""
    if before is None or after is None:
        return -1, False
    if after >= before:
        return after - before, False
    return after, True


def delta(before: Reading, after: Reading) -> dict:
    """PORT_COUNTER fields (less job, attempt, rank, host, device, port and ts_ns) between two readings."""
    row: dict = {"elapsed_ns": max(0, after.at_ns - before.at_ns), "state": after.state}
    reset = False
    for name, field in COUNTER_FILES.items():
        d, r = counter_delta(before.values.get(name), after.values.get(name))
        reset |= r
        row[field] = d * 4 if d > 0 and name in WORD_COUNTERS else d
    hw = {}
    for name in HW_COUNTERS:
        if name in after.hw:
            d, r = counter_delta(before.hw.get(name), after.hw.get(name))
            if d >= 0:
                reset |= r
                hw[name] = d
    row.update(hw_counters_json=json.dumps(hw, separators=(",", ":")), reset=reset)
    return row


class PortCounterSampler:
    """Reads the ports under ``root`` (default: ``$STRAGGLERSCOPE_SYSFS_IB``, else /sys/class/infiniband).

    ``sample()`` returns one row per port (the differences since the previous call; [] on the first, and while
    backing off). ``unavailable`` says why nothing is read (no InfiniBand), once."""

    def __init__(self, root: str | None = None, *, max_ports: int = MAX_PORTS, rescan_s: float = 300.0,
                 clock=time.monotonic_ns, timer=time.perf_counter_ns):
        """``clock``: when readings are taken and the next is due (ns); ``timer``: what a reading costs (ns). Both
        injected so that tests drive them."""
        self.root = root or os.environ.get(SYSFS_ENV) or DEFAULT_ROOT
        self.max_ports = max_ports
        self.rescan_s = rescan_s
        self._clock = clock
        self._timer = timer
        self.unavailable = ""
        self._ports: list[_Port] = []
        self._scanned_ns: int | None = None
        self._last: dict[tuple[str, int], Reading] = {}
        self._next_ns = 0
        self._said: set[str] = set()  # what was logged already: each problem once, not every heartbeat
        self.samples = 0
        self.skipped = 0   # counter readings left out (unreadable, not a number)
        self.last_cost_ns = 0

    # -- finding the ports ------------------------------------------------------------------------------------
    def _say(self, key: str, level: int, msg: str, *args) -> None:
        if key not in self._said:
            self._said.add(key)
            log.log(level, msg, *args)

    def _scan(self, now_ns: int) -> None:
        """The ports and which of our files each has; rescanned every ``rescan_s`` (a driver reloaded, a NIC
        replaced). Nothing found: ``unavailable``, said once."""
        self._scanned_ns = now_ns
        ports = []
        try:
            devices = sorted(os.listdir(self.root))
        except OSError:
            devices = []
        for dev in devices:
            try:
                nums = sorted(os.listdir(os.path.join(self.root, dev, "ports")), key=lambda n: (len(n), n))
            except OSError:
                continue
            for n in nums:
                if not n.isdigit():
                    continue
                path = os.path.join(self.root, dev, "ports", n)
                counters = tuple(c for c in COUNTER_FILES if os.path.exists(os.path.join(path, "counters", c)))
                hw = tuple(c for c in HW_COUNTERS if os.path.exists(os.path.join(path, "hw_counters", c)))
                if counters or hw:
                    ports.append(_Port(dev, int(n), path, counters, hw))
        if len(ports) > self.max_ports:
            self._say("max_ports", logging.WARNING, "port counters: %d ports under %s, reading the first %d",
                      len(ports), self.root, self.max_ports)
            ports = ports[:self.max_ports]
        self._ports = ports
        if not ports and not self.unavailable:
            self.unavailable = f"no InfiniBand/RoCE port counters under {self.root}"
            log.info("%s: this host's fabric ports are not sampled", self.unavailable)
        elif ports:
            self.unavailable = ""
        self._last = {k: v for k, v in self._last.items() if k in {(p.device, p.port) for p in ports}}

    # -- reading ----------------------------------------------------------------------------------------------
    def _number(self, path: str) -> int | None:
        """The counter in ``path``, or None (said once per file) where it cannot be read or is not a number."""
        try:
            with open(path, "rb") as f:
                raw = f.read(64)
            value = int(raw.strip())
            if value < 0:
                raise ValueError(f"negative count {value}")
            return value
        except (OSError, ValueError) as e:
            self.skipped += 1
            self._say(path, logging.WARNING, "port counter %s skipped: %s", path, f"{type(e).__name__}: {e}"[:200])
            return None

    def _state(self, path: str) -> str:
        try:
            with open(os.path.join(path, "state"), "rb") as f:
                raw = f.read(64).decode("ascii", "replace").strip()
        except OSError:
            return ""
        return raw.partition(":")[2].strip() or raw  # "4: ACTIVE" -> "ACTIVE"

    def read(self) -> dict[tuple[str, int], Reading]:
        """Every port's counters now: (device, port) -> Reading."""
        now = self._clock()
        if self._scanned_ns is None or now - self._scanned_ns >= self.rescan_s * 1e9:
            self._scan(now)
        out = {}
        for p in self._ports:
            values = {c: self._number(os.path.join(p.path, "counters", c)) for c in p.counters}
            hw = {c: self._number(os.path.join(p.path, "hw_counters", c)) for c in p.hw}
            out[(p.device, p.port)] = Reading(self._clock(), self._state(p.path), values, hw)
        return out

    def sample(self) -> list[dict]:
        """Rows of the differences since the last reading, one per port seen in both (device and port included);
        [] on the first call, where no port exists, and while backing off. Never raises."""
        t0, c0 = self._clock(), self._timer()
        if t0 < self._next_ns:
            return []
        try:
            now = self.read()
        except Exception as e:  # a bug or an odd tree: nothing this time, the heartbeat goes on
            self._say("read", logging.WARNING, "port counters not read: %s", f"{type(e).__name__}: {e}"[:300])
            return []
        rows = []
        for key, after in now.items():
            before = self._last.get(key)
            if before is not None:
                rows.append(dict(device=key[0], port=key[1], **delta(before, after)))
        self._last = now
        cost = max(0, self._timer() - c0)
        self.last_cost_ns = cost
        self._next_ns = t0 + int(cost / MAX_DUTY)
        if rows:
            self.samples += 1
        return rows
