"""Run a multi-rank training script with every rank in its own network namespace, under a network fault.

    python -m tests.netfaults.launch --ranks 4 --fault link:0:1:20mbit --fault-after-s 5 -- \\
        tests/training/zoo.py --framework plain --steps 20

A stand-in for ``torchrun --nproc-per-node N`` on one machine, usable as the COMMAND of
``stragglerscope trace``: the ranks get torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus GLOO_SOCKET_IFNAME=eth0, so gloo's traffic goes
over the fabric's links (``fabric.py``), which the fault slows. Everything else in the environment
is passed on: trace's STRAGGLERSCOPE_TRACE_* settings and PYTHONPATH reach every rank, and the
broker named by STRAGGLERSCOPE_TRACE_BOOTSTRAP (127.0.0.1 only) is exposed inside each namespace
over loopback, so the telemetry is never shaped.

Hosts: with ``--hosts H`` the ranks are split in order over H hosts, as torchrun's nodes hold them
(ranks 0..k-1 on host 0, k = ranks / H): each host is one network namespace, and each rank runs in a
UTS namespace of its own named as its host (``ssnf<pid>-h<i>``), so ``socket.gethostname()`` and what
the exporter reports as the rank's host differ between hosts. ``--lose-host I --lose-on FILE`` loses
host I when FILE appears (``Fabric.lose``: its link cut first, then everything it runs killed at
once), printed as ``host-lost <name> <unix time in ns>``; its ranks no longer count for the exit status,
and the others wait, as for a host that vanished, until they fail or --timeout.

Faults: ``egress:RANK:RATE`` (what RANK sends), ``ingress:RANK:RATE`` (what it receives),
``link:SRC:DST:RATE`` (SRC to DST only), ``none``; RATE as tc writes it (``20mbit``). The moment a
fault takes effect is printed to stdout as ``fault-start <unix time in ns>``, for a test to line
the telemetry up with. Exit status: the first failing rank's (128 + N if killed by signal N), 124
on --timeout, else 0; when a rank fails, the others are stopped.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from services.ports import free_fixed_port
from tests.netfaults.fabric import Fabric, netns_unavailable, remove_stale

BOOTSTRAP_ENV = "STRAGGLERSCOPE_TRACE_BOOTSTRAP"
_FAULTS = {"egress": (1, "slow_egress"), "ingress": (1, "slow_ingress"), "link": (2, "slow_link")}
_RATE = re.compile(r"\d+(\.\d+)?([kmgt]i?)?(bit|bps)", re.IGNORECASE)
_STOP_GRACE_S = 5.0


def parse_fault(text: str, n_ranks: int) -> tuple[str, list[int], str] | None:
    """``link:0:1:20mbit`` -> ('slow_link', [0, 1], '20mbit'); ``none`` -> None; ValueError if malformed."""
    if text == "none":
        return None
    kind, *args = text.split(":")
    if kind not in _FAULTS or len(args) != _FAULTS[kind][0] + 1:
        raise ValueError(f"bad fault {text!r}: want egress:RANK:RATE, ingress:RANK:RATE, link:SRC:DST:RATE or none")
    *ranks_text, rate = args
    try:
        ranks = [int(r) for r in ranks_text]
    except ValueError:
        raise ValueError(f"bad fault {text!r}: ranks must be integers") from None
    if any(not 0 <= r < n_ranks for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"bad fault {text!r}: ranks must be distinct and within 0..{n_ranks - 1}")
    if not _RATE.fullmatch(rate):
        raise ValueError(f"bad fault {text!r}: {rate!r} is not a tc rate such as 20mbit")
    return _FAULTS[kind][1], ranks, rate


def bootstrap_ports(value: str) -> list[int]:
    """The ports of a Kafka bootstrap list (``127.0.0.1:9092[,...]``); ValueError for any other host."""
    ports = []
    for item in filter(None, (s.strip() for s in value.split(","))):
        host, _, port = item.rpartition(":")
        if host != "127.0.0.1" or not port.isdigit():
            raise ValueError(f"{BOOTSTRAP_ENV}: {item!r} is not 127.0.0.1:PORT, the only kind a rank can reach")
        ports.append(int(port))
    return ports


def rank_env(fabric: Fabric, rank: int, master_port: int, n_ranks: int | None = None,
             per_host: int | None = None) -> dict[str, str]:
    """torchrun's environment, with gloo on the fabric: one node of every rank (one namespace per rank, all
    named as this machine), or nodes of ``per_host`` ranks (``--hosts``)."""
    n = n_ranks or fabric.n_ranks
    k = per_host or n
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank % k), "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(k), "GROUP_RANK": str(rank // k), "MASTER_ADDR": fabric.addr(0),
            "MASTER_PORT": str(master_port), "GLOO_SOCKET_IFNAME": "eth0"}


def host_name(host: int) -> str:
    """The host name of ``--hosts``'s host ``host``: unique to this launcher, so concurrent runs differ."""
    return f"ssnf{os.getpid()}-h{host}"


_UNSHARE = shutil.which("unshare") or "unshare"
# The rank's own UTS namespace, named as its host; then the rank itself (exec: its pid is the rank's).
_NAMED = 'hostname "$0" && exec "$@"'


@functools.cache
def hosts_unavailable() -> str | None:
    """Why ``--hosts`` cannot work here (no network namespaces, no UTS namespaces), or None."""
    reason = netns_unavailable()
    if reason:
        return reason
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    r = subprocess.run([_UNSHARE, "--uts", "sh", "-c", _NAMED, "ssnf-probe", "hostname"], capture_output=True,
                       text=True, timeout=30)
    if r.returncode != 0 or r.stdout.strip() != "ssnf-probe":
        return f"unshare --uts refused: {r.stderr.strip() or f'exit {r.returncode}'}"
    return None


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the ranks still running, SIGKILL those that outlive the grace period."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_ranks(procs: list[subprocess.Popen], timeout_s: float, lost=None) -> int:
    """The first nonzero exit status (the shell's 128 + N for signal N), 124 past the timeout, else 0.
    ``lost()``, called as it polls, returns the ranks lost meanwhile on purpose: they no longer count."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        for p in lost() if lost is not None else ():
            if p in pending:
                pending.remove(p)
        for p in list(pending):
            rc = p.poll()
            if rc is None:
                continue
            pending.remove(p)
            if rc != 0:
                _stop(pending)
                return rc if rc > 0 else 128 - rc
        if time.monotonic() > deadline:
            print(f"launch: ranks still running after {timeout_s:g} s, stopping them", file=sys.stderr)
            _stop(pending)
            return 124
        time.sleep(0.1)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.netfaults.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--fault", default="none", help="egress:RANK:RATE, ingress:RANK:RATE, link:SRC:DST:RATE or none")
    p.add_argument("--fault-after-s", type=float, default=0.0, help="apply the fault this long after the ranks start")
    p.add_argument("--timeout", type=float, default=600.0, help="stop the ranks after this many seconds")
    p.add_argument("--hosts", type=int, default=0,
                   help="split the ranks in order over this many hosts: a network namespace and a host name each "
                        "(default: a namespace per rank, every rank on this machine's host name)")
    p.add_argument("--lose-host", type=int, default=-1, help="with --hosts: the host to lose when --lose-on appears")
    p.add_argument("--lose-on", help="a file whose appearance loses --lose-host (its link cut, all it runs killed)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...], run with this Python")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no SCRIPT given (after --)")
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    if args.hosts and (args.hosts < 1 or args.ranks % args.hosts):
        p.error(f"--hosts must divide --ranks ({args.ranks}) into hosts of equal size")
    if (args.lose_host >= 0) != bool(args.lose_on) or not -1 <= args.lose_host < max(args.hosts, 0) or (
            args.lose_on and not args.hosts):
        p.error("--lose-host I and --lose-on FILE go together, with --hosts, I within 0..hosts-1")
    try:
        fault = parse_fault(args.fault, args.ranks)
        ports = bootstrap_ports(os.environ.get(BOOTSTRAP_ENV, ""))
    except ValueError as e:
        p.error(str(e))
    reason = hosts_unavailable() if args.hosts else netns_unavailable()
    if reason:
        print(f"launch: {'hosts' if args.hosts else 'network namespaces'} unavailable: {reason}", file=sys.stderr)
        return 2
    remove_stale()
    try:
        if args.hosts:
            return run_hosts(args.ranks, args.hosts, command, ports, args.timeout, args.lose_host, args.lose_on)
        return run_job(args.ranks, command, fault, args.fault_after_s, ports, args.timeout)
    except KeyboardInterrupt:  # Ctrl-C (passed on by `stragglerscope trace`): the fabric is down already
        return 130


def run_job(n_ranks: int, command: list[str], fault: tuple[str, list[int], str] | None, fault_after_s: float,
            ports: list[int], timeout_s: float) -> int:
    """The ranks on a fresh fabric, the fault applied at its time; the exit status of ``wait_ranks``."""
    with Fabric(n_ranks) as fabric:
        for port in ports:
            fabric.expose(port)

        def apply_fault() -> None:
            method, ranks, rate = fault
            getattr(fabric, method)(*ranks, rate)
            sys.stdout.write(f"fault-start {time.time_ns()}\n")
            sys.stdout.flush()

        timer = None
        if fault is not None and fault_after_s <= 0:
            apply_fault()
        elif fault is not None:
            timer = threading.Timer(fault_after_s, apply_fault)
            timer.daemon = True
        master_port = free_fixed_port()
        procs = [fabric.run(r, [sys.executable, *command], env=rank_env(fabric, r, master_port))
                 for r in range(n_ranks)]
        if timer is not None:
            timer.start()
        try:
            return wait_ranks(procs, timeout_s)
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()  # an apply under way finishes before the fabric goes


def run_hosts(n_ranks: int, n_hosts: int, command: list[str], ports: list[int], timeout_s: float,
              lose_host: int = -1, lose_on: str | None = None) -> int:
    """The ranks on ``n_hosts`` named hosts (``--hosts``), host ``lose_host`` lost when ``lose_on`` appears;
    the exit status of ``wait_ranks`` over the ranks not lost."""
    k = n_ranks // n_hosts
    with Fabric(n_hosts) as fabric:
        for port in ports:
            fabric.expose(port)
        master_port = free_fixed_port()
        procs = [fabric.run(r // k, [_UNSHARE, "--uts", "sh", "-c", _NAMED, host_name(r // k), sys.executable,
                                     *command], env=rank_env(fabric, r, master_port, n_ranks, k))
                 for r in range(n_ranks)]
        gone: list[subprocess.Popen] = []

        def lost() -> list[subprocess.Popen]:
            if lose_on and not gone and os.path.exists(lose_on):
                gone.extend(procs[lose_host * k:(lose_host + 1) * k])
                fabric.lose(lose_host)
                for p in gone:
                    p.wait()
                sys.stdout.write(f"host-lost {host_name(lose_host)} {time.time_ns()}\n")
                sys.stdout.flush()
            return gone
        return wait_ranks(procs, timeout_s, lost)


if __name__ == "__main__":
    raise SystemExit(main())
