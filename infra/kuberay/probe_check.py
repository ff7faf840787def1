"""Run KubeRay's default readiness and liveness probe commands against real Ray nodes started as the image
starts them, on 127.0.0.1: what a pod of infra/kuberay/raycluster.yaml answers, without Kubernetes.

    python -m venv /tmp/raydefault && /tmp/raydefault/bin/pip install "ray[default]==2.60.0" && \\
        /tmp/raydefault/bin/python infra/kuberay/probe_check.py

It needs what the image installs (``ray[default]``: the dashboard and its agent, which answer the probes) and
``wget`` (the probes are ``wget`` commands run inside the pod). KubeRay 1.1 and later inject, unless a pod
sets its own (``initReadinessProbe``/``initLivenessProbe`` in ray-operator's ``common/pod.go``):

- head: ``wget --tries 1 -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success &&
  wget --tries 1 -T 10 -q -O- http://localhost:8265/api/gcs_healthz | grep success``
- worker: the first half alone.

The check starts a head (dashboard on 127.0.0.1, as the manifest's ``dashboard-host``) and a worker node,
runs each probe until it passes (a pod's readiness), then kills the worker's raylet, as a crashed node,
and expects the worker's probe to fail (a pod's liveness). Both nodes share this machine, so the worker's
agent listens on another port than KubeRay's 52365; the command is otherwise KubeRay's. Exit 0 when every
probe behaves so; 1 with the reason.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

HEAD_AGENT_PORT, DASHBOARD_PORT = 52365, 8265
READY_WITHIN_S = 90.0
FAIL_WITHIN_S = 30.0


def probe(agent_port: int, with_gcs: bool) -> list[str]:
    cmd = f"wget --tries 1 -T 2 -q -O- http://localhost:{agent_port}/api/local_raylet_healthz | grep success"
    if with_gcs:
        cmd += f" && wget --tries 1 -T 10 -q -O- http://localhost:{DASHBOARD_PORT}/api/gcs_healthz | grep success"
    return ["bash", "-c", cmd]


def passes(cmd: list[str]) -> bool:
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30).returncode == 0


def wait_until(cmd: list[str], want: bool, within_s: float) -> float | None:
    """Seconds until the probe's outcome is ``want``; None if it never was within ``within_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if passes(cmd) == want:
            return time.monotonic() - t0
        time.sleep(1.0)
    return None


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def main() -> int:
    if not shutil.which("wget"):
        print("wget is not installed: KubeRay's probes are wget commands (the image installs it)")
        return 1
    try:
        import aiohttp  # noqa: F401  (ray[default]: without it Ray starts no dashboard and no agent)
        import ray
        from ray.cluster_utils import Cluster
    except ImportError as e:
        print(f"needs ray[default], as the image installs it: {e}")
        return 1
    busy = [p for p in (HEAD_AGENT_PORT, DASHBOARD_PORT) if not port_free(p)]
    if busy:
        print(f"ports {busy} are in use: KubeRay's probes name them, so the head needs them")
        return 1
    # Loopback only on this machine (docs/architecture.md, "Loopback only"); in the image it is 1, which
    # changes where Ray listens, not what the probes ask.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    worker_agent_port = next(p for p in range(52400, 52500) if port_free(p))
    cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=dict(
        num_cpus=0, node_ip_address="127.0.0.1", include_dashboard=True, dashboard_host="127.0.0.1",
        dashboard_port=DASHBOARD_PORT, dashboard_agent_listen_port=HEAD_AGENT_PORT))
    failures = []
    try:
        worker = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1",
                                  dashboard_agent_listen_port=worker_agent_port)
        print(f"ray {ray.__version__}: head and one worker node on 127.0.0.1")
        for name, cmd in (("head", probe(HEAD_AGENT_PORT, True)), ("worker", probe(worker_agent_port, False))):
            took = wait_until(cmd, True, READY_WITHIN_S)
            print(f"{name} probe: {'passes after %.0f s' % took if took is not None else 'never passed'}")
            if took is None:
                failures.append(f"the {name} probe never passed in {READY_WITHIN_S:.0f} s")
        raylet = worker.all_processes["raylet"][0].process
        raylet.kill()
        took = wait_until(probe(worker_agent_port, False), False, FAIL_WITHIN_S)
        print(f"worker probe after its raylet was killed: "
              f"{'fails after %.0f s' % took if took is not None else 'still passes'}")
        if took is None:
            failures.append("the worker probe still passed with its raylet dead")
        head_still = passes(probe(HEAD_AGENT_PORT, True))
        print(f"head probe with the worker gone: {'passes' if head_still else 'fails'}")
        if not head_still:
            failures.append("the head probe failed when a worker node died")
    finally:
        cluster.shutdown()
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
