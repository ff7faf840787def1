"""What the Ray cluster can run: shards and analyses against the alive nodes (ray_jobs.placement)."""
from ray_jobs.placement import Node, nodes_of, plan

GB = 1 << 30


def two_nodes(cpus=2.0):
    return [Node("10.0.0.1", cpus, 8 * GB), Node("10.0.0.2", cpus, 8 * GB)]


def test_shards_that_leave_no_node_a_cpu_for_an_analysis_are_named():
    """Issue 39: ray.shard_cpus = 1.5 on nodes of 2 CPUs: every node keeps 0.5, no analysis ever runs."""
    p = plan(two_nodes(), shards=2, shard_cpus=1.5, shard_memory_mb=1024)
    assert p.unplaced == 0 and p.analysis_slots == 0 and not p.ok
    (line,) = p.problems
    assert "no analysis can run" in line and "ray.shard_cpus" in line and "0.5 CPUs" in line


def test_a_configuration_that_fits_has_no_problem_and_counts_its_analysis_slots():
    p = plan(two_nodes(), shards=2, shard_cpus=1.0, shard_memory_mb=1024)
    assert p.ok and p.analysis_slots == 2
    assert plan(two_nodes(4.0), shards=3, shard_cpus=1.0, shard_memory_mb=1024).analysis_slots == 5


def test_after_a_node_loss_the_shard_that_fits_nowhere_is_named():
    p = plan(two_nodes()[:1], shards=2, shard_cpus=1.5, shard_memory_mb=1024)
    assert p.unplaced == 1 and len(p.problems) == 2
    assert p.problems[0].startswith("1 of 2 shard actors cannot be placed")
    assert "ray.shard_cpus, ray.shard_memory_mb" in p.problems[0]


def test_memory_counts_too_and_a_cluster_without_nodes_says_so():
    p = plan(two_nodes(), shards=2, shard_cpus=0.5, shard_memory_mb=16 * 1024)
    assert p.unplaced == 2 and "16384 MB" in p.problems[0]
    assert plan([], shards=1, shard_cpus=1.0, shard_memory_mb=1).problems == ("the Ray cluster has no alive node",)


def test_the_local_ray_shards_ask_for_nothing():
    p = plan([Node("127.0.0.1", 2.0, 8 * GB)], shards=2, shard_cpus=0, shard_memory_mb=0)
    assert p.ok and p.analysis_slots == 2


def test_nodes_of_reads_ray_nodes_alive_only():
    nodes = nodes_of([{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 4.0, "memory": 1e9}},
                      {"Alive": False, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 4.0}},
                      {"Alive": True, "NodeManagerAddress": "10.0.0.3", "Resources": {}}])
    assert nodes == [Node("10.0.0.1", 4.0, 1e9), Node("10.0.0.3", 0.0, 0.0)]
