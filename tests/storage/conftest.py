"""Storage fixtures: a store per test on every backend (chDB in a tmp dir, a real 18.16 server, a
cluster of two 18.16 servers that the store spreads its tables over, and one of two shards of two
replicas each with a ZooKeeper).

``store`` is parametrised over the backends, so one test function runs
against both. The server is started once per session by
``services.clickhouse_server.ClickHouseServer`` on 127.0.0.1; each test gets a
database of its own. The server variant is skipped only when
``clickhouse-server`` is not installed.
"""
from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from core import codec
from core import schema as S

BASE_NS = 1_700_000_000_000_000_000  # 2023-11-14T22:13:20Z
DAY_NS = 86_400 * 1_000_000_000


@pytest.fixture(scope="session")
def ch_server():
    from services.clickhouse_server import ClickHouseServer, find_server_binary

    if not find_server_binary():
        yield None
        return
    with ClickHouseServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def ch_cluster():
    """Two 18.16 servers on 127.0.0.1 forming cluster ``stragglerscope`` (one replica per shard, no ZooKeeper)."""
    from services.clickhouse_server import ClickHouseCluster, find_server_binary

    if not find_server_binary():
        yield None
        return
    with ClickHouseCluster(shards=2) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def ch_replicated():
    """Two shards x two replicas of 18.16 on 127.0.0.1, replicating through a local ZooKeeper."""
    from services.clickhouse_server import ClickHouseCluster, find_server_binary
    from services.zookeeper import LocalZooKeeper, zookeeper_installed

    if not find_server_binary() or not zookeeper_installed():
        yield None
        return
    with LocalZooKeeper() as zk, ClickHouseCluster(shards=2, replicas=2, zookeeper_port=zk.port) as cluster:
        yield cluster


def _server_url(ch_server) -> str:
    if ch_server is None:
        pytest.skip("clickhouse-server is not installed (apt-get install clickhouse-server)")
    return ch_server.store_url(f"t_{uuid.uuid4().hex[:12]}")


def backend_url(backend: str, tmp_path, request) -> str:
    if backend == "chdb":
        return f"chdb://{tmp_path / 'store'}"
    if backend == "cluster":  # the store spread over two servers (``cluster=`` in the URL)
        return _server_url(request.getfixturevalue("ch_cluster"))
    if backend == "replicated":  # ... over two shards of two replicas each
        cluster = request.getfixturevalue("ch_replicated")
        if cluster is None:
            pytest.skip("clickhouse-server or zookeeper is not installed (make setup-test installs both)")
        return _server_url(cluster)
    return _server_url(request.getfixturevalue("ch_server"))


@pytest.fixture
def store_url(request, tmp_path):
    """URL of an empty store on the backend named by the test's parameter."""
    return backend_url(request.param, tmp_path, request)


def fresh_store(url: str):
    """An empty store after setup(), for a fixture to yield from; closed (server: database dropped) after."""
    from storage import open_store

    s = open_store(url)
    s.setup()
    yield s
    if hasattr(s, "database") and not s._closed:
        s._execute(f"DROP DATABASE IF EXISTS `{s.database}`")  # on every server of a cluster
    s.close()


@pytest.fixture(params=["chdb", *(pytest.param(b, marks=pytest.mark.integration)
                                    for b in ("server", "cluster", "replicated"))])
def store(request, tmp_path):
    """An empty store on each backend in turn; the ClickHouse servers' variants are integration tests (they
    start servers), so a unit-tier file that takes ``store`` runs its chDB variant there."""
    yield from fresh_store(backend_url(request.param, tmp_path, request))


@pytest.fixture
def server_store(ch_server):
    from storage import open_store

    s = open_store(_server_url(ch_server))
    yield s
    if not s._closed:
        s._execute(f"DROP DATABASE IF EXISTS `{s.database}`")
    s.close()


def window_rows(n: int = 4, *, job: str = "job-a", attempt: int = 0, first_window: int = 0, team: str = "llm",
                model: str = "gpt-7b", n_gpus: int = 64, slowdown: float = 1.25, gpu_hours: float = 10.0,
                verdict: str = "worker", analyzed_ns: int = BASE_NS, step: int = 10) -> pa.Table:
    """``n`` window results of one job, windows ``first_window, first_window + step, ...``."""
    rows = []
    for i in range(n):
        wid = first_window + i * step
        s = slowdown
        rows.append(dict(
            job_id=job, attempt=attempt, window_id=wid, first_step=wid, last_step=wid + step - 1, n_steps=step,
            start_ns=analyzed_ns - 60_000_000_000 + i, end_ns=analyzed_ns + i, analyzed_ns=analyzed_ns + i * 1000,
            team=team, model=model, n_gpus=n_gpus, dp_size=n_gpus // 8, pp_size=8, slowdown=s,
            launch_slowdown=1.02, waste_fraction=1 - 1 / s, step_time_actual=1.02 * s, step_time_sim=s,
            step_time_ideal=1.0, gpu_hours=gpu_hours, wasted_gpu_hours=gpu_hours * (1 - 1 / s), m_w=0.5, m_s=0.1,
            verdict=verdict, verdicts_json='[{"kind": "worker"}]', complete=True, note="", n_ops=1000))
    return codec.from_rows(S.WINDOW, rows)


def optype_rows(job: str, window_ids, attempt: int = 0, types=(("forward-compute", 1.1), ("gc", 1.3))) -> pa.Table:
    return codec.from_rows(S.OPTYPE_SLOWDOWN, [
        dict(job_id=job, attempt=attempt, window_id=w, step=st, optype=t, slowdown=s)
        for w in window_ids for t, s in types for st in (-1, w)])


def registration(job: str, attempt: int = 0, ts_ns: int = 1, team: str = "llm", n_gpus: int = 64) -> pa.Table:
    return codec.from_rows(S.JOB, [dict(
        job_id=job, attempt=attempt, ts_ns=ts_ns, team=team, model="gpt-7b", n_gpus=n_gpus, dp_size=n_gpus // 8,
        pp_size=8, tp_size=1, cp_size=1, vpp_size=1, num_microbatches=8, profiled_steps=10, gpu_type="H100",
        peak_flops=9.9e14, flops_per_token=6e9, tokens_per_step=1 << 20)])
