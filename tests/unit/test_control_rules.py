"""Run-time control of the alert rules' thresholds: the regression rule's and the link rule's, changed for the
fleet or one job through the control topic, applied by the shard to the next decision, restored when the change
ends; and `control set --job` refusing a job the store has never seen."""
from __future__ import annotations

import json

import pytest

from core import codec
from core import schema as S
from core.config import Config
from core.control import ControlError, alert_overrides, check, make_change, regression_overrides
from ray_jobs.shard import ShardWorker
from tests.fakes import FakeControls, FakeSink, FakeSource, ManualClock


def shard(**cfg_over):
    clock, sink, controls = ManualClock(), FakeSink(), FakeControls()
    cfg = Config().replace(pipeline={"commit_interval_s": 0.0, "state_interval_s": 0.0}, **cfg_over)
    w = ShardWorker(0, [0], cfg, "s", consumer_factory=lambda: FakeSource([]), sink_factory=lambda: sink,
                    clock=clock, control_factory=lambda: controls)
    w.setup()
    return w, clock, sink, controls


def alerts_of(sink, rule: str) -> list[str]:
    return sorted(a["job_id"] for a in sink.rows.get("alert", []) if a["rule"] == rule)


# -- the regression rule ------------------------------------------------------------------------------------------

def profiles(job: str, slower: float, baseline: int = 5, after: int = 8) -> codec.pa.Table:
    """WINDOW_PROFILE rows of a job whose step takes 1 s for ``baseline`` windows, then ``slower`` times that
    (the job as a whole only: no workers, so no degraded-worker events muddle the count)."""
    rows = []
    for i in range(baseline + after):
        step = 1.0 if i < baseline else slower
        rows.append(dict(job_id=job, attempt=0, window_id=i * 10, first_step=i * 10, end_ns=(i + 1) * 10**10,
                         dp_rank=-1, pp_rank=-1, rank=-1, optype="step", seconds=step))
    return codec.from_rows(S.WINDOW_PROFILE, rows)


@pytest.mark.parametrize("what, why", [
    ({"regression_min_change": 0}, "regression_min_change = 0 is out of range"),
    ({"regression_min_change": 12}, "regression_min_change = 12 is out of range"),
    ({"regression_k_windows": 2.5}, "regression_k_windows must be a whole number"),
    ({"regression_k_windows": 0}, "regression_k_windows = 0 is out of range"),
    ({"regression_baseline_windows": "many"}, "regression_baseline_windows must be a number"),
    ({"alerts_link_confidence": 1.5}, "alerts_link_confidence = 1.5 is out of range"),
    ({"alerts_link_confidence": -0.1}, "alerts_link_confidence = -0.1 is out of range"),
    ({"alerts_slowdown_threshold": 0.9}, "alerts_slowdown_threshold = 0.9 is out of range (1 to 100)"),
    ({"alerts_min_gpus": 2.5}, "alerts_min_gpus must be a whole number"),
    ({"alerts_min_gpus": -1}, "alerts_min_gpus = -1 is out of range"),
    ({"alerts_fidelity_tolerance": "wide"}, "alerts_fidelity_tolerance must be a number"),
    ({"alerts_cooldown_s": -5}, "alerts_cooldown_s = -5 is out of range"),
    ({"alerts_cooldown_s": 8 * 86400}, "alerts_cooldown_s = 691200 is out of range"),
    ({"alerts_link_certain": 1.01}, "alerts_link_certain = 1.01 is out of range"),
])
def test_rule_thresholds_out_of_range_are_refused_with_their_reason(what, why):
    record = dict(change_id="c1", who="alice", when=10**18, scope="fleet", what=what)
    with pytest.raises(ControlError) as e:
        check(json.dumps(record))
    assert why in str(e.value) and "\n" not in str(e.value)


def test_rule_thresholds_are_normalised_and_named_by_their_config_fields():
    c = make_change("a", 10**18, "j1", {"regression_k_windows": "4", "regression_min_change": "0.2",
                                        "alerts_link_confidence": "0.7", "hang_min_s": 30})
    assert c.what["regression_k_windows"] == 4 and isinstance(c.what["regression_k_windows"], int)
    assert regression_overrides(c.what) == {"k_windows": 4, "min_change": 0.2}
    assert alert_overrides(c.what) == {"link_confidence": 0.7}


def test_a_regression_threshold_change_alters_the_next_alert_and_clearing_restores_the_configured_one():
    """Configured: +10% is a regression. The fleet's change lowers it to +5% and a job's own raises it to +30%
    (the job's beats the fleet's); once both are cleared, +8% is no regression again and +15% is one."""
    w, clock, sink, controls = shard()
    configured = w.cfg.regression
    try:
        now_ns = clock.wall_ns()
        fleet = make_change("a", now_ns, None, {"regression_min_change": 0.05})
        own = make_change("a", now_ns, "j2", {"regression_min_change": 0.3, "regression_k_windows": 4})
        controls.records += [fleet.to_json(), own.to_json()]
        w.step(poll_timeout_ms=0)
        assert w.regressions.params_for("j1").min_change == 0.05
        assert (w.regressions.params_for("j2").min_change, w.regressions.params_for("j2").k_windows) == (0.3, 4)
        w.regressions.add("window_profile", profiles("j1", 1.08))  # +8%: under the configured 10%
        w.regressions.add("window_profile", profiles("j2", 1.15))  # +15%: over it, under the job's own 30%
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert alerts_of(sink, "regression") == ["j1"]
        [reg] = [r for r in sink.rows["regression"] if r["kind"] == "regression"]
        assert reg["job_id"] == "j1" and abs(reg["change"] - 0.08) < 0.01

        controls.records += [make_change("a", clock.wall_ns(), None, {}, clears="*").to_json(),
                             make_change("a", clock.wall_ns(), "j2", {}, clears=own.change_id).to_json()]
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert w.regressions.params_for("j1") == w.regressions.params_for("j2") == w.regressions.base_params
        assert w.regressions.params.min_change == configured.min_change
        assert w.regressions.detectors["j1"].params.min_change == configured.min_change  # the live detector too
        w.regressions.add("window_profile", profiles("j3", 1.08))
        w.regressions.add("window_profile", profiles("j4", 1.15))
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert alerts_of(sink, "regression") == ["j1", "j4"]
    finally:
        w.stop()


def test_a_regression_threshold_change_that_runs_out_restores_the_configured_one():
    w, clock, sink, controls = shard()
    try:
        controls.records.append(make_change("a", clock.wall_ns(), "j1", {"regression_min_change": 0.05},
                                            for_s=60).to_json())
        w.step(poll_timeout_ms=0)
        assert w.regressions.params_for("j1").min_change == 0.05
        clock.t += 61
        w.step(poll_timeout_ms=0)
        assert w.regressions.params_for("j1") == w.regressions.base_params
        w.regressions.add("window_profile", profiles("j1", 1.08))
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert alerts_of(sink, "regression") == []
    finally:
        w.stop()


# -- the link rule ------------------------------------------------------------------------------------------------

def finding(job: str, window: int, confidence: float) -> codec.pa.Table:
    """One window's LINK_FAULT table: a slow link between ranks 0 and 1, found this confidently."""
    return codec.from_rows(S.LINK_FAULT, [dict(job_id=job, attempt=0, window_id=window, group="p2p", kind="link",
                                               src=0, dst=1, confidence=confidence, slowdown=3.0,
                                               evidence_json="{}")])


def test_a_link_threshold_change_alters_whether_the_next_finding_alerts_and_clearing_restores_it():
    """Configured: 0.5. A job's change to 0.8 silences its 0.6 finding (another job's still alerts); the
    fleet's change to 0.3 makes a 0.4 finding alert; cleared, the configured 0.5 judges again. (Findings from
    0.3 are shown, so 0.3 keeps the link thresholds' order.)"""
    w, clock, sink, controls = shard(alerts={"cooldown_s": 0.0, "link_shown_confidence": 0.3})
    try:
        assert w.alerts.rules.link_confidence_for("j1") == 0.5
        now_ns = clock.wall_ns()
        own = make_change("a", now_ns, "j1", {"alerts_link_confidence": 0.8})
        fleet = make_change("a", now_ns, None, {"alerts_link_confidence": 0.3})
        controls.records += [own.to_json(), fleet.to_json()]
        w.step(poll_timeout_ms=0)
        assert w.alerts.rules.link_confidence_for("j1") == 0.8  # the job's own beats the fleet's
        assert w.alerts.rules.link_confidence_for("j2") == 0.3
        w.alerts.add("link_fault", finding("j1", 0, 0.6))
        w.alerts.add("link_fault", finding("j2", 0, 0.6))
        w.alerts.add("link_fault", finding("j3", 0, 0.4))  # under the configured 0.5, over the fleet's 0.3
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert alerts_of(sink, "link") == ["j2", "j3"]

        controls.records += [make_change("a", clock.wall_ns(), "j1", {}, clears="*").to_json(),
                             make_change("a", clock.wall_ns(), None, {}, clears=fleet.change_id).to_json()]
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert w.alerts.rules.link_confidence_for("j1") == w.alerts.rules.link_confidence_for("j3") == 0.5
        w.alerts.add("link_fault", finding("j1", 10, 0.6))  # now over the configured 0.5: alerts
        w.alerts.add("link_fault", finding("j3", 10, 0.4))  # now under it: does not
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert alerts_of(sink, "link") == ["j1", "j2", "j3"]
        assert [a["alert_id"] for a in sink.rows["alert"] if a["job_id"] == "j3"] == ["j3/0/link/0"]
    finally:
        w.stop()


def test_a_link_threshold_change_that_runs_out_restores_the_configured_one():
    w, clock, sink, controls = shard()
    try:
        controls.records.append(make_change("a", clock.wall_ns(), None, {"alerts_link_confidence": 0.9},
                                            for_s=30).to_json())
        w.step(poll_timeout_ms=0)
        w.alerts.add("link_fault", finding("j1", 0, 0.6))
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert alerts_of(sink, "link") == []
        clock.t += 30
        w.step(poll_timeout_ms=0)
        assert w.alerts.rules.link_confidence_for("j1") == w.cfg.alerts.link_confidence
        w.alerts.add("link_fault", finding("j1", 10, 0.6))
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert alerts_of(sink, "link") == ["j1"]
    finally:
        w.stop()


# -- `control set --job` for a job the store has never registered -------------------------------------------------

class FakeStore:
    """The store as the check reads it: a jobs table of job ids, counted by the query's bound job id, and the
    newest windows of each (``windows``: job -> rows, newest first)."""

    def __init__(self, jobs, opened, windows=None):
        self.jobs, self.url, self.closed = set(jobs), "chdb:///fleet/store", False
        self.windows = windows or {}
        opened.append(self)

    def setup(self):
        pass

    def query(self, sql, params=None, limits=None):
        import pyarrow as pa

        assert "{job:String}" in sql, sql
        if sql.startswith("SELECT last_step, end_ns, step_time_actual FROM windows"):
            rows = self.windows.get(params["job"], [])
            return pa.table({k: [r[k] for r in rows] for k in ("last_step", "end_ns", "step_time_actual")})
        assert "FROM jobs" in sql, sql
        return pa.table({"n": pa.array([int(params["job"] in self.jobs)], pa.uint64())})

    def close(self):
        self.closed = True


@pytest.fixture
def cli(monkeypatch, capsys):
    """``main(["control", ...])`` against a fake store holding job j1 and a publish that records; nothing
    reaches a network (the unit tier fails a socket)."""
    import storage
    import actions.control as control
    from stragglerscope.cli import main

    published, opened = [], []
    monkeypatch.setenv("STRAGGLERSCOPE_KAFKA_BOOTSTRAP", "127.0.0.1:9")
    monkeypatch.setenv("STRAGGLERSCOPE_STORE", "chdb:///fleet/store")
    monkeypatch.setattr(control, "publish", lambda conn, change: published.append(change))
    monkeypatch.setattr(storage, "open_store", lambda url: FakeStore({"j1"}, opened))

    def run(*argv):
        rc = main(["control", *argv, "--who", "alice"])
        out, err = capsys.readouterr()
        return rc, out, err
    run.published, run.opened = published, opened
    return run


def test_a_change_for_a_registered_job_is_published(cli):
    rc, out, err = cli("set", "--job", "j1", "--regression-min-change", "0.05")
    assert rc == 0 and err == "" and "regression_min_change=0.05" in out
    [change] = cli.published
    assert change.job_id == "j1" and change.what == {"regression_min_change": 0.05}
    [store] = cli.opened
    assert store.closed


def test_a_change_for_a_job_starts_from_a_step_agreed_from_its_newest_window(cli, monkeypatch):
    """The publisher's side of the agreed step: the job's newest window (last step 1,000, ended 3 s ago, steps of
    0.5 s) puts the job at step 1,006 now; 5 s of lead and a tenth of the 3 s extrapolated are 11 steps more."""
    import time as _time

    import storage
    from core.control import agreed_from_step

    now = 1_700_000_000 * 10**9
    windows = {"j1": [dict(last_step=1000, end_ns=now - 3 * 10**9, step_time_actual=0.5),
                      dict(last_step=900, end_ns=now - 53 * 10**9, step_time_actual=0.5)]}
    monkeypatch.setattr(storage, "open_store", lambda url: FakeStore({"j1", "j-new"}, cli.opened, windows))
    monkeypatch.setattr(_time, "time_ns", lambda: now)
    rc, out, err = cli("set", "--job", "j1", "--sample", "1/1", "--for", "10m")
    assert rc == 0, err
    [change] = cli.published
    assert change.from_step == 1000 + 6 + 11 == agreed_from_step(1000, now - 3 * 10**9, 0.5, now, 50.0)
    assert "from step 1017" in out and check(change.to_json()) == change
    # a registered job with no window yet (just started), the fleet, and --force: no step, each rank's next end
    assert cli("set", "--job", "j-new", "--sample", "1/1")[0] == 0
    assert cli("set", "--fleet", "--sample", "1/1")[0] == 0
    assert cli("set", "--job", "j-soon", "--sample", "1/1", "--force")[0] == 0
    assert [c.from_step for c in cli.published[1:]] == [0, 0, 0]
    assert b"from_step" not in cli.published[1].to_json()  # as it was before the field: older readers take it
    # A threshold of the same job applies at the shard's next decision: no step to show for it.
    assert cli("set", "--job", "j1", "--hang-min-s", "30")[0] == 0
    assert cli.published[-1].from_step == 0 and "from step" not in cli("status")[1].split("hang_min_s")[-1][:40]


@pytest.mark.parametrize("args, want", [
    ((1000, -3, 0.5, 0.0), 1017),
    ((1000, 0, 60.0, 0.0), 1002),        # slow steps: at least two steps ahead
    ((1000, -200, 1.0, 100.0), 1000 + 200 + 25),  # 200 s since the window: 5 s + 20 s of lead
    ((1000, -1000, 1.0, 100.0), 0),      # the newest window ended 1,000 s ago: the job's step now is unknown
    ((1000, -1000, 1.0, 600.0), 2105),   # ... unless windows come that seldom (three periods: 1,800 s)
    ((-1, 0, 1.0, 0.0), 0), ((1000, 0, 0.0, 0.0), 0), ((1000, 0, float("nan"), 0.0), 0),
])
def test_the_agreed_step_from_a_window(args, want):
    from core.control import agreed_from_step

    now = 10**18
    last, ago_s, step_s, period = args
    assert agreed_from_step(last, now + ago_s * 10**9, step_s, now, period) == want


def test_a_change_for_a_job_the_store_never_registered_is_refused_unless_forced(cli):
    rc, out, err = cli("set", "--job", "j-typo", "--sample", "1/1")
    assert rc == 2 and out == "" and cli.published == []
    assert err.count("\n") == 1 and err.startswith("stragglerscope control: error: "), err
    assert "job 'j-typo' is not registered in the store chdb:///fleet/store" in err and "--force" in err
    assert cli.opened[0].closed

    rc, out, err = cli("set", "--job", "j-next", "--sample", "1/1", "--force")  # about to start
    assert rc == 0 and [c.job_id for c in cli.published] == ["j-next"]
    assert len(cli.opened) == 1  # --force: the store was not asked


def test_the_fleet_and_clear_need_no_registered_job_and_force_goes_with_set_job_only(cli):
    assert cli("set", "--fleet", "--alerts-link-confidence", "0.8")[0] == 0
    assert cli("clear", "--job", "j-typo")[0] == 0  # ending a change is always allowed
    assert cli.opened == [] and [c.scope for c in cli.published] == ["fleet", "job:j-typo"]
    for argv in (("set", "--fleet", "--sample", "1/1", "--force"), ("clear", "--job", "j1", "--force")):
        rc, _, err = cli(*argv)
        assert rc == 2 and "--force goes with set --job" in err and err.count("\n") == 1, err


def test_bad_input_is_refused_before_the_store_is_asked(cli):
    rc, _, err = cli("set", "--job", "j-typo", "--regression-k-windows", "0")
    assert rc == 2 and "regression_k_windows = 0.0 is out of range (1 to 100)" in err
    assert cli.opened == [] and cli.published == []


def test_a_store_that_cannot_be_read_refuses_the_change_and_says_force_skips_the_check(cli, monkeypatch):
    import storage
    from storage import StoreError

    def down(url):
        raise StoreError("cannot connect to 10.0.0.5:9000")
    monkeypatch.setattr(storage, "open_store", down)
    rc, _, err = cli("set", "--job", "j1", "--sample", "1/1")
    assert rc == 2 and err.count("\n") == 1 and cli.published == []
    assert "cannot check that job 'j1' is registered (cannot connect to 10.0.0.5:9000): give --force" in err


# -- the other alert rules: slowdown, fidelity, cool-down, link certainty ------------------------------------------

def window(job: str, slowdown: float, n_gpus: int = 64, window_id: int = 0, launch: float = 1.0) -> dict:
    """A WINDOW row as the alert rules read it (tests/unit/test_alerts.py's fields)."""
    return dict(job_id=job, attempt=0, window_id=window_id, slowdown=slowdown, waste_fraction=0.2,
                wasted_gpu_hours=1.0, n_gpus=n_gpus, verdict="worker", m_w=0.9, m_s=0.0, launch_slowdown=launch,
                note="")


def rules_of(w, job: str, row: dict) -> list[str]:
    return [a["rule"] for a in w.alerts.rules.evaluate_window(row, 0.0, 0)]


def test_a_slowdown_threshold_change_alters_the_next_window_alert_and_clearing_restores_it():
    """Configured: S >= 1.1 on 8 GPUs or more. The fleet's change asks S >= 1.5; j2's own S >= 1.05 from 4 GPUs
    and a fidelity tolerance of 0.5. Cleared, the configured thresholds judge again."""
    w, clock, sink, controls = shard(alerts={"cooldown_s": 0.0})
    try:
        now_ns = clock.wall_ns()
        fleet = make_change("a", now_ns, None, {"alerts_slowdown_threshold": 1.5})
        own = make_change("a", now_ns, "j2", {"alerts_slowdown_threshold": 1.05, "alerts_min_gpus": 4,
                                              "alerts_fidelity_tolerance": 0.5})
        controls.records += [fleet.to_json(), own.to_json()]
        w.step(poll_timeout_ms=0)
        assert rules_of(w, "j1", window("j1", 1.3)) == []                     # under the fleet's 1.5
        assert rules_of(w, "j1", window("j1", 1.6)) == ["slowdown"]
        assert rules_of(w, "j2", window("j2", 1.08, n_gpus=4, launch=1.2)) == ["slowdown"]  # its own
        assert rules_of(w, "j3", window("j3", 1.6, launch=1.2)) == ["slowdown", "fidelity"]

        controls.records.append(make_change("a", clock.wall_ns(), None, {}, clears="*").to_json())
        controls.records.append(make_change("a", clock.wall_ns(), "j2", {}, clears=own.change_id).to_json())
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert w.alerts.rules.params_for("j2") == w.alerts.rules.params == w.cfg.alerts
        assert rules_of(w, "j1", window("j1", 1.3)) == ["slowdown"]
        assert rules_of(w, "j2", window("j2", 1.08, n_gpus=4, launch=1.2)) == ["fidelity"]
        assert rules_of(w, "j2", window("j2", 1.3, n_gpus=4)) == []           # under the configured 8 GPUs
    finally:
        w.stop()


def test_a_cooldown_change_alters_whether_the_next_alert_goes_out_and_clearing_restores_it():
    """Configured: 600 s. j1's own change of 0 lets every alert out; the fleet's 30 s lets j2's second alert
    out 31 s after its first. Cleared, 600 s holds both back again."""
    w, clock, sink, controls = shard()
    try:
        rules = w.alerts.rules
        assert rules_of(w, "j1", window("j1", 1.3)) == rules_of(w, "j2", window("j2", 1.3)) == ["slowdown"]
        assert rules.evaluate_window(window("j1", 1.3, window_id=1), 1.0, 0) == []  # cooling down
        now_ns = clock.wall_ns()
        controls.records += [make_change("a", now_ns, "j1", {"alerts_cooldown_s": 0}).to_json(),
                             make_change("a", now_ns, None, {"alerts_cooldown_s": 30}).to_json()]
        w.step(poll_timeout_ms=0)
        assert len(rules.evaluate_window(window("j1", 1.3, window_id=2), 2.0, 0)) == 1
        assert len(rules.evaluate_window(window("j1", 1.3, window_id=3), 2.0, 0)) == 1
        assert rules.evaluate_window(window("j2", 1.3, window_id=1), 29.0, 0) == []
        assert len(rules.evaluate_window(window("j2", 1.3, window_id=2), 31.0, 0)) == 1

        controls.records += [make_change("a", clock.wall_ns(), "j1", {}, clears="*").to_json(),
                             make_change("a", clock.wall_ns(), None, {}, clears="*").to_json()]
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert rules.params_for("j1").cooldown_s == rules.params_for("j2").cooldown_s == 600
        assert rules.evaluate_window(window("j1", 1.3, window_id=4), 100.0, 0) == []
        assert rules.evaluate_window(window("j2", 1.3, window_id=3), 100.0, 0) == []
    finally:
        w.stop()


def test_a_link_certain_change_alters_the_next_link_alerts_severity_and_clearing_restores_it():
    """Configured: critical from 0.9 (on one window). j1's own change to 0.7 makes its 0.75 finding critical;
    j2's stays a warning; cleared, j1's next 0.75 finding (another element) is a warning again."""
    w, clock, sink, controls = shard(alerts={"cooldown_s": 0.0})
    try:
        own = make_change("a", clock.wall_ns(), "j1", {"alerts_link_certain": 0.7})
        controls.records.append(own.to_json())
        w.step(poll_timeout_ms=0)
        w.alerts.add("link_fault", finding("j1", 0, 0.75))
        w.alerts.add("link_fault", finding("j2", 0, 0.75))
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert {a["job_id"]: a["severity"] for a in sink.rows["alert"]} == {"j1": "critical", "j2": "warning"}

        controls.records.append(make_change("a", clock.wall_ns(), "j1", {}, clears=own.change_id).to_json())
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert w.alerts.rules.params_for("j1").link_certain == w.cfg.alerts.link_certain
        w.alerts.add("link_fault", finding("j1", 10, 0.75))
        clock.t += 1
        w.step(poll_timeout_ms=0)
        assert [a["severity"] for a in sink.rows["alert"] if a["job_id"] == "j1"] == ["critical", "warning"]
    finally:
        w.stop()


# -- the link thresholds keep the configured order --------------------------------------------------------------

def test_keep_link_order_refuses_a_scope_out_of_order_with_one_line_each():
    from core.config import AlertConfig
    from core.control import keep_link_order, link_order_problem

    configured = AlertConfig(link_shown_confidence=0.4, link_confidence=0.5, link_certain=0.9)
    assert link_order_problem({}, configured) == ""
    assert link_order_problem({"alerts_link_confidence": 0.4, "alerts_link_certain": 0.4}, configured) == ""
    assert "alerts.link_shown_confidence (0.4, configured) <= alerts_link_confidence (0.3)" in \
        link_order_problem({"alerts_link_confidence": 0.3}, configured)
    fleet = {"alerts_link_confidence": 0.95, "hang_min_s": 30}  # over the configured certain 0.9
    jobs = {"j1": {"alerts_link_confidence": 0.95, "alerts_link_certain": 0.99},  # in order on its own
            "j2": {"alerts_link_certain": 0.45, "hang_min_s": 60},             # under the configured confidence
            "j3": {"hang_min_s": 90}}  # no link values of its own: the fleet's refused one is not its problem
    fleet2, jobs2, problems = keep_link_order(fleet, jobs, configured)
    assert fleet2 == {"hang_min_s": 30}
    assert jobs2 == {"j1": {**jobs["j1"], "hang_min_s": 30}, "j2": {"hang_min_s": 60}, "j3": {"hang_min_s": 90}}
    assert len(problems) == 2 and all("\n" not in p for p in problems)
    assert problems[0].startswith("fleet: link thresholds out of order") and "configured link thresholds" in \
        problems[0]
    assert problems[1].startswith("job:j2: ") and "alerts_link_certain (0.45)" in problems[1]


def test_a_change_that_breaks_the_link_order_is_refused_and_one_that_ends_under_it_falls_back(caplog):
    """The shard applies the link values in force only in the configured order: the fleet's confidence of 0.95
    over the configured certain of 0.9 is refused (said once); j1's confidence of 0.95 is taken while the fleet's
    certain is 0.99, and falls back to the configured ones when that change runs out."""
    import logging

    w, clock, sink, controls = shard()
    try:
        with caplog.at_level(logging.WARNING, logger="ray_jobs.shard"):
            controls.records.append(make_change("a", clock.wall_ns(), None,
                                                {"alerts_link_confidence": 0.95, "alerts_cooldown_s": 5}).to_json())
            w.step(poll_timeout_ms=0)
            assert w.alerts.rules.link_confidence_for("j1") == 0.5  # refused: the configured value
            assert w.alerts.rules.params.cooldown_s == 5            # the rest of the change is applied
            assert w.stats.control_refused == 1
            [line] = [r.getMessage() for r in caplog.records if "control refused" in r.getMessage()]
            assert "fleet: link thresholds out of order" in line and "alerts_link_confidence (0.95)" in line
            controls.records.append(make_change("a", clock.wall_ns(), None, {}, clears="*").to_json())
            clock.t += 1
            w.step(poll_timeout_ms=0)

            controls.records += [
                make_change("a", clock.wall_ns(), None, {"alerts_link_certain": 0.99}, for_s=60).to_json(),
                make_change("a", clock.wall_ns(), "j1", {"alerts_link_confidence": 0.95}).to_json()]
            clock.t += 1
            w.step(poll_timeout_ms=0)
            assert (w.alerts.rules.link_confidence_for("j1"), w.alerts.rules.params_for("j1").link_certain) == \
                (0.95, 0.99)
            assert w.stats.control_refused == 1
            clock.t += 60  # the fleet's certain of 0.99 runs out: 0.95 over the configured 0.9
            w.step(poll_timeout_ms=0)
            assert w.alerts.rules.params_for("j1") == w.cfg.alerts
            assert w.stats.control_refused == 2
            w.step(poll_timeout_ms=0)
            assert w.stats.control_refused == 2  # said once while it lasts
    finally:
        w.stop()


# -- the lemon-host rule (the driver's, fleet-wide only) -----------------------------------------------------------

class StubStore:
    """What a lemon pass writes: its LEMON_HOST rows and the alerts, by table."""

    def __init__(self):
        self.rows: dict[str, list[dict]] = {}

    def insert(self, table, data):
        self.rows.setdefault(table, []).extend(data.to_pylist())


def lemon_watch(controls):
    """A LemonWatch over fixed implications (its store's queries stubbed at ``incidents``): host 'bad' implicated
    by 4 jobs in 10 GPU-hours, ten hosts by one job each in 1000 GPU-hours each. Configured: min_jobs 3,
    max_p 1e-3, so 'bad' is a lemon (about 2e-9 by chance)."""
    from analyzers.lemons import Incident
    from core.config import LemonConfig
    from ray_jobs.lemon_watch import LemonWatch

    incidents = [Incident("bad", f"j{i}", 0, i, "worker", "window 0") for i in range(4)]
    incidents += [Incident(f"ok{i}", f"k{i}", 0, i, "worker", "window 0") for i in range(10)]
    exposure = {"bad": 10.0, **{f"ok{i}": 1000.0 for i in range(10)}}

    class Watch(LemonWatch):
        def incidents(self, since, until):
            return incidents, exposure
    return Watch(StubStore(), LemonConfig(min_jobs=3, max_p=1e-3), controls=controls)


def lemons_of(scores) -> list[str]:
    return [s.host for s in scores if s.lemon]


@pytest.mark.parametrize("what, why", [
    ({"lemons_min_jobs": 0}, "lemons_min_jobs = 0 is out of range"),
    ({"lemons_min_jobs": 3.5}, "lemons_min_jobs must be a whole number"),
    ({"lemons_max_p": 0}, "lemons_max_p = 0 is out of range"),
    ({"lemons_max_p": 2}, "lemons_max_p = 2 is out of range"),
])
def test_lemon_thresholds_out_of_range_are_refused_with_their_reason(what, why):
    with pytest.raises(ControlError) as e:
        make_change("a", 10**18, None, what)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_a_lemon_threshold_for_one_job_is_refused_with_its_reason():
    for what in ({"lemons_min_jobs": 4}, {"lemons_max_p": 0.01, "alerts_cooldown_s": 60}):
        record = dict(change_id="c1", who="alice", when=10**18, scope="job:j1", what=what)
        with pytest.raises(ControlError) as e:
            check(json.dumps(record))
        assert "is for the fleet only (lemon hosts are scored across every job" in str(e.value)
        assert "give --fleet" in str(e.value) and "\n" not in str(e.value)
    from core.control import lemon_overrides
    assert lemon_overrides(make_change("a", 10**18, None, {"lemons_min_jobs": "5"}).what) == {"min_jobs": 5}


def test_a_lemon_threshold_change_alters_the_next_pass_and_clearing_restores_the_configured_one():
    """The fleet's min_jobs of 5 (then max_p of 1e-12) leaves 'bad' no lemon at the next pass; cleared, the
    configured thresholds make it one, and its alert goes out. A record the watch refuses changes nothing."""
    controls = FakeControls()
    watch = lemon_watch(controls)
    now = 10**18
    assert lemons_of(lemon_watch(None).score(now)) == ["bad"]  # configured

    change = make_change("a", now, None, {"lemons_min_jobs": 5})
    controls.records += [change.to_json(), b'{"not": "a change"}']
    assert lemons_of(watch.score(now + 1)) == []
    assert watch.params.min_jobs == 5 and watch.book.refused
    assert "alert" not in watch.store.rows

    controls.records += [make_change("a", now + 2, None, {}, clears=change.change_id).to_json(),
                         make_change("a", now + 2, None, {"lemons_max_p": 1e-12}, for_s=60).to_json()]
    assert lemons_of(watch.score(now + 3)) == []  # about 2e-9: not unlikely enough for 1e-12
    assert (watch.params.min_jobs, watch.params.max_p) == (3, 1e-12)

    assert lemons_of(watch.score(now + 61 * 10**9)) == ["bad"]  # the change ran out: configured again
    assert watch.params == watch.base_params
    assert [a["rule"] for a in watch.store.rows["alert"]] == ["lemon_host"]


def test_the_fleets_alert_cooldown_applies_to_lemon_alerts_and_without_a_control_topic_nothing_changes():
    controls = FakeControls()
    watch = lemon_watch(controls)
    controls.records.append(make_change("a", 10**18, None, {"alerts_cooldown_s": 5}).to_json())
    watch.score(10**18)
    assert watch.alerts.rules.params_for("host/bad").cooldown_s == 5
    plain = lemon_watch(None)
    assert lemons_of(plain.score(10**18)) == ["bad"] and plain.params == plain.base_params


def test_the_cli_refuses_a_lemon_threshold_for_one_job_and_takes_it_for_the_fleet(cli):
    rc, out, err = cli("set", "--job", "j1", "--lemons-min-jobs", "5")
    assert rc == 2 and out == "" and cli.published == [] and cli.opened == []  # refused before the store is asked
    assert err.count("\n") == 1 and "lemons_min_jobs is for the fleet only" in err and "give --fleet" in err
    rc, out, err = cli("set", "--fleet", "--lemons-min-jobs", "5", "--lemons-max-p", "1e-4", "--for", "1h")
    assert rc == 0 and err == "" and "lemons_max_p=0.0001, lemons_min_jobs=5" in out
    [change] = cli.published
    assert change.scope == "fleet" and change.what == {"lemons_min_jobs": 5, "lemons_max_p": 1e-4}
