"""The store spread over a ClickHouse cluster of two real 18.16 servers (``cluster=`` in the store URL).

Every store test also runs on the cluster (the ``store`` fixture's "cluster"
backend). These are the cluster's own properties: where rows land, the same
answers as one server, exactly-once when a shard is down during an insert,
and a server that lacks tables gaining them at setup.
"""
from __future__ import annotations


import pytest

from storage import StoreError, open_store
from tests.storage.conftest import backend_url, fresh_store, window_rows

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster_store(request, tmp_path):
    yield from fresh_store(backend_url("cluster", tmp_path, request))


def _local(cluster, database: str, sql: str) -> list:
    """``sql`` on each server alone (its own shard), as a list of first-column values per server."""
    out = []
    for srv in cluster.servers:
        st = open_store(srv.store_url(database))
        try:
            out.append(st._select(sql).column(0).to_pylist())
        finally:
            st.close()
    return out


def test_each_job_lives_on_one_shard_and_both_shards_hold_rows(ch_cluster, cluster_store):
    jobs = [f"job-{i}" for i in range(24)]
    for j in jobs:
        cluster_store.insert("window", window_rows(3, job=j))
    per_server = _local(ch_cluster, cluster_store.database, "SELECT DISTINCT job_id FROM windows_data")
    assert all(per_server), f"both shards hold rows: {[len(p) for p in per_server]}"
    assert sorted(per_server[0] + per_server[1]) == sorted(jobs), "each job on exactly one shard"
    assert cluster_store.query("SELECT count() AS n FROM windows").column("n")[0].as_py() == 72
    assert all(cluster_store.window_stored((j, 0, 20)) for j in jobs)


def test_named_queries_answer_as_on_one_server(ch_cluster, cluster_store, server_store):
    from tests.storage.test_store import _fleet, assert_same_named_results, optype_rows

    server_store.setup()
    for st in (cluster_store, server_store):
        _fleet(st)
        st.insert("optype_slowdown", optype_rows("a", [0, 10]))
        for i in range(10):  # enough jobs that both shards hold some
            st.insert("window", window_rows(2, job=f"more-{i}", slowdown=1.1 + i / 50))
    assert all(_local(ch_cluster, cluster_store.database, "SELECT count() FROM windows_data")[i][0] > 0
               for i in range(2))
    assert_same_named_results(cluster_store, server_store)


def test_an_insert_while_a_shard_is_down_fails_and_its_retry_stores_each_window_once(ch_cluster, cluster_store):
    """The exactly-once argument, tried: a synchronous Distributed insert with one shard down fails (after
    the other shard may have written its part); the shard's retry then drops the keys stored already."""
    jobs = [f"j{i}" for i in range(16)]
    batch = __import__("pyarrow").concat_tables([window_rows(2, job=j) for j in jobs])
    down = ch_cluster.servers[1]
    down.stop()
    try:
        with pytest.raises(StoreError):
            cluster_store.insert("window", batch)
    finally:
        down.start()
    per_server_before = _local(ch_cluster, cluster_store.database, "SELECT count() FROM windows_data")
    cluster_store.insert("window", batch)  # the retry, as a shard's commit does it
    cluster_store.insert("window", batch)  # and a replay after a crash
    assert cluster_store.query(f"SELECT count() AS n FROM {cluster_store._data('windows')}"
                               ).column("n")[0].as_py() == len(jobs) * 2, "nothing twice on disk"
    assert cluster_store.query("SELECT count() AS n FROM windows").column("n")[0].as_py() == len(jobs) * 2
    assert per_server_before[1] == [0], "the stopped shard had nothing before the retry"


def test_a_server_lacking_tables_gains_them_at_setup(ch_cluster, cluster_store):
    """A server added to the cluster later (here: one that lost a table) is brought level by setup()."""
    peer = open_store(ch_cluster.servers[1].store_url(cluster_store.database))
    try:
        peer._execute("DROP TABLE link_cells")
        peer._execute("DROP TABLE link_cells_data_all")
        peer._execute("DROP TABLE link_cells_data")
        peer._execute("ALTER TABLE windows_data DROP COLUMN note")
    finally:
        peer.close()
    cluster_store.setup()
    names = _local(ch_cluster, cluster_store.database, "SELECT name FROM system.tables "
                   "WHERE database = currentDatabase() AND startsWith(name, 'link_cells')")
    assert [sorted(n) for n in names] == [["link_cells", "link_cells_data", "link_cells_data_all"]] * 2
    cluster_store.insert("window", window_rows(2, job="after"))
    assert cluster_store.run_named("job_windows", {"job_id": "after"}).column("note").to_pylist() == ["", ""]


def test_a_cluster_the_server_does_not_know_is_one_line(ch_cluster):
    if ch_cluster is None:
        pytest.skip("clickhouse-server is not installed")
    url = ch_cluster.servers[0].store_url("default", cluster="nosuch")
    with pytest.raises(StoreError, match="cluster 'nosuch' is not in the remote_servers"):
        open_store(url)
    with pytest.raises(StoreError, match="bad cluster="):
        open_store(ch_cluster.servers[0].store_url("default", cluster="a;b"))


# -- two shards of two replicas each (ReplicatedReplacingMergeTree through a local ZooKeeper) ----------

@pytest.fixture
def replicated_store(request, tmp_path):
    yield from fresh_store(backend_url("replicated", tmp_path, request))


def test_replicas_of_a_shard_hold_the_same_rows_and_reads_survive_a_lost_replica(ch_replicated, replicated_store):
    assert replicated_store.replicated and replicated_store.insert_quorum == 2  # a majority of 2
    for i in range(12):
        replicated_store.insert("window", window_rows(2, job=f"r{i}"))
    counts = [c[0] for c in _local(ch_replicated, replicated_store.database, "SELECT count() FROM windows_data")]
    assert counts[0] == counts[1] and counts[2] == counts[3] and counts[0] and counts[2], counts
    assert counts[0] + counts[2] == 24, "each shard's rows once, on both of its replicas"
    lost = ch_replicated.servers[3]  # the second replica of shard 2
    lost.stop()
    try:
        assert replicated_store.query("SELECT count() AS n FROM windows").column("n")[0].as_py() == 24
        assert replicated_store.window_stored(("r5", 0, 10))
    finally:
        lost.start()


def test_a_write_without_its_quorum_fails_and_its_retry_stores_each_window_once(ch_replicated, replicated_store,
                                                                               monkeypatch):
    """With one replica of a shard down, a majority of two cannot hold the write: it fails (the shard keeps
    the unit and retries; nothing is lost), and the retry after the replica is back stores each window once."""
    import storage.server_backend as sb

    monkeypatch.setattr(sb, "QUORUM_TIMEOUT_S", 3.0)  # ZooKeeper notices the lost replica only after its session
    batch = __import__("pyarrow").concat_tables([window_rows(2, job=f"q{i}") for i in range(16)])
    lost = ch_replicated.servers[1]  # the second replica of shard 1
    lost.stop()
    try:
        with pytest.raises(StoreError, match="quorum|alive replicas") as refused:
            replicated_store.insert("window", batch)
        assert refused.value.transient, "the shard's checkpoint waits for it like an outage, never gives up"
    finally:
        lost.start()
    replicated_store._wait_replicas_active()
    replicated_store.insert("window", batch)
    replicated_store.insert("window", batch)  # a replay
    assert replicated_store.query(f"SELECT count() AS n FROM {replicated_store._data('windows')}"
                                  ).column("n")[0].as_py() == 32
    assert replicated_store.query("SELECT count() AS n FROM windows").column("n")[0].as_py() == 32


def test_a_quorum_of_one_keeps_writing_with_a_replica_down(ch_replicated, replicated_store):
    st = open_store(ch_replicated.store_url(replicated_store.database) + "&insert_quorum=1")
    lost = ch_replicated.servers[3]
    lost.stop()
    try:
        st.insert("window", window_rows(2, job="one"))
        assert st.query("SELECT count() AS n FROM windows WHERE job_id = 'one'").column("n")[0].as_py() == 2
    finally:
        lost.start()
        st.close()
