"""Can the Ray cluster run the pipeline? Shard actors and analyses against the nodes' resources.

On a Ray cluster each shard actor asks for ``ray.shard_cpus`` CPUs and
``ray.shard_memory_mb`` and Ray spreads them over the nodes; each analysis
is a task asking for ``ANALYSIS_CPUS``. Ray never says that a request can
not be met: an actor that fits no node stays "restarting", a task that fits
no node waits, and the pipeline stalled without a word (seen: shards of 1.5
CPUs on nodes of 2 left every node 0.5 CPU, no analysis ran, nothing was
stored; after a node loss a shard stayed "restarting" for minutes).

``plan`` places the shards as Ray's SPREAD strategy does (each on the
alive node with the most CPUs left that fits it) and says what cannot run:
shards no node can hold, and analyses no node has a CPU left for. The
driver refuses a configuration that can never run an analysis at start, and
says so in its status and a metric while running (``Pipeline.placement``).
It reasons on the nodes' total resources, not on what other work uses now:
it finds what can never fit, not what is merely busy.

``check_store_reach`` asks the same of the store: a store only this machine
can reach (chDB, a loopback server) cannot serve shards on other nodes.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import socket

from ray_jobs.errors import PipelineError

ANALYSIS_CPUS = 1.0
"""CPUs one what-if analysis task asks for (``ray_jobs.pipeline``'s ``remote_analyze``)."""

_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    cpus: float
    memory: float  # bytes


@dataclasses.dataclass(frozen=True)
class Placement:
    nodes: int
    shards: int
    unplaced: int
    """Shard actors no node can hold."""
    analysis_slots: int
    """Analyses that can run at once on what the shards leave (0: none ever runs)."""
    largest_free_cpus: float
    problems: tuple[str, ...]
    """One line per thing that cannot run, with the setting to change; empty when all can."""

    @property
    def ok(self) -> bool:
        return not self.problems


def nodes_of(ray_nodes: list[dict]) -> list[Node]:
    """The alive nodes of ``ray.nodes()``, with their total CPUs and memory."""
    out = []
    for nd in ray_nodes:
        if nd.get("Alive"):
            res = nd.get("Resources") or {}
            out.append(Node(str(nd.get("NodeManagerAddress") or nd.get("NodeID", "?")), float(res.get("CPU", 0.0)),
                            float(res.get("memory", 0.0))))
    return out


def plan(nodes: list[Node], shards: int, shard_cpus: float, shard_memory_mb: float,
         analysis_cpus: float = ANALYSIS_CPUS) -> Placement:
    free = [[n.cpus, n.memory] for n in nodes]
    need_mem = shard_memory_mb * (1 << 20)
    unplaced = 0
    for _ in range(shards):
        fits = [i for i, (cpu, mem) in enumerate(free) if cpu + _EPS >= shard_cpus and mem + _EPS >= need_mem]
        if not fits:
            unplaced += 1
            continue
        i = max(fits, key=lambda j: (free[j][0], -j))  # spread: the node with the most CPUs left
        free[i][0] -= shard_cpus
        free[i][1] -= need_mem
    slots = sum(int((cpu + _EPS) // analysis_cpus) for cpu, _ in free) if analysis_cpus > 0 else 0
    largest = max((cpu for cpu, _ in free), default=0.0)
    problems = []
    if not nodes:
        problems.append("the Ray cluster has no alive node")
    elif unplaced:
        most = max(nodes, key=lambda n: n.cpus)
        problems.append(
            f"{unplaced} of {shards} shard actors cannot be placed: each asks for {shard_cpus:g} CPUs and "
            f"{shard_memory_mb:g} MB (ray.shard_cpus, ray.shard_memory_mb), and with the others placed no alive node "
            f"of {len(nodes)} has that left (the largest has {most.cpus:g} CPUs, {most.memory / (1 << 20):.0f} MB)")
    if nodes and slots == 0:
        problems.append(
            f"no analysis can run: each needs {analysis_cpus:g} CPU and with the {shards - unplaced} shard actors "
            f"spread over the {len(nodes)} nodes ({shard_cpus:g} CPUs each, ray.shard_cpus) the most a node has left "
            f"is {max(largest, 0.0):.2g} CPUs: lower ray.shard_cpus or give the nodes more CPUs")
    return Placement(len(nodes), shards, unplaced, slots, largest, tuple(problems))


def local_addresses() -> set[str]:
    """This machine's own addresses, on every interface (nothing is sent)."""
    import psutil

    out = {"127.0.0.1", "::1", "localhost"}
    for addrs in psutil.net_if_addrs().values():
        out.update(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return out


def store_only_here(store_url: str) -> bool:
    """Whether only processes on this machine can reach the store: chDB files, or a loopback server."""
    from urllib.parse import urlsplit

    if store_url.startswith("chdb://"):
        return True
    host = urlsplit(store_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_store_reach(store_url: str, node_addresses: list[str], here: set[str] | None = None) -> None:
    """PipelineError when the shards on another machine could not reach the store.

    The embedded chDB store is served by this driver on 127.0.0.1 (and a
    ClickHouse on loopback is the same): a shard placed on another node would
    connect to its own 127.0.0.1 and die at setup. Said before any actor starts.
    """
    if not store_only_here(store_url):
        return
    here = local_addresses() if here is None else here
    elsewhere = sorted({a for a in node_addresses if a not in here})
    if elsewhere:
        from core.redact import redact_url

        raise PipelineError(
            f"store.url {redact_url(store_url)} is reachable only on this machine, but the Ray cluster has "
            f"nodes at {', '.join(elsewhere[:3])}{' ...' if len(elsewhere) > 3 else ''}: give the shards a "
            "ClickHouse server they can reach (store.url = clickhouse://user@host:9000/db)")
