"""Window profiles in, regressions and their alerts out: ``ray_jobs.regressions`` in a shard's terms."""
from __future__ import annotations

import json

import numpy as np

from core import codec
from core import schema as S
from core.config import AlertConfig, Config
from ray_jobs.alerts import AlertReducer, AlertRules
from analyzers.window import typical_step_s, window_profile
from ray_jobs.regressions import RegressionReducer, params_of
from ray_jobs.state import decode, encode
from tests.fakes import ManualClock

OPS = {"forward-compute": 0.010, "backward-compute": 0.020, "grads-reduce-scatter": 0.004, "optimizer": 0.001}


def ops_of(job, window, rng, comm=1.0, workers=((0, 0), (1, 0), (0, 1), (1, 1)), steps=4):
    rows, t = [], window * 10**9
    for step in range(window, window + steps):
        for dp, pp in workers:
            start = t
            for optype, d in OPS.items():
                d = d * (comm if optype == "grads-reduce-scatter" else 1.0) * float(np.exp(rng.normal(0, 0.01)))
                rows.append(dict(job_id=job, attempt=0, rank=dp * 2 + pp, dp_rank=dp, pp_rank=pp, window_id=window,
                                 step=step, optype=optype, start_ns=start, duration_ns=int(d * 1e9), seq_id=0,
                                 mc=0, gmc=0, mb_id=0))
                start += int(d * 1e9)
        t += 50_000_000
    return codec.from_rows(S.OP_SPAN, rows)


def profile(job, window, rng, **kw):
    ops = ops_of(job, window, rng, **kw)
    step = sum(r["duration_ns"] for r in ops.to_pylist() if r["dp_rank"] == 0 and r["pp_rank"] == 0) / 4e9
    row = dict(job_id=job, attempt=0, window_id=window, first_step=window, end_ns=(window + 4) * 10**9,
               step_time_actual=step)
    return window_profile(ops, row)


def test_the_profile_holds_the_step_each_op_type_and_each_worker():
    rows = profile("j", 0, np.random.default_rng(0)).to_pylist()
    job = {r["optype"]: r["seconds"] for r in rows if r["dp_rank"] == -1}
    assert set(job) == {"step", *OPS}
    assert abs(job["backward-compute"] - 0.020) < 0.001 and abs(job["step"] - sum(OPS.values())) < 0.002
    workers = {(r["dp_rank"], r["pp_rank"]) for r in rows if r["dp_rank"] >= 0}
    assert workers == {(0, 0), (1, 0), (0, 1), (1, 1)}


def test_a_one_off_slow_step_does_not_set_the_level_of_a_change():
    """The first step after a change pays one-off costs (seen: 434 ms, then 306 ms, then 220 ms steps after an
    all-reduce grew): the window's level is its median step, so the change is the lasting one (+25%), not
    the first window's mean (+60%)."""
    rng = np.random.default_rng(2)
    clock = ManualClock()
    reducer = RegressionReducer(clock, params_of(Config().regression))
    for i in range(16):
        steps = {i * 4 + k: 0.175 * (1.25 if i >= 9 else 1.0) * float(np.exp(rng.normal(0, 0.01))) for k in range(4)}
        if i == 9:
            steps[36], steps[37] = 0.45, 0.31
        ops = ops_of("j", i * 4, rng)
        row = dict(job_id="j", attempt=0, window_id=i * 4, first_step=i * 4, end_ns=(i * 4 + 4) * 10**9,
                   step_time_actual=float(np.mean(list(steps.values()))))
        reducer.add("window_profile", window_profile(ops, row, typical_step_s(steps)))
    rows = [r for u in reducer.due(0.0) for r in u.tables["regression"].to_pylist() if r["kind"] == "regression"]
    (reg,) = rows
    assert reg["began_window"] == 36 and abs(reg["change"] - 0.25) < 0.05, reg


def test_a_communication_regression_is_stored_alerted_and_survives_a_restart():
    rng = np.random.default_rng(1)
    clock = ManualClock()
    published = []
    reducer = RegressionReducer(clock, params_of(Config().regression))
    alerts = AlertReducer(AlertRules(AlertConfig()), clock, published.append)
    units = []
    for i in range(20):
        # the DP all-reduce takes 4x as long from window 12 (step time +34%)
        reducer.add("window_profile", profile("j", i * 4, rng, comm=4.0 if i >= 12 else 1.0))
        if i == 10:  # a restarted shard resumes the detector from its saved state
            state = decode(encode({"regressions": reducer.state()}))["regressions"]
            reducer = RegressionReducer(clock, params_of(Config().regression))
            reducer.restore(state)
        units += reducer.due(0.0)
    rows = [r for u in units for r in u.tables["regression"].to_pylist()]
    (reg,) = [r for r in rows if r["kind"] == "regression"]
    assert reg["began_window"] == 48 and reg["window_id"] <= 56, reg
    assert 0.25 < reg["change"] < 0.45 and reg["scope"] == "every worker", reg
    shares = json.loads(reg["optypes_json"])
    assert max(shares, key=shares.get) == "grads-reduce-scatter", shares
    assert "compute unchanged: communication" in reg["summary"], reg["summary"]
    for u in units:
        alerts.add("regression", u.tables["regression"])
    (unit,) = alerts.due(0.0)
    (alert,) = unit.tables["alert"].to_pylist()
    assert alert["rule"] == "regression" and alert["severity"] == "critical" and alert["summary"] == reg["summary"]


def test_a_return_to_the_baseline_is_stored_not_alerted():
    rng = np.random.default_rng(2)
    clock = ManualClock()
    reducer = RegressionReducer(clock)
    units = []
    for i in range(30):
        reducer.add("window_profile", profile("j", i * 4, rng, comm=4.0 if 10 <= i < 20 else 1.0))
        units += reducer.due(0.0)
    kinds = [r["kind"] for u in units for r in u.tables["regression"].to_pylist()]
    assert kinds == ["regression", "recovered"], kinds
    alerts = AlertReducer(AlertRules(AlertConfig()), clock, lambda a: None)
    for u in units:
        alerts.add("regression", u.tables["regression"])
    (unit,) = alerts.due(0.0)
    assert [a["rule"] for a in unit.tables["alert"].to_pylist()] == ["regression"]


def test_jitter_and_a_failed_window_say_nothing():
    rng = np.random.default_rng(3)
    reducer = RegressionReducer(ManualClock())
    for i in range(200):
        reducer.add("window_profile", profile("j", i * 4, rng))
        reducer.add("window_profile", codec.empty(S.WINDOW_PROFILE))
    assert reducer.due(0.0) == []
    assert len(reducer.detectors["j"].points) <= reducer.params.max_points
