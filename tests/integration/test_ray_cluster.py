"""`stragglerscope run` on a real multi-node Ray cluster (every node on 127.0.0.1) with a ClickHouse cluster
as the store: two shards of two replicas each, replicating through ZooKeeper.

One run, as an infra team would see it: the shard actors spread over the
nodes; a second driver (a rolling update) adopts them and the first steps
back, so no second set ever reads the partitions; a node is lost mid-stream
and its shard comes back on the other node; every window is stored once,
with the numbers of an undisturbed local run; a shard killed for good ends
the driver with one line and exit code 2.
"""
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from core import topics
from core.kafka_admin import ensure_topics
from tests.integration.test_pipeline_faults import PARTITIONS, _produce, _results, _run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


class Driver:
    """`stragglerscope run` as a child process; its stderr lines collected as they come."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "stragglerscope", "run"], env=env, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, words: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines:
                if words in line:
                    return line
            assert self.proc.poll() is None, f"driver exited {self.proc.returncode}:\n{self.text}"
            time.sleep(0.2)
        raise AssertionError(f"no {words!r} from the driver in {timeout_s} s:\n{self.text}")

    def wait(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        self._reader.join(5)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _on_cluster(address: str, source_id: str, shards: int, action: str = "where") -> list:
    """Ask the cluster about the shards (pid, node id), or kill one for good ("kill:INDEX"), from a process
    of its own (this test's process may hold a local Ray)."""
    code = """
import json, sys
import ray_jobs, ray
from ray_jobs.ownership import shard_name, SHARD_NAMESPACE
ray.init(address=sys.argv[1], log_to_driver=False)
actors = [ray.get_actor(shard_name(sys.argv[2], i), namespace=SHARD_NAMESPACE) for i in range(int(sys.argv[3]))]
if sys.argv[4].startswith("kill:"):
    ray.kill(actors[int(sys.argv[4][5:])], no_restart=True)
    print("[]")
else:
    print(json.dumps([[ray.get(a.pid.remote(), timeout=120), ray.get(a.node.remote(), timeout=120)] for a in actors]))
"""
    r = subprocess.run([sys.executable, "-c", code, address, source_id, str(shards), action], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _stored(store, tag) -> int:
    return store.query("SELECT count() AS n FROM (SELECT DISTINCT job_id, window_id FROM windows "
                       "WHERE startsWith(job_id, {t:String}))", {"t": tag}).column("n")[0].as_py()


def _stored_local(store, tag) -> int:
    """Windows of ``tag`` in one ClickHouse server's own shard."""
    return store._select("SELECT count() AS n FROM windows_data WHERE startsWith(job_id, {t:String})",
                         {"t": ("String", tag)}).column("n")[0].as_py()


def _wait_stored(store, tag, n: int, timeout_s: float, driver: Driver) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = _stored(store, tag)
        if done >= n:
            return done
        assert driver.proc.poll() is None, f"driver exited {driver.proc.returncode}:\n{driver.text}"
        time.sleep(0.5)
    raise AssertionError(f"{_stored(store, tag)} of {n} windows stored after {timeout_s} s:\n{driver.text}")


def _strip(rows):
    return [(r["job_id"], r["window_id"], round(r["slowdown"], 9), round(r["launch_slowdown"], 9),
             r["verdict"], r["n_ops"]) for r in rows]


def test_run_on_a_two_node_ray_cluster_adopts_survives_a_node_loss_and_stores_each_window_once(
        broker, ray_local, tmp_path):
    from services.clickhouse_server import ClickHouseCluster, find_server_binary
    from services.ray_cluster import LocalRayCluster
    from services.zookeeper import LocalZooKeeper, zookeeper_installed
    from storage import open_store

    if not find_server_binary() or not zookeeper_installed():
        pytest.skip("clickhouse-server or zookeeper is not installed (make setup-test installs both)")
    tag = f"rc-{uuid.uuid4().hex[:6]}"
    ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, PARTITIONS)
    keys = _produce(broker.bootstrap, f"{tag}-a", n_jobs=12, windows=6)  # more come after the node is lost

    from services.ports import free_fixed_port

    metrics_port = free_fixed_port()  # fixed, as for a scraper: both drivers are given the same
    drivers = []
    # The reference run (below) runs beside the cluster's, in a thread: it needs nothing of the cluster.
    with ThreadPoolExecutor(1, thread_name_prefix="calm-run") as pool, LocalZooKeeper() as zk, \
            ClickHouseCluster(shards=2, replicas=2, zookeeper_port=zk.port) as ch, \
            LocalRayCluster(nodes=2, cpus_per_node=3) as cluster:
        env = dict(os.environ, STRAGGLERSCOPE_RAY_ADDRESS=cluster.address,
                   STRAGGLERSCOPE_KAFKA_BOOTSTRAP=broker.bootstrap, STRAGGLERSCOPE_KAFKA_PARTITIONS=str(PARTITIONS),
                   STRAGGLERSCOPE_KAFKA_SOURCE_ID=tag, STRAGGLERSCOPE_STORE_URL=ch.url,
                   STRAGGLERSCOPE_PIPELINE_SHARDS="2", STRAGGLERSCOPE_PIPELINE_METRICS_PORT=str(metrics_port),
                   STRAGGLERSCOPE_PIPELINE_IDLE_TIMEOUT_S="30", STRAGGLERSCOPE_RAY_SHARD_MEMORY_MB="256")
        env.pop("STRAGGLERSCOPE_STORE", None)
        store = open_store(ch.url)
        try:
            first = Driver(env)
            drivers.append(first)
            first.wait_for("running", 240)
            assert "2 detached shard actors" in first.text and "0 adopted, 2 started" in first.text, first.text
            placed = _on_cluster(cluster.address, tag, 2)
            assert sorted(node for _, node in placed) == sorted(cluster.nodes), "one shard per node (spread)"

            # A rolling update: the new driver adopts the running shards, the old one steps back by itself.
            _wait_stored(store, tag, len(keys) // 5, 240, first)
            second = Driver(env)
            drivers.append(second)
            second.wait_for("running", 240)
            assert "2 adopted, 0 started" in second.text, second.text
            assert f"port {metrics_port} is in use" in second.text, second.text  # the first driver holds it
            assert first.wait(60) == 0, first.text
            assert "a driver started later owns the shards" in first.text, first.text
            # The port the first gave back is the second's now (issue 50: it died on it, killing the shards).
            second.wait_for(f"metrics    http://127.0.0.1:{metrics_port}/metrics", 30)
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
                assert r.status == 200 and b"ss_shard_up" in r.read()
            assert "Traceback" not in second.text, second.text
            assert _on_cluster(cluster.address, tag, 2) == placed, "the same shard processes: no second set"

            # A node lost mid-stream: its shard comes back on the head, replays from the stored offsets, and
            # takes the records sent after the loss (more jobs, on every partition).
            head = cluster.nodes[0]
            lost = next(node for _, node in placed if node != head)
            cluster.remove_node(lost)
            keys += _produce(broker.bootstrap, f"{tag}-b", n_jobs=8, windows=4)
            # The reference: the same records through a local, undisturbed pipeline into a store of its own (the
            # session's Ray in this process, its own store daemon and source id). Every key is published now, so
            # it runs while the cluster waits out the node's loss and recovers, rather than after it all.
            reference = pool.submit(_run, broker, ray_local, tmp_path, tag, list(keys), kill=False)
            _wait_stored(store, tag, len(keys), 300, second)
            moved = _on_cluster(cluster.address, tag, 2)
            assert [node for _, node in moved] == [head, head], moved

            rows = _results(store, tag)
            assert len(rows) == len(keys), "each window exactly once"
            local = []
            for srv in ch.servers:  # the results are spread over both ClickHouse shards, on both replicas
                with open_store(srv.url) as one:
                    local.append(_stored_local(one, tag))
            assert local[0] == local[1] > 0 and local[2] == local[3] > 0 and local[0] + local[2] == len(keys), local

            # Done before the timed part below, which then has the machine to itself as before.
            calm, _ = reference.result()

            # A shard gone for good ends the driver: one line, exit code 2, within its health check.
            _on_cluster(cluster.address, tag, 2, "kill:0")
            t0 = time.monotonic()
            assert second.wait(60) == 2, second.text
            assert time.monotonic() - t0 < 30
            last = second.lines[-1]
            assert last.startswith("stragglerscope run: error: ") and f"ss-shard-{tag}-0" in last, second.text
            assert "Traceback" not in second.text, second.text
        finally:
            for d in drivers:
                d.kill()
            store.close()
    assert _strip(rows) == _strip(calm), "the same numbers as an undisturbed local run"


def _cli_env(cluster, broker, tmp_path, extra_env: dict, drop=()) -> dict:
    env = dict(os.environ, STRAGGLERSCOPE_RAY_ADDRESS=cluster.address, STRAGGLERSCOPE_KAFKA_BOOTSTRAP=broker.bootstrap,
               STRAGGLERSCOPE_KAFKA_PARTITIONS=str(PARTITIONS),
               STRAGGLERSCOPE_KAFKA_SOURCE_ID=f"c-{uuid.uuid4().hex[:6]}",
               STRAGGLERSCOPE_STORE_URL=f"chdb://{tmp_path / uuid.uuid4().hex[:6]}",
               STRAGGLERSCOPE_PIPELINE_METRICS_PORT="-1", STRAGGLERSCOPE_PIPELINE_STATE_DIR=str(tmp_path),
               **extra_env)
    for name in ("STRAGGLERSCOPE_STORE", *drop):
        env.pop(name, None)
    return env


def _run_cli_against(cluster, broker, tmp_path, extra_env: dict, drop=()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stragglerscope", "run"], capture_output=True, text=True,
                          timeout=240, env=_cli_env(cluster, broker, tmp_path, extra_env, drop), cwd=ROOT,
                          stdin=subprocess.DEVNULL)


def _in_ray_retries(proc: subprocess.Popen, state_dir: Path, timeout_s: float) -> None:
    """Return once the `run` driver ``proc`` is in ray.init's retries (Ray's native gcs_client lines in its
    driver log, ``stragglerscope.service.driver_log_path``), has exited, or ``timeout_s`` passed; the caller
    checks what it did."""
    log = state_dir / f"ray-driver-{proc.pid}.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and "gcs_client" in log.read_text(errors="replace"):
            return
        time.sleep(0.2)


def test_run_names_what_keeps_it_from_a_cluster_instead_of_stalling(broker, tmp_path):
    """Issue 39: shards of 1.5 CPUs on nodes of 2 left no node a CPU for an analysis, and nothing was ever
    stored, without a word; a cluster with token authentication refused a driver without the token after 21 s
    with a line that did not mention it, among a line a second of Ray's own retries."""
    from services.ray_cluster import LocalRayCluster

    ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, PARTITIONS)
    token = uuid.uuid4().hex + uuid.uuid4().hex
    home = tmp_path / "home"  # no ~/.ray/auth_token there
    home.mkdir()
    # The driver without the token spends about 20 s in ray.init's retries, waiting and nothing else: the
    # placement half runs meanwhile, started once that driver is in them (not beside its own start-up's work).
    # The two clusters and drivers share nothing but the broker (own ports, stores, source ids, driver logs).
    with LocalRayCluster(nodes=1, cpus_per_node=2, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}) as tc:
        refused = subprocess.Popen([sys.executable, "-m", "stragglerscope", "run"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=ROOT, stdin=subprocess.DEVNULL,
                                   env=_cli_env(tc, broker, tmp_path, {"HOME": str(home)},
                                                drop=("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")))
        try:
            _in_ray_retries(refused, tmp_path, 120)
            with LocalRayCluster(nodes=2, cpus_per_node=2) as cluster:
                r = _run_cli_against(cluster, broker, tmp_path, {"STRAGGLERSCOPE_RAY_SHARD_CPUS": "1.5",
                                                                 "STRAGGLERSCOPE_RAY_SHARD_MEMORY_MB": "128"})
            _, refused_err = refused.communicate(timeout=240)
        finally:
            if refused.poll() is None:
                refused.kill()
                refused.communicate()
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith("stragglerscope run: error: the Ray cluster cannot run this configuration: no analysis "
                           "can run") and "ray.shard_cpus" in last, r.stderr

    r = subprocess.CompletedProcess(refused.args, refused.returncode, "", refused_err)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "requires token authentication" in lines[-1] and "RAY_AUTH_MODE=token" in lines[-1], r.stderr
    assert not any("gcs_client" in ln for ln in lines), "Ray's native retries stay in the driver's log file"
    assert any("gcs_client" in p.read_text(errors="replace") for p in tmp_path.glob("ray-driver-*.log"))
