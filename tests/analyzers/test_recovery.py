"""Oobleck-style recovery planning: templates, instantiation and batch distribution against brute force."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from analyzers.remedies import distribute_batch, partition_layers, plan_recovery
from analyzers.remedies.recovery import PipelineTemplate, make_template, uniform_restart


def compositions(n: int, k: int):
    """Every way to split n layers into k non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        yield tuple(b[i + 1] - b[i] for i in range(k))


def stage_times(t, parts):
    b = np.concatenate([[0], np.cumsum(parts)])
    return [float(np.sum(t[b[i]:b[i + 1]])) for i in range(len(parts))]


@pytest.mark.parametrize("seed", range(6))
def test_partition_is_optimal(seed):
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.5, 2.0, 10)
    t[-1] += 3.0  # a heavy loss layer
    mem = rng.uniform(1.0, 2.0, 10)
    for k in (2, 3, 4):
        for cap in (None, 6.0):
            got = partition_layers(t, k, layer_mem=mem, mem_cap=cap)
            ok = [p for p in compositions(10, k)
                  if cap is None or max(stage_times(mem, p)) <= cap]
            if not ok:
                assert got is None
                continue
            best = min(max(stage_times(t, p)) for p in ok)
            assert got is not None and len(got) == k and sum(got) == 10 and min(got) >= 1
            assert max(stage_times(t, got)) == pytest.approx(best)
            if cap is not None:
                assert max(stage_times(mem, got)) <= cap + 1e-9


def test_partition_edge_cases():
    assert partition_layers([1.0, 1.0], 3) is None  # more stages than layers
    assert partition_layers([1.0] * 4, 2, layer_mem=[3.0] * 4, mem_cap=2.0) is None  # one layer over the cap
    assert partition_layers([1.0] * 4, 4) == (1, 1, 1, 1)


def layer_model(L=24, loss=3.0):
    t = [1.0] * L
    t[-1] += loss
    return t


def test_templates_are_consecutive_from_the_smallest_that_fits():
    # 24 layers of 1 unit of memory, 4 units per GPU, 2 GPUs per node (1-GPU stages): 3 nodes hold it.
    plan = plan_recovery(12, layer_model(), 2, 1, 32, layer_mem=[1.0] * 24, gpu_mem=4.0)
    assert plan.feasible and plan.min_nodes == 3
    assert make_template(layer_model(), 2, 2, layer_mem=[1.0] * 24, mem_cap=4.0) is None
    sizes = [t.nodes for t in plan.templates]
    assert sizes == list(range(3, 12 - 1 * 3 + 1))  # n0 .. N - f * n0
    for t in plan.templates:
        assert t.stages == 2 * t.nodes and sum(t.layers) == 24
        assert max(t.stage_mem) <= 4.0
    assert plan.covers_from == 6


@pytest.mark.parametrize("f", [0, 1, 2])
def test_every_node_count_from_the_bound_is_usable(f):
    n0 = 2
    for n in range(16):
        plan = plan_recovery(n, layer_model(), 4, f, 24, min_nodes=n0)
        if n < (f + 1) * n0:
            assert not plan.feasible and "f + 1" in plan.reason and plan.pipelines == ()
            continue
        assert plan.feasible, (n, plan.reason)
        assert len(plan.pipelines) >= f + 1  # f more failures still leave a whole replica
        used = [x for p in plan.pipelines for x in p.nodes]
        assert len(used) == len(set(used)) and set(used) | set(plan.spare_nodes) == set(range(n))
        assert all(p.template_nodes >= n0 for p in plan.pipelines)
        assert sum(p.microbatches for p in plan.pipelines) == 24


def brute_force(templates, n_nodes, f, B):
    """Smallest step time over every multiset of templates on at most n_nodes nodes (at least f + 1)."""
    best = math.inf
    sizes = [t.nodes for t in templates]
    for k in range(f + 1, n_nodes // min(sizes) + 1):
        for combo in itertools.combinations_with_replacement(range(len(templates)), k):
            if sum(sizes[i] for i in combo) > n_nodes or k > B:
                continue
            chosen = [templates[i] for i in combo]
            b = distribute_batch(chosen, B)
            best = min(best, max(t.step_time(x) for t, x in zip(chosen, b)))
    return best


@pytest.mark.parametrize("n,f,B", [(5, 1, 8), (7, 1, 16), (9, 2, 12), (8, 0, 32), (10, 1, 6)])
def test_instantiation_maximises_throughput(n, f, B):
    plan = plan_recovery(n, layer_model(16, loss=2.5), 2, f, B, min_nodes=2)
    assert plan.feasible
    assert plan.step_time_s == pytest.approx(brute_force(plan.templates, n, f, B))
    assert plan.throughput == pytest.approx(B / plan.step_time_s)


def brute_distribution(templates, B):
    best = math.inf
    for b in itertools.product(range(1, B + 1), repeat=len(templates)):
        if sum(b) == B:
            best = min(best, max(t.step_time(x) for t, x in zip(templates, b)))
    return best


def test_batch_distribution_balances_heterogeneous_pipelines():
    ts = [PipelineTemplate(2, (4, 4), (4.0, 4.5)), PipelineTemplate(3, (3, 3, 2), (3.0, 3.0, 2.5)),
          PipelineTemplate(4, (2, 2, 2, 2), (2.0, 2.0, 2.0, 2.5))]
    for B in (3, 7, 12, 20):
        b = distribute_batch(ts, B)
        assert sum(b) == B and min(b) >= 1
        times = [t.step_time(x) for t, x in zip(ts, b)]
        assert max(times) == pytest.approx(brute_distribution(ts, B))
        # Balanced to within one microbatch of the slowest stage.
        assert max(times) - min(times) <= max(max(t.stage_s) for t in ts) + 1e-9
    with pytest.raises(ValueError, match="cannot feed"):
        distribute_batch(ts, 2)


def test_heterogeneous_plan_beats_the_uniform_restart():
    # Pipelines of 2 nodes, 5 survive: the naive restart runs 2 copies and idles a node.
    t = layer_model(32, loss=3.0)
    plan = plan_recovery(5, t, 4, 1, 24, min_nodes=2)
    assert sorted(p.template_nodes for p in plan.pipelines) == [2, 3] and plan.spare_nodes == ()
    naive = uniform_restart(5, make_template(t, 2, 4), 24)
    assert plan.step_time_s < naive
    assert uniform_restart(1, make_template(t, 2, 4), 24) == math.inf


def test_higher_fault_tolerance_needs_more_pipelines():
    t = layer_model(32)
    steps = []
    for f in (0, 1, 2, 3):
        plan = plan_recovery(12, t, 4, f, 48, min_nodes=2)
        assert plan.feasible and len(plan.pipelines) >= f + 1 and plan.f == f
        steps.append(plan.step_time_s)
    assert steps == sorted(steps)  # each f only narrows the choice
    assert not plan_recovery(12, t, 4, 6, 48, min_nodes=2).feasible


def test_unfit_model_and_bad_arguments():
    plan = plan_recovery(10, [1.0] * 8, 8, 1, 16, layer_mem=[10.0] * 8, gpu_mem=5.0)
    assert not plan.feasible and "fits" in plan.reason
    assert plan.to_dict()["step_time_s"] is None
    with pytest.raises(ValueError, match="whole stages"):
        plan_recovery(4, [1.0] * 8, 8, 1, 16, gpus_per_stage=3)
    with pytest.raises(ValueError, match="f >= 0"):
        plan_recovery(4, [1.0] * 8, 8, -1, 16)
    small = plan_recovery(8, [1.0] * 8, 2, 2, 2, min_nodes=1)
    assert not small.feasible and "global batch" in small.reason


def test_plan_scales_to_a_large_fleet():
    import time

    t0 = time.perf_counter()
    plan = plan_recovery(1000, [1.0] * 95 + [4.0], 8, 2, 4096, min_nodes=2)
    assert plan.feasible and len(plan.pipelines) >= 3
    assert sum(p.microbatches for p in plan.pipelines) == 4096
    assert time.perf_counter() - t0 < 10
