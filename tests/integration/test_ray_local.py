"""With no ``ray.address``, a command starts a local Ray of its own, whatever else the host has seen (issue 50).

After a ``ray start --head`` on the host had stopped, Ray's marker of the current cluster was left behind and
``stragglerscope trace`` died in ``ray.init`` ("When connecting to an existing cluster, num_cpus and num_gpus
must not be provided"). ``RAY_ADDRESS`` naming a cluster that is gone is the same path into ``ray.init``
(Ray reads the variable first, the marker file second), without touching the host's shared marker.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_no_configured_address_starts_a_local_ray_even_where_another_cluster_is_named():
    code = ("from core.config import Config\n"
            "from ray_jobs.ray_connect import init_ray\n"
            "init_ray(Config())\n"
            "import ray\n"
            "print('gcs', ray.get_runtime_context().gcs_address)\n"
            "ray.shutdown()\n")
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:1")  # a cluster that is not there
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    gcs = next(line for line in r.stdout.splitlines() if line.startswith("gcs "))
    assert gcs.startswith("gcs 127.0.0.1:") and not gcs.endswith(":1"), gcs
