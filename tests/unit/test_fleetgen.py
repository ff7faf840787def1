"""The fleet generator's pipeline schedules: plain and interleaved 1F1B, simulated faithfully."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from analyzers.whatif import analyze
from core.layout import JobLayout
from generators.fleetgen import JobSpec, _stage_order, generate_window, make_fleet


def test_interleaved_order_is_megatrons():
    # pp 2, two chunks per stage, 4 microbatches: stage 0 warms up with (pp - 1) * 2 + (vpp - 1) * pp = 4
    # forwards, stage 1 with 2; microbatches go in groups of pp per chunk, backwards through chunks in reverse.
    order = {s: " ".join(f"{k}{i}.{c}" for k, i, c in _stage_order(s, 2, 4, 2)) for s in (0, 1)}
    assert order[0] == "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
    assert order[1] == "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"
    # Without interleaving: the plain 1F1B of the last stage alternates from the start.
    assert [k for k, _, _ in _stage_order(1, 2, 3)] == ["F", "B", "F", "B", "F", "B"]


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 4), (8, 2, 16), (3, 1, 5)])
def test_every_stage_runs_each_chunk_and_microbatch_once_forward_before_backward(pp, vpp, m):
    for s in range(pp):
        order = _stage_order(s, pp, m, vpp)
        assert sorted(order) == sorted(itertools.product("FB", range(m), range(vpp)))
        assert all(order.index(("F", i, c)) < order.index(("B", i, c)) for i in range(m) for c in range(vpp))


def test_interleaving_needs_whole_microbatch_groups():
    with pytest.raises(ValueError, match="multiple of pp_size"):
        JobSpec("j", JobLayout(2, 4, vpp_size=2), num_microbatches=6)
    with pytest.raises(ValueError, match="pp_size >= 2"):
        JobSpec("j", JobLayout(2, 1, vpp_size=2), num_microbatches=4)


@pytest.mark.parametrize("dp,pp,vpp,m,cause", [(2, 4, 2, 8, "none"), (2, 4, 2, 8, "slow_worker"),
                                               (4, 2, 3, 4, "slow_worker"), (2, 8, 4, 16, "slow_worker"),
                                               (2, 4, 2, 8, "gc")])
def test_interleaved_windows_are_simulated_faithfully(dp, pp, vpp, m, cause):
    """Every send pairs with its recv across the wrap-around from the last stage to the first, the
    dependency model explains every start (no clamped launch delays) and the simulated original is
    within the paper's 5% of the actual step time; the slow worker is the top worker."""
    lay = JobLayout(dp_size=dp, pp_size=pp, vpp_size=vpp)
    spec = JobSpec("vpp", lay, num_microbatches=m, cause=cause, cause_dp=1, cause_pp=pp - 2,
                   cause_factor=6.0 if cause == "gc" else 1.6)
    t = generate_window(spec, 0, 4, 10**12)
    assert set(t["gmc"].to_pylist()) >= set(range(pp * vpp))
    res = analyze(t, lay)
    assert res.warnings == [] and res.replay_error < 1e-9
    assert res.launch_slowdown == pytest.approx(1.0, abs=0.05)
    if cause == "slow_worker":
        assert res.verdict == "worker"
        assert res.mw["top_workers"][0] == [1, pp - 2]


def test_interleaving_shrinks_the_pipeline_bubble():
    def step_s(vpp: int) -> float:
        lay = JobLayout(dp_size=2, pp_size=8, vpp_size=vpp)
        res = analyze(generate_window(JobSpec("b", lay, num_microbatches=8), 0, 3, 10**12), lay)
        return float(np.mean(list(res.step_time["actual"].values())))

    # Bubble (pp - 1) / vpp microbatch times: 15 -> 11.5 of them with two chunks (forward + backward = 60 ms).
    assert step_s(2) < 0.85 * step_s(1)


def test_fleet_mixes_in_interleaved_jobs_without_changing_the_others():
    with_vpp, without = make_fleet(40, seed=5), make_fleet(40, seed=5, vpp_share=0.0)
    assert any(j.layout.vpp_size == 2 for j in with_vpp)
    for a, b in zip(with_vpp, without):
        assert a.layout.vpp_size in (1, 2) and a == (b if a.layout.vpp_size == 1 else
                                                   dataclasses.replace(b, layout=a.layout))
