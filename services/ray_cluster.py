"""A multi-node Ray cluster on this machine, every node on 127.0.0.1: for tests and benchmarks.

``ray start --address`` cannot make one here: Ray listens on every interface
unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and with that setting it
refuses a second raylet (docs/architecture.md, "Loopback only"). Ray's own test
cluster (``ray.cluster_utils.Cluster``) starts nodes directly, without that
check: with the setting kept at 0, each node's GCS, raylet and agents bind
127.0.0.1 and register as 127.0.0.1.

The nodes run under a child process (``python -m services.ray_cluster``), so
the caller's own Ray, if any, is untouched, and the whole cluster goes away
with it. The child takes one command per line on stdin and answers one JSON
line: ``add CPUS`` (a node; its id), ``remove NODE_ID`` (kills that node's
processes, as a lost machine), ``quit``.

    with LocalRayCluster(nodes=2, cpus_per_node=2) as cluster:
        cfg = cfg.replace(ray={"address": cluster.address})
        ...
        cluster.remove_node(cluster.nodes[1])
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

STARTUP_TIMEOUT_S = 120.0

WARM_WORKERS_PER_CPU = 3
"""Ray's idle-worker limit per node (``num_workers_soft_limit``), in workers per CPU. Ray's default (one per
CPU) counts the shard actors' workers too, so analysis workers started for queued tasks beyond it were killed
after a second idle and started again for the next window: 50 worker starts in 3 minutes of the small-job
soak, window p50 20 s. Three per CPU keeps them warm (BENCHMARKS.md, "Where a small window's CPU goes").
Set on the nodes (the raylets read it), not by the driver."""


class LocalRayCluster:
    """A head node plus ``nodes - 1`` more on 127.0.0.1, in a child process; a context manager."""

    def __init__(self, nodes: int = 2, cpus_per_node: float = 2, object_store_mb: int = 100,
                 env: dict[str, str] | None = None):
        """``env``: extra environment of the nodes (e.g. ``RAY_AUTH_MODE=token`` and a ``RAY_AUTH_TOKEN``)."""
        if nodes < 1:
            raise ValueError("a cluster has at least its head node")
        self.n_nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.object_store_mb = object_store_mb
        self.address = ""
        self.nodes: list[str] = []
        """Node ids, the head's first."""
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.env = dict(env or {})

    def start(self) -> "LocalRayCluster":
        env = dict(os.environ, **self.env, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "services.ray_cluster", str(self.cpus_per_node), str(self.object_store_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), start_new_session=True)
        head = self._read()
        self.address = head["address"]
        self.nodes = [head["node"]]
        for _ in range(self.n_nodes - 1):
            self.add_node()
        return self

    def add_node(self, cpus: float | None = None) -> str:
        node = self._ask(f"add {self.cpus_per_node if cpus is None else cpus}")["node"]
        self.nodes.append(node)
        return node

    def remove_node(self, node_id: str) -> None:
        """Kill every process of that node at once: a machine lost, not a drain."""
        self._ask(f"remove {node_id}")
        self.nodes.remove(node_id)

    def stop(self) -> None:
        if self._proc is None:
            return
        try:
            if self._proc.poll() is None:
                self._proc.stdin.write("quit\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        finally:
            if self._proc.poll() is None:
                os.killpg(self._proc.pid, 9)  # the raylets and workers are in its session
                self._proc.wait()
            self._proc = None

    def _ask(self, line: str) -> dict:
        with self._lock:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
            return self._read()

    def _read(self) -> dict:
        # A bounded wait: a node that cannot start must fail the caller, not hang it.
        timer = threading.Timer(STARTUP_TIMEOUT_S, self._proc.kill)
        timer.start()
        try:
            line = self._proc.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            raise RuntimeError(f"the local Ray cluster process ended (exit {self._proc.poll()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"local Ray cluster: {answer['error']}")
        return answer

    def __enter__(self) -> "LocalRayCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def _serve(cpus: float, object_store_mb: int) -> None:
    """The child: hold the cluster, obey stdin, answer on stdout."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_num_workers_soft_limit", str(int(WARM_WORKERS_PER_CPU * cpus)))
    from ray.cluster_utils import Cluster

    def node_args(n_cpus: float) -> dict:
        return {"num_cpus": n_cpus, "object_store_memory": object_store_mb << 20, "node_ip_address": "127.0.0.1"}

    def say(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    cluster = Cluster(initialize_head=True, shutdown_at_exit=True,
                      head_node_args=dict(node_args(cpus), include_dashboard=False))
    nodes = {cluster.head_node.node_id: cluster.head_node}
    say({"address": cluster.address, "node": cluster.head_node.node_id})
    try:
        for line in sys.stdin:
            verb, _, arg = line.strip().partition(" ")
            try:
                if verb == "add":
                    node = cluster.add_node(**node_args(float(arg)))
                    nodes[node.node_id] = node
                    say({"node": node.node_id})
                elif verb == "remove":
                    cluster.remove_node(nodes.pop(arg), allow_graceful=False)
                    say({"removed": arg})
                elif verb == "quit":
                    break
                else:
                    say({"error": f"unknown command {verb!r}"})
            except Exception as e:  # the caller gets the reason; the cluster stays up
                say({"error": f"{type(e).__name__}: {e}"})
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    _serve(float(sys.argv[1]), int(sys.argv[2]))
