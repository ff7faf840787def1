"""Fleet accounting: MFU on known numbers, downtime per C4 category against exact ground truth."""
from __future__ import annotations

import math
import random

import numpy as np
import pyarrow as pa
import pytest

from analyzers.downtime import DowntimeAccountant, Signal, account_downtime, to_tables
from analyzers.mfu import flops_per_step, peak_flops, window_mfu
from core import codec, jsonutil
from core import schema as S
from core.layout import JobLayout
from generators.downtimegen import generate_downtime_fleet

NS = 1_000_000_000
CATS = ("detect", "diagnose", "isolate", "lost_progress", "reinit", "total")


# --------------------------------------------------------------------------
# MFU
# --------------------------------------------------------------------------
REG = dict(n_gpus=512, gpu_type="H100", peak_flops=989e12, flops_per_token=0.0, tokens_per_step=4 << 20,
           params=7_000_000_000, seq_len=4096)


def test_mfu_is_6_params_tokens_over_step_time_gpus_and_peak():
    want = 6 * 7e9 * (4 << 20) / (1.0 * 512 * 989e12)
    mfu, ideal = window_mfu(REG, 3, 1.0, 0.8)
    assert mfu == pytest.approx(want, rel=1e-12)
    assert ideal == pytest.approx(want / 0.8, rel=1e-12)
    assert 0.3 < mfu < 0.4  # a 7B model at 1 s per 4M-token step on 512 H100: a plausible MFU


def test_mfu_over_per_step_times_is_total_flops_over_total_time():
    actual, ideal = [9.0, 11.0, float("nan"), 10.0], [8.0, 8.0, 8.0, 8.0]
    mfu, mfu_ideal = window_mfu(REG, [0, 1, 2, 3], actual, ideal)
    per_step = flops_per_step(REG) / (512 * 989e12)
    assert mfu == pytest.approx(3 * per_step / 30.0)  # the NaN step is left out
    assert mfu_ideal == pytest.approx(per_step / 8.0)


@pytest.mark.parametrize("change, fps, peak", [
    ({}, 6 * 7e9 * (4 << 20), 989e12),
    ({"flops_per_token": 5e10}, 5e10 * (4 << 20), 989e12),  # registered FLOPs per token win over 6 x params
    ({"peak_flops": 0.0, "gpu_type": "NVIDIA A100"}, 6 * 7e9 * (4 << 20), 312e12),  # peak from the GPU type
    ({"peak_flops": 0.0, "gpu_type": "h100-80gb"}, 6 * 7e9 * (4 << 20), 989e12),
    ({"params": 0}, 0.0, 989e12),
    ({"tokens_per_step": 0}, 0.0, 989e12),
    ({"peak_flops": 0.0, "gpu_type": "MI300X"}, 6 * 7e9 * (4 << 20), 0.0),
])
def test_flops_and_peak_from_the_registration(change, fps, peak):
    reg = dict(REG, **change)
    assert flops_per_step(reg) == pytest.approx(fps)
    assert peak_flops(reg) == pytest.approx(peak)
    mfu, ideal = window_mfu(reg, 2, 10.0, 9.0)
    assert math.isnan(mfu) == (fps == 0 or peak == 0) and math.isnan(ideal) == math.isnan(mfu)


def test_analyzed_window_carries_mfu_at_actual_and_ideal_step_times():
    from core.registration import Registration
    from generators.fleetgen import JobSpec, generate_window
    from analyzers.window import analyze_window

    spec = JobSpec("mfu-job", JobLayout(dp_size=2, pp_size=2), num_microbatches=4, cause="slow_worker", cause_dp=1,
                   cause_pp=0, cause_factor=1.5)
    ops = generate_window(spec, 0, 3, 10**18)
    info = Registration("mfu-job", 0, spec.layout, 3, n_gpus=4)
    row = analyze_window(ops, info, ("mfu-job", 0, 0), True, "")["window"].to_pylist()[0]
    assert math.isnan(row["mfu"]) and math.isnan(row["mfu_ideal"])  # no FLOPs info: NaN, not a made-up figure
    info.registration = dict(REG, n_gpus=4)
    row = analyze_window(ops, info, ("mfu-job", 0, 0), True, "")["window"].to_pylist()[0]
    per_step = flops_per_step(REG) / (4 * 989e12)
    assert row["mfu"] == pytest.approx(per_step / row["step_time_actual"], rel=1e-9)
    assert row["mfu_ideal"] == pytest.approx(per_step / row["step_time_ideal"], rel=1e-9)
    assert row["mfu_ideal"] > row["mfu"]  # the straggler costs utilisation


# --------------------------------------------------------------------------
# Downtime on generated fleets: accounted vs exact truth
# --------------------------------------------------------------------------
def totals(rows) -> dict[str, float]:
    out = {}
    for c in CATS:
        out[f"{c}_s"] = sum(r[f"{c}_s"] for r in rows)
        out[f"{c}_gpu_hours"] = sum(r[f"{c}_gpu_hours"] for r in rows)
    return out


@pytest.fixture(scope="module", params=[0, 1])
def fleet(request):
    return generate_downtime_fleet(n_jobs=12, days=7.0, seed=request.param)


@pytest.fixture(scope="module")
def accounted(fleet):
    return account_downtime(fleet.tables())


def test_generated_fleet_has_every_kind_of_incident(fleet):
    kinds = {(t["kind"], t["restart_ns"] < 0) for t in fleet.truth}
    assert {("hang", False), ("node_loss", False), ("restart", False), ("hang", True)} <= kinds
    assert any(t["diagnose_s"] > 0 for t in fleet.truth) and any(t["diagnose_s"] == 0 for t in fleet.truth)
    assert any(t["restart_attempt"] - t["attempt"] >= 2 for t in fleet.truth), "a re-init that failed"
    assert all(t["lost_steps"] >= 0 for t in fleet.truth) and any(t["lost_steps"] > 0 for t in fleet.truth)


def test_accounted_hours_per_category_match_the_truth_within_1pct(fleet, accounted):
    assert len(accounted) == len(fleet.truth)
    got, want = totals(accounted), totals(fleet.truth)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=0.01), key
    assert want["total_gpu_hours"] > 1000  # a week of a fleet with faults: a real bill


def test_each_incident_is_found_with_its_stamps(fleet, accounted):
    truth = {(t["job_id"], t["fault_start_ns"]): t for t in fleet.truth}
    for r in accounted:
        t = truth[(r["job_id"], r["fault_start_ns"])]
        for k in ("attempt", "kind", "alert_ns", "diagnosed_ns", "restart_ns", "restart_attempt", "fault_step",
                  "last_checkpoint_step", "lost_steps", "n_gpus"):
            assert r[k] == t[k], (k, r, t)
        assert r["closed"]
        for c in CATS:
            assert r[f"{c}_s"] == pytest.approx(t[f"{c}_s"], rel=0.01, abs=1.0), (c, r, t)


def test_streaming_emits_the_batch_rows_as_incidents_close(fleet, accounted):
    acc = DowntimeAccountant(lateness_s=300)
    rng = random.Random(7)
    rows = []
    for end, tables in fleet.chunks(3600):
        pieces = [t.slice(i, 500) for t in tables for i in range(0, t.num_rows, 500)]
        rng.shuffle(pieces)  # topics arrive interleaved, each in pieces
        for p in pieces:
            acc.add(p)
        rows += acc.emit(end)
    emitted = len(rows)
    rows += acc.finish()
    assert emitted == len(accounted), "every incident closes within the week: emitted as it closed"
    key = lambda r: (r["job_id"], r["incident_id"])  # noqa: E731
    assert _same(sorted(rows, key=key), sorted(accounted, key=key))
    assert acc.stats.late_records == 0 and acc.stats.bad_records == 0


def _same(a: list[dict], b: list[dict]) -> bool:
    def eq(x, y):
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
    return len(a) == len(b) and all(x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_downtime_rows_round_trip_the_schema(accounted):
    t = to_tables(accounted)["downtime"]
    assert t.num_rows == len(accounted)
    kind, back = codec.decode(codec.encode(t))
    assert kind == "downtime" and back.equals(t)


# --------------------------------------------------------------------------
# Downtime on hand-made timelines: each definition on exact numbers
# --------------------------------------------------------------------------
class Timeline:
    """One job: steps of 10 s, a save after step 9 (20 s), heartbeats every 5 s."""

    def __init__(self, job="j", n_gpus=16, legacy=False):
        self.job, self.n_gpus, self.legacy = job, n_gpus, legacy
        self.tables: list[pa.Table] = []

    def register(self, attempt, ts):
        self.tables.append(codec.from_rows(S.JOB, [dict(
            job_id=self.job, attempt=attempt, ts_ns=ts * NS, team="t", model="m", n_gpus=self.n_gpus, dp_size=2,
            pp_size=8, tp_size=1, cp_size=1, vpp_size=1, num_microbatches=4, profiled_steps=10, gpu_type="H100",
            peak_flops=989e12, flops_per_token=0.0, tokens_per_step=0)]))

    def ckpt(self, attempt, step, ts, dur, kind="save", rank=0):
        self.tables.append(codec.from_rows(S.CHECKPOINT, [dict(job_id=self.job, attempt=attempt, rank=rank, step=step,
                                                               ts_ns=ts * NS, duration_ns=dur * NS, kind=kind)]))

    def run(self, attempt, ends: dict[int, float], hb_from, hb_to):
        steps = np.array(sorted(ends) or [-1], np.int64)
        e = np.array([ends[s] for s in sorted(ends)] or [np.inf]) * NS
        ts = np.arange(hb_from * NS, hb_to * NS, 5 * NS)
        k = np.searchsorted(e, ts, side="right") - 1
        done = np.where(k >= 0, steps[np.maximum(k, 0)], -1)
        done_ns = np.where(k >= 0, e[np.maximum(k, 0)], -1).astype(np.int64)
        rows = [dict(job_id=self.job, attempt=attempt, rank=0, host="h0", pid=1, ts_ns=int(t), step=int(d) + 1,
                     last_op="optimizer" if d >= 0 else "", last_op_end_ns=int(dn), inflight_op="",
                     inflight_group="", inflight_seq=-1, inflight_since_ns=-1, clock_offset_ns=0, stack="",
                     **({} if self.legacy else dict(step_done=int(d), step_done_ns=int(dn))))
                for t, d, dn in zip(ts, done, done_ns)]
        self.tables.append(codec.from_rows(S.HEARTBEAT, rows))

    def hang(self, attempt, ts, kind="comm_hang", missing="3", stuck="0-2,4-15", hosts="h0", evidence=None):
        self.tables.append(codec.from_rows(S.HANG, [dict(
            job_id=self.job, attempt=attempt, hang_id=ts * NS, kind=kind, group="", seq=-1, op="", stuck_ranks=stuck,
            missing_ranks=missing, suspect_hosts=hosts, since_ns=0, duration_s=0.0,
            evidence_json=jsonutil.dumps(evidence or {}))]))

    def alert(self, attempt, ts, rule="hang", **details):
        self.tables.append(codec.from_rows(S.ALERT, [dict(
            alert_id=f"{self.job}/{attempt}/{rule}/{ts}", job_id=self.job, attempt=attempt, ts_ns=ts * NS, rule=rule,
            severity="critical", summary="", details_json=jsonutil.dumps(details))]))


def first_attempt(tl: Timeline, last_step=14, hb_to=990):
    """Attempt 0: registered at 0, steps 0-9 end at 110..200, save of step 9 (200 -> 220), steps 10.. end at
    230, 240, ...: the fault leaves step ``last_step`` (270 for 14) as the last progress."""
    tl.register(0, 0)
    ends = {s: 110 + 10 * s for s in range(10)}
    ends.update({s: 230 + 10 * (s - 10) for s in range(10, last_step + 1)})
    tl.ckpt(0, 9, 200, 20)
    tl.run(0, ends, 1, hb_to)


def restarted(tl: Timeline, attempt=1, reg=1000, load=True, first_start=1100, n=20, first_step=10):
    """The next attempt: registered at ``reg``, loads step 9, runs ``first_step``.. from ``first_start``."""
    tl.register(attempt, reg)
    if load:
        tl.ckpt(attempt, 9, 1030, 60, kind="load")
    tl.run(attempt, {first_step + i: first_start + 10 * (i + 1) for i in range(n)}, reg + 1,
           first_start + 10 * n + 30)


def _one(tables, **kw):
    rows = account_downtime(tables, **kw)
    assert len(rows) == 1, rows
    return rows[0]


def test_hang_named_at_once_then_restart_from_the_checkpoint():
    tl = Timeline()
    first_attempt(tl)
    tl.hang(0, 400)
    tl.alert(0, 401, missing_ranks="3", kind="comm_hang")
    restarted(tl)
    r = _one(tl.tables)
    assert (r["kind"], r["fault_step"], r["last_checkpoint_step"], r["lost_steps"]) == ("hang", 14, 9, 5)
    assert r["step_time_s"] == pytest.approx(10.0)  # the save's 20 s stall is not a step
    assert (r["fault_start_ns"], r["alert_ns"], r["diagnosed_ns"], r["restart_ns"]) == (270 * NS, 400 * NS,
                                                                                        400 * NS, 1000 * NS)
    assert r["first_step_ns"] == 1110 * NS
    want = dict(detect_s=130, diagnose_s=0, isolate_s=600, lost_progress_s=50, reinit_s=100, total_s=880)
    assert {k: r[k] for k in want} == pytest.approx(want)
    assert r["total_gpu_hours"] == pytest.approx(880 * 16 / 3600)
    assert r["closed"] and r["note"] == ""


def test_diagnosis_lasts_until_a_row_names_the_culprit():
    tl = Timeline()
    first_attempt(tl)
    tl.hang(0, 400, kind="noncomm_hang", missing="", stuck="0-15", hosts="h0,h1")  # every rank: nobody named
    tl.alert(0, 400, kind="noncomm_hang", stuck_ranks="0-15")
    tl.hang(0, 700, kind="noncomm_hang", missing="", stuck="5", hosts="h0")
    restarted(tl)
    r = _one(tl.tables)
    assert (r["diagnosed_ns"], r["diagnose_s"], r["isolate_s"]) == (700 * NS, 300, 300)


def test_a_crash_without_alert_is_detected_by_its_restart():
    tl = Timeline()
    first_attempt(tl, hb_to=272)  # the process exits; its close() sent a last heartbeat
    restarted(tl)
    r = _one(tl.tables)
    assert r["kind"] == "restart" and r["alert_ns"] == -1 and r["diagnosed_ns"] == -1
    assert (r["detect_s"], r["diagnose_s"], r["isolate_s"], r["reinit_s"]) == pytest.approx((730, 0, 0, 100))


def test_node_loss_without_checkpoint_redoes_every_step_and_a_failed_reinit_is_reinit():
    tl = Timeline()
    tl.register(0, 0)
    tl.run(0, {s: 110 + 10 * s for s in range(15)}, 1, 990)
    tl.hang(0, 400, kind="node_loss", missing="8-15", stuck="0-7", hosts="h1")
    tl.register(1, 1000)  # dies during start-up
    tl.run(1, {}, 1001, 1100)
    restarted(tl, attempt=2, reg=1200, load=False, first_start=1300, first_step=0)  # from scratch
    r = _one(tl.tables)
    assert (r["kind"], r["last_checkpoint_step"], r["lost_steps"], r["restart_attempt"]) == ("node_loss", -1, 15, 2)
    assert r["lost_progress_s"] == pytest.approx(150)
    assert r["reinit_s"] == pytest.approx(300)  # from the first restart (1000) to the first step (1300)
    assert "never completed a step" in r["note"]


PLAN = {"action": "restart on the 1 surviving node as DP 1 x PP 1", "n_nodes": 2, "nodes_alive": 1,
        "step_time_before_loss_s": 1.0, "step_time_after_s": 2.0, "throughput_vs_before": 0.5}


@pytest.mark.parametrize("via", ["hang", "alert"])
def test_a_node_loss_incident_carries_its_recovery_plan(via):
    """Issue 54: the plan made when the loss was found (``ray_jobs.hang_monitor``) is on the incident row too,
    from the HANG row or, where only the alert was seen, from the alert's details."""
    tl = Timeline()
    first_attempt(tl)
    if via == "hang":
        tl.hang(0, 400, kind="node_loss", missing="8-15", stuck="", hosts="h1", evidence={"recovery_plan": PLAN})
    else:
        tl.alert(0, 400, rule="node_loss", kind="node_loss", missing_ranks="8-15", recovery_plan=PLAN)
    restarted(tl)
    r = _one(tl.tables)
    assert r["kind"] == "node_loss"
    assert r["recovery_plan"] == ("restart on the 1 surviving node as DP 1 x PP 1; predicted 2 s per step, 0.50 of "
                                  "the throughput before the loss"), r["recovery_plan"]


def test_an_incident_without_a_plan_says_nothing_of_one():
    tl = Timeline()
    first_attempt(tl)
    tl.hang(0, 400, kind="node_loss", missing="8-15", stuck="", hosts="h1",
            evidence={"recovery_plan_missing": "no window of this job was analysed whole before the loss"})
    restarted(tl)
    assert _one(tl.tables)["recovery_plan"] == ""


def test_a_hang_that_clears_costs_its_stall_and_no_progress():
    tl = Timeline()
    tl.register(0, 0)
    ends = {s: 110 + 10 * s for s in range(15)}  # step 14 ends at 250, then a 500 s stall
    ends.update({s: 760 + 10 * (s - 15) for s in range(15, 40)})  # step 15 runs from 750
    tl.run(0, ends, 1, 1000)
    tl.hang(0, 400)
    r = _one(tl.tables)
    assert r["restart_ns"] == -1 and r["lost_steps"] == 0
    assert (r["detect_s"], r["isolate_s"], r["reinit_s"], r["total_s"]) == pytest.approx((150, 350, 0, 500))


def test_open_incident_is_clipped_at_the_end_of_the_stream():
    tl = Timeline()
    first_attempt(tl)
    tl.hang(0, 400)
    acc = DowntimeAccountant()
    for t in tl.tables:
        acc.add(t)
    assert acc.emit(5000 * NS) == []  # not closed: nothing to emit yet
    (r,) = acc.finish(end_ns=900 * NS)
    assert not r["closed"] and "open" in r["note"]
    assert (r["detect_s"], r["isolate_s"], r["lost_steps"]) == pytest.approx((130, 500, 5))


def test_a_job_silent_for_keep_s_is_forgotten_with_its_open_incident():
    tl = Timeline()
    first_attempt(tl)  # heartbeats until 990 s
    tl.hang(0, 400)
    acc = DowntimeAccountant(keep_s=3600)
    for t in tl.tables:
        acc.add(t)
    assert acc.emit(4000 * NS) == []
    (r,) = acc.emit(4600 * NS)
    assert not r["closed"] and r["isolate_s"] == pytest.approx(986 - 400)  # clipped at its last heartbeat
    assert not acc.jobs and acc.finish() == []


def test_heartbeats_from_before_step_done_still_give_progress():
    tl = Timeline(legacy=True)
    first_attempt(tl)
    tl.hang(0, 400)
    restarted(tl)
    assert "step_done" not in tl.tables[2].column_names or tl.tables[2]["step_done"].to_pylist()[0] == -1
    r = _one(tl.tables)
    assert (r["fault_step"], r["lost_steps"], r["total_s"]) == (14, 5, pytest.approx(880))


def test_evidence_after_an_emitted_incident_is_late_and_counted():
    tl = Timeline()
    first_attempt(tl)
    tl.hang(0, 400)
    restarted(tl)
    acc = DowntimeAccountant(lateness_s=60)
    for t in tl.tables:
        acc.add(t)
    (r,) = acc.emit(2000 * NS)
    late = Timeline()
    late.hang(0, 500)
    late.run(0, {14: 270}, 980, 990)
    acc.add(late.tables[0])
    acc.add(late.tables[1])
    assert acc.stats.late_records == 3  # the hang row and both heartbeats
    assert acc.finish() == []


def test_bad_checkpoint_records_are_counted_not_used():
    t = codec.from_rows(S.CHECKPOINT, [
        dict(job_id="j", attempt=0, rank=0, step=-4, ts_ns=1, duration_ns=1, kind="save"),
        dict(job_id="j", attempt=0, rank=0, step=3, ts_ns=1, duration_ns=1, kind="copy")])
    acc = DowntimeAccountant()
    acc.add(t)
    assert acc.stats.bad_records == 2 and not acc.jobs


def test_a_hang_and_the_alert_raised_from_it_are_the_same_typed_signal():
    """The accountant reads typed ``Signal``s; a HANG row and the shard's alert about it give the same one."""
    from core.config import AlertConfig
    from ray_jobs.alerts import AlertRules

    hang = dict(job_id="j", attempt=0, hang_id=5 * NS, kind="noncomm_hang", group="dp0", seq=7, op="all_reduce",
                stuck_ranks="0-2", missing_ranks="3", suspect_hosts="h1,h2", since_ns=NS, duration_s=4.0,
                evidence_json="{}")
    alert, = AlertRules(AlertConfig()).evaluate_hang(hang, now=0.0, now_ns=6 * NS)
    from_hang, from_alert = Signal.from_hang(hang), Signal.from_alert(alert)
    assert (from_hang.kind, from_hang.n_stuck, from_hang.n_missing, from_hang.n_hosts) == ("noncomm_hang", 3, 1, 2)
    assert from_alert == Signal(6 * NS, "noncomm_hang", 1, 3, 2), "the alert's time, the hang's evidence"
    assert from_hang.names_culprit(n_gpus=4) and from_alert.names_culprit(n_gpus=4)
    assert Signal.from_alert(dict(alert, rule="link")) is None, "only hang and node-loss alerts are faults"
    odd = Signal.from_alert(dict(alert, details_json="[1, 2]"))  # valid JSON, not an object
    assert odd == Signal(6 * NS, "hang", 0, 0, 0)
