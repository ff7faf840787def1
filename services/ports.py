"""Free loopback ports for the services we start."""
from __future__ import annotations

import random
import socket

RAY_WORKER_PORTS = (10002, 19999)
"""Ray's default range for its workers' ports: a port handed out outside the kernel's range may still land there."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the caller binds it next; another process could take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_fixed_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A free port for a process that must be told its port in advance (torchrun's ``--master-port``).

    ``free_port`` hands out a port from the kernel's ephemeral range, where every port-0 bind
    and outgoing connection of any other process (our broker, Ray, the store daemon) also
    lands: between the probe and the real bind, one of them took it (torchrun failed with
    EADDRINUSE under ``stragglerscope trace``). A port between Ray's worker ports and the
    ephemeral range is only ever taken by someone who asked for it by number.
    """
    lo, hi = RAY_WORKER_PORTS[1] + 1, _ephemeral_low() - 1
    if hi <= lo:
        return free_port(host)
    for _ in range(attempts):
        port = random.randint(lo, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)
