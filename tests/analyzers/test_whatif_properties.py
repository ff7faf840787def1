"""Invariants of the simulator (hypothesis, small jobs)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzers.whatif import analyze
from analyzers.whatif.simulate import Scenarios, simulate, step_times
from analyzers.whatif.timeline import simulated_table
from core.layout import JobLayout
from generators.fleetgen import CAUSES, JobSpec, generate_window

from .synth import vpp_window

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def jobs(draw):
    if draw(st.booleans()):
        t, lay = vpp_window(dp=draw(st.integers(1, 2)), pp=draw(st.integers(2, 3)), vpp=draw(st.integers(1, 2)),
                            m=draw(st.integers(1, 3)), n_steps=draw(st.integers(1, 2)), noise=0.05,
                            seed=draw(st.integers(0, 99)))
        return t, lay
    lay = JobLayout(dp_size=draw(st.integers(1, 3)), pp_size=draw(st.integers(1, 3)), cp_size=draw(st.integers(1, 2)))
    cause = draw(st.sampled_from(CAUSES))
    spec = JobSpec(job_id="p", layout=lay, num_microbatches=draw(st.integers(1, 5)), cause=cause,
                   cause_dp=draw(st.integers(0, lay.dp_size - 1)), cause_pp=draw(st.integers(0, lay.pp_size - 1)),
                   cause_factor=draw(st.floats(1.0, 3.0)), seed=draw(st.integers(0, 99)))
    return generate_window(spec, 0, draw(st.integers(1, 3)), 10**12), lay


ALL_ORIG = Scenarios(("T",), np.array([0]), np.array([0]), np.array([False]), np.array([False]))


@SETTINGS
@given(jobs())
def test_replay_with_delays_reproduces_the_actual_timeline(case):
    t, lay = case
    res = analyze(t, lay)
    assert res.replay_error == 0.0
    for s, v in res.step_time["replay"].items():
        assert v == pytest.approx(res.step_time["actual"][s], rel=1e-12)


@SETTINGS
@given(jobs(), st.data())
def test_lengthening_an_op_never_shortens_a_step(case, data):
    t, lay = case
    run = analyze(t, lay).model.run
    g, ideal = run.graphs[0], run.ideal_arrays[0]
    keys = np.zeros((g.n, 5), np.int32)
    _, before = step_times(g, simulate(g, ideal, keys, ALL_ORIG)[0])
    j = data.draw(st.integers(0, g.n - 1))
    orig = g.orig.copy()
    g.orig[j] += data.draw(st.floats(1.0, 1e8))
    try:
        _, after = step_times(g, simulate(g, ideal, keys, ALL_ORIG)[0])
    finally:
        g.orig[:] = orig
    assert np.all(after >= before)


@SETTINGS
@given(jobs())
def test_no_op_starts_before_its_dependencies_end(case):
    t, lay = case
    run = analyze(t, lay).model.run
    cols = Scenarios(("T", "ideal"), np.array([0, 0]), np.array([0, 0]), np.array([False, True]),
                     np.array([False, False]))
    for g, ideal in zip(run.graphs, run.ideal_arrays):
        E, S = simulate(g, ideal, np.zeros((g.n, 5), np.int32), cols, want_start=True)
        owner = np.repeat(np.arange(g.n), np.diff(g.pred_ptr))
        assert np.all(S[owner] >= E[g.pred_idx] - 1e-6)


@SETTINGS
@given(jobs())
def test_the_ideal_of_an_ideal_trace_is_itself(case):
    t, lay = case
    first = analyze(t, lay)
    again = analyze(simulated_table(first, "ideal"), lay)
    assert again.slowdown == pytest.approx(1.0, abs=1e-6)
    for s, v in first.step_time["ideal"].items():
        assert again.step_time["ideal"][s] == pytest.approx(v, rel=1e-6)
