"""A private network for the ranks of a real training job, whose links a test can slow down with ``tc``.

Why: a straggler caused by the network (a slow NIC, a slow receiver, one slow link) must be told
apart from one caused by compute, and the only convincing test is real gloo traffic over links
whose rate changes while the job runs. On one machine, ranks talk over loopback, which cannot be
shaped per rank; so each rank gets its own network namespace:

    hub namespace:  bridge br0 <- v0, v1, ... (hub ends of the veth pairs)
    rank i:         eth0 (10.X.Y.(i+1)/24), lo

The ranks reach each other through the bridge only. Shaping is ``htb`` on a veth: on the rank's
``eth0`` it limits what the rank sends, on the hub end ``v<i>`` what the rank receives (the hub
end's egress is the rank's ingress), and a ``u32`` filter on the destination address limits one
directed link. Each ``eth0`` sends wire-size packets (no segmentation offload), so a shaper delays
every message by its own size, as a switch port would. ``expose`` makes a loopback service of the root namespace (the Kafka broker)
reachable at the same 127.0.0.1 address inside every rank namespace, relayed over loopback
(``forward.py``), so telemetry never crosses a shaped link.

Project rule: the only addresses besides 127.0.0.1 are the private 10.X.Y.0/24 this module assigns
inside namespaces it creates. Everything is named ``ssnf<pid>-<tag>-...``, torn down on exit (also
on exceptions, SIGTERM and SIGHUP), and ``remove_stale`` removes what a killed run left behind.
Needs root and iproute2; ``netns_unavailable`` says why not where it cannot work.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import zlib

from tests.netfaults.forward import LoopbackForwarder

PREFIX = "ssnf"
NETNS_DIR = "/run/netns"
_OURS = re.compile(rf"^{PREFIX}(\d+)-")
_IP = shutil.which("ip") or "ip"
_TC = shutil.which("tc") or "tc"

# Shaping parameters, chosen by measurement (tests/netfaults/bulk.py between two ranks, 20mbit):
UNLIMITED = "10gbit"  # the default class: more than a veth carries on this machine, so it never shapes
# After a pause a token bucket lets its depth through at the veth's speed: with a 64 KB bucket the
# first 64 KB message took 1.3 ms instead of 27 ms, and four 16 KB ones in a row went unshaped; a
# 4 KB bucket cut the first 16 KB message to 5.1 ms (6.9 ms shaped). One full-size frame keeps it
# within 10% (6.2 ms). tc's default, rate/HZ + MTU, is that too on this kernel, but not on one
# with a coarse HZ, so it is given.
BURST = "1600b"
# And the packets must be wire-sized: with segmentation offload a rank hands its veth 64 KB packets,
# each passed whole on credit, so single 16-64 KB messages took anywhere from 0.1 to 38 ms at 20mbit
# (the mean was right). With one segment per packet every message takes size/rate (27.4 ms for
# 64 KB, 6.9 ms for 16 KB, +5% for headers). It is set when the link is made: TCP reads it when a
# connection opens, so a later change would miss the job's connections. The price is CPU: a healthy
# link carries about 60 MB/s instead of 500 on this 2-core machine, far above what the jobs send.
SEGMENTS = "1"
QUANTUM = "65536"  # bytes per round among borrowing siblings; given, so tc neither derives it nor warns
_MIN_RATE = "8kbit"  # a shaped child's guaranteed rate: it borrows the rest, so the parent's cap holds


class FabricError(RuntimeError):
    """An ip or tc command failed; the message holds the command and its stderr."""


def _cmd(argv: list[str], check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        err = r.stderr.strip().splitlines() or [f"exit {r.returncode}"]
        what = err[0] if len(err) == 1 else f"{err[0]} ... {err[-1]}"  # tc prints its usage in between
        raise FabricError(f"{' '.join(argv)}: {what}" + (f"; input:\n{stdin}" if stdin else ""))
    return r


@functools.cache
def netns_unavailable() -> str | None:
    """Why this machine cannot host a Fabric (not root, no iproute2, netns/veth/htb refused), or None."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    steps = [[_IP, "netns", "add", probe],
             [_IP, "-n", probe, "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1"],
             [_TC, "-n", probe, "qdisc", "add", "dev", "p0", "root", "handle", "1:", "htb"]]
    try:
        for argv in steps:
            r = _cmd(argv, check=False)
            if r.returncode != 0:
                return f"{' '.join(argv[1:])} refused: {r.stderr.strip() or f'exit {r.returncode}'}"
    finally:
        _cmd([_IP, "netns", "del", probe], check=False)
    return None


def netns_names() -> list[str]:
    """Every named network namespace on the machine (``ip netns list``), ours or not."""
    return [line.split()[0] for line in _cmd([_IP, "netns", "list"]).stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's live process
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL every process whose network namespace is ``ns`` (all started by this harness)."""
    for pid in _cmd([_IP, "netns", "pids", ns], check=False).stdout.split():
        if int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def remove_stale() -> list[str]:
    """Remove the namespaces of this harness whose owning process is dead (a run killed with SIGKILL).

    Only names ``ssnf<pid>-...`` with no live ``pid`` are touched, so concurrent runs are safe. The
    processes still inside them (orphaned ranks) are killed first. Returns the names removed.
    """
    removed = []
    for name in netns_names():
        m = _OURS.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        _kill_inside(name)
        _cmd([_IP, "netns", "del", name], check=False)
        removed.append(name)
    return removed


_LIVE: set[Fabric] = set()
_tags = itertools.count()


def _down_all() -> None:
    for fabric in list(_LIVE):
        fabric.down()


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)  # unwinds the `with` blocks; atexit catches the rest


def _install_safety_net() -> None:
    """Turn SIGTERM/SIGHUP into an exit where nobody handles them, so `with` blocks and atexit tear down."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _exit_on_signal)


atexit.register(_down_all)


class Fabric:
    """``n_ranks`` network namespaces joined by a bridge; a context manager (``up`` / ``down``).

    Shaping calls return once tc has the new rules: ``slow_egress``, ``slow_ingress`` and
    ``slow_link`` take a tc rate (``"20mbit"``) or None to remove that fault; faults compose (a
    link limit under an egress limit gets the smaller). ``run`` starts a process in a rank's
    namespace; ``down`` kills whatever still runs there.
    """

    def __init__(self, n_ranks: int, tag: str | None = None):
        if not 1 <= n_ranks <= 250:
            raise ValueError(f"n_ranks must be within 1..250, got {n_ranks}")
        tag = tag if tag is not None else f"f{next(_tags)}"
        if not re.fullmatch(r"[a-z0-9]{1,12}", tag):
            raise ValueError(f"tag must be 1-12 lowercase letters or digits, got {tag!r}")
        self.n_ranks = n_ranks
        prefix = f"{PREFIX}{os.getpid()}-{tag}-"
        self.hub = prefix + "hub"
        self.namespaces = [f"{prefix}r{i}" for i in range(n_ranks)]
        # Each fabric is isolated anyway; distinct subnets keep concurrent runs apart in captures and logs.
        h = zlib.crc32(prefix.encode())
        self.subnet = f"10.{64 + h % 128}.{(h >> 8) & 0xFF}"
        self._shaping: dict[tuple[str, str], dict[str | None, str]] = {}  # (ns, dev) -> {dst ip or None: rate}
        self._procs: list[subprocess.Popen] = []
        self._forwarders: dict[int, LoopbackForwarder] = {}

    def addr(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def __enter__(self) -> Fabric:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Create the namespaces, the bridge and the veth pairs; on any failure remove what was made."""
        _install_safety_net()
        _LIVE.add(self)
        try:
            _cmd([_IP, "netns", "add", self.hub])
            for argv in (["link", "set", "lo", "up"], ["link", "add", "br0", "type", "bridge"],
                         ["link", "set", "br0", "up"]):
                _cmd([_IP, "-n", self.hub, *argv])
            for i, ns in enumerate(self.namespaces):
                _cmd([_IP, "netns", "add", ns])
                # Created in place: the root namespace never holds these interfaces, not even briefly.
                _cmd([_IP, "link", "add", f"v{i}", "netns", self.hub, "type", "veth",
                      "peer", "name", "eth0", "netns", ns])
                _cmd([_IP, "-n", self.hub, "link", "set", f"v{i}", "master", "br0", "up"])
                _cmd([_IP, "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0"])
                _cmd([_IP, "-n", ns, "link", "set", "eth0", "gso_max_segs", SEGMENTS, "up"])
                _cmd([_IP, "-n", ns, "link", "set", "lo", "up"])
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Stop forwarders, kill the processes, delete links and namespaces. Idempotent; never raises."""
        for fwd in self._forwarders.values():
            fwd.close()
        self._forwarders.clear()
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        self._procs.clear()
        names = self.namespaces + [self.hub]
        for ns in names:
            _kill_inside(ns)
        # Deleting one end of a veth deletes both, with their qdiscs, at once; a namespace's own
        # cleanup would do it too, but later (the kernel does it asynchronously).
        for i in range(self.n_ranks):
            _cmd([_IP, "-n", self.hub, "link", "del", f"v{i}"], check=False)
        _cmd([_IP, "-n", self.hub, "link", "del", "br0"], check=False)
        for ns in names:
            _cmd([_IP, "netns", "del", ns], check=False)
        self._shaping.clear()
        _LIVE.discard(self)

    def run(self, rank: int, argv: list[str], env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
        """Start ``argv`` in rank's namespace (``ip netns exec`` passes ``env`` on unchanged), in its own session."""
        p = subprocess.Popen([_IP, "netns", "exec", self.namespaces[rank], *argv], env=env,
                             start_new_session=True, **popen)
        self._procs.append(p)
        return p

    def lose(self, i: int) -> list[int]:
        """Lose namespace ``i`` as a host is lost when its power goes: its link first, then all it runs at once.

        The link goes down before anything dies, so the peers get no reset from the dying connections: they
        wait, as for a host that vanished, instead of failing at once as for a process that crashed on a live
        host. Every process inside is stopped (SIGSTOP) before any is killed, so none sees another die and
        speaks for it (a rank's watch would send ``exited``). Returns the pids killed; the namespace stays
        until ``down``."""
        ns = self.namespaces[i]
        _cmd([_IP, "-n", self.hub, "link", "set", f"v{i}", "down"])
        pids = [int(p) for p in _cmd([_IP, "netns", "pids", ns], check=False).stdout.split() if int(p) != os.getpid()]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        return pids

    def expose(self, port: int) -> None:
        """Make 127.0.0.1:port of the root namespace reachable as 127.0.0.1:port in every rank namespace."""
        if port in self._forwarders:
            return
        fwd = LoopbackForwarder(port)
        self._forwarders[port] = fwd
        for ns in self.namespaces:
            fwd.add(f"{NETNS_DIR}/{ns}")

    # -- shaping --------------------------------------------------------------------------------

    def slow_egress(self, rank: int, rate: str | None) -> None:
        """Limit everything ``rank`` sends (a slow NIC); None removes the limit."""
        self._shape((self.namespaces[rank], "eth0"), None, rate)

    def slow_ingress(self, rank: int, rate: str | None) -> None:
        """Limit everything sent to ``rank`` (a slow receiver); None removes the limit."""
        self._shape((self.hub, f"v{rank}"), None, rate)

    def slow_link(self, src: int, dst: int, rate: str | None) -> None:
        """Limit what ``src`` sends to ``dst`` only; every other destination of ``src`` is unaffected."""
        self._shape((self.namespaces[src], "eth0"), self.addr(dst), rate)

    def clear(self, rank: int | None = None) -> None:
        """Remove every fault of ``rank`` (what it sends and receives), or of every rank."""
        ranks = range(self.n_ranks) if rank is None else [rank]
        for r in ranks:
            for dev in ((self.namespaces[r], "eth0"), (self.hub, f"v{r}")):
                if dev in self._shaping:
                    self._apply(dev, {})

    def _shape(self, dev: tuple[str, str], dst: str | None, rate: str | None) -> None:
        old = self._shaping.get(dev, {})
        new = {k: v for k, v in old.items() if k != dst} | ({dst: rate} if rate is not None else {})
        try:
            self._apply(dev, new)
        except FabricError:
            self._apply(dev, old)  # a rate tc refuses leaves the device as it was
            raise

    def _apply(self, dev: tuple[str, str], rules: dict[str | None, str]) -> None:
        """Rebuild the device's htb tree for ``rules`` (packets queued in the old tree are dropped).

        1:1 caps the device (its egress limit, else UNLIMITED); under it, the default class 1:10 and
        one class per slowed destination (u32 on the destination address) borrow up to their own cap.
        """
        ns, name = dev
        _cmd([_TC, "-n", ns, "qdisc", "del", "dev", name, "root"], check=False)  # none yet: fails, fine
        self._shaping.pop(dev, None)
        if not rules:
            return
        total = rules.get(None, UNLIMITED)
        lines = [f"qdisc add dev {name} root handle 1: htb default 10",
                 f"class add dev {name} parent 1: classid 1:1 htb {_htb(total, total)}",
                 f"class add dev {name} parent 1:1 classid 1:10 htb {_htb(_MIN_RATE, total)}"]
        links = sorted((ip, rate) for ip, rate in rules.items() if ip is not None)
        for minor, (ip, rate) in enumerate(links, start=100):
            lines += [f"class add dev {name} parent 1:1 classid 1:{minor} htb {_htb(_MIN_RATE, rate)}",
                      f"filter add dev {name} parent 1: protocol ip prio 1 u32 match ip dst {ip}/32 flowid 1:{minor}"]
        _cmd([_TC, "-n", ns, "-batch", "-"], stdin="\n".join(lines) + "\n")
        self._shaping[dev] = rules


def _htb(rate: str, ceil: str) -> str:
    """An htb class's parameters: a small bucket where it shapes, tc's default where it is unlimited."""
    bucket = "" if ceil == UNLIMITED else f" burst {BURST} cburst {BURST}"
    return f"rate {rate} ceil {ceil}{bucket} quantum {QUANTUM}"
