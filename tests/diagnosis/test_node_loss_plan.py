"""Every node loss is paged with its recovery plan (issue 54): the restart on the nodes left, made from the job's
last window analysed whole, with its predicted step time and throughput.

A generated 512-GPU job (DP 8 x PP 8 x TP 8 on 8-GPU hosts: 64 hosts, one stage per host) is analysed as the
shard analyses it; the window's recovery basis goes to the hang monitor, as the shard wires it; one host falls
silent while the others report.
"""
from __future__ import annotations

import json

import pytest

from analyzers.window import analyze_window_for_shard
from core import codec
from core import schema as S
from core.layout import JobLayout
from core.registration import Registration
from generators.fleetgen import JobSpec, generate_window
from ray_jobs.alerts import AlertRules
from ray_jobs.hang_monitor import HangReducer
from core.config import AlertConfig, HangConfig
from tests.fakes import ManualClock

SEC = 10**9
T0 = 1_700_000_000 * SEC
GPUS_PER_HOST = 8


@pytest.fixture(scope="module")
def job512():
    spec = JobSpec("big", JobLayout(dp_size=8, pp_size=8, tp_size=8), num_microbatches=16, stage_layers=(4,) * 8)
    reg = Registration.from_row(spec.registration(T0, 4).to_pylist()[0])
    got = analyze_window_for_shard(generate_window(spec, 0, 4, T0), reg, ("big", 0, 0), True, "")
    return spec, got


def _heartbeats(ts, ranks, step=40):
    return codec.from_rows(S.HEARTBEAT, [dict(
        job_id="big", attempt=0, rank=r, host=f"host-{r // GPUS_PER_HOST:02d}", pid=100 + r, ts_ns=ts, step=step,
        last_op="optimizer", last_op_end_ns=ts - SEC // 2, inflight_op="", inflight_group="", inflight_seq=-1,
        inflight_since_ns=-1, clock_offset_ns=0, stack="", step_done=step - 1, step_done_ns=-1, proc_state="",
        heartbeat_s=2.0, quiet_ns=400_000_000) for r in ranks])


def test_a_window_analysed_whole_carries_what_a_plan_needs(job512):
    spec, got = job512
    basis = got.recovery
    assert basis is not None and (basis.dp, basis.pp, basis.tp) == (8, 8, 8) and basis.microbatches == 16
    assert basis.units == "layers" and len(basis.layer_s) == 32 and basis.step_s > 0
    assert got.tables["window"]["complete"][0].as_py()


def test_a_lost_host_is_paged_with_the_restart_plan_and_its_predicted_throughput(job512):
    spec, got = job512
    clock = ManualClock(wall=lambda: T0 + int(clock.t * SEC))
    mon = HangReducer(HangConfig(), every_s=0.0, clock=clock, recovery_of=lambda j, a: got.recovery)
    everyone, lost = range(512), range(3 * GPUS_PER_HOST, 4 * GPUS_PER_HOST)  # host-03
    for second in range(0, 60, 2):
        clock.t = float(second)
        ranks = everyone if second < 10 else [r for r in everyone if r not in lost]
        mon.add_heartbeats(_heartbeats(T0 + second * SEC, ranks, step=40 + second), clock.t)
        hangs = mon.evaluate(clock.t).to_pylist()
        if hangs:
            break
    (row,) = hangs
    assert row["kind"] == "node_loss" and row["op"] == "host silent" and row["suspect_hosts"] == "host-03", row
    plan = json.loads(row["evidence_json"])["recovery_plan"]
    assert (plan["n_nodes"], plan["nodes_alive"], plan["lost_hosts"]) == (64, 63, ["host-03"])
    # 63 hosts hold 7 whole copies of the 8-host pipeline and 7 spare hosts, or re-planned pipelines: either way
    # slower than before (one copy of eight is gone) and no slower than a seventh more.
    assert plan["step_time_after_s"] > plan["step_time_before_loss_s"], plan
    assert 7 / 8 - 0.02 <= plan["throughput_vs_before"] < 1.0, plan
    assert "63 surviving nodes" in plan["action"], plan
    (alert,) = AlertRules(AlertConfig(cooldown_s=0)).evaluate_hang(row, 0.0, T0)
    assert alert["rule"] == "node_loss" and "recovery: " in alert["summary"] and "63 surviving nodes" in alert["summary"]
    assert "of the throughput before the loss" in alert["summary"], alert["summary"]
    assert json.loads(alert["details_json"])["recovery_plan"]["nodes_alive"] == 63


def test_without_a_window_analysed_whole_the_page_says_why_there_is_no_plan():
    clock = ManualClock(wall=lambda: T0 + int(clock.t * SEC))
    mon = HangReducer(HangConfig(), every_s=0.0, clock=clock, recovery_of=lambda j, a: None)
    for second in range(0, 60, 2):
        clock.t = float(second)
        mon.add_heartbeats(_heartbeats(T0 + second * SEC, range(16) if second < 10 else range(8)), clock.t)
        hangs = mon.evaluate(clock.t).to_pylist()
        if hangs:
            break
    (row,) = hangs
    ev = json.loads(row["evidence_json"])
    assert row["kind"] == "node_loss" and "recovery_plan" not in ev and ev["recovery_plan_missing"]
    assert "recovery:" not in AlertRules(AlertConfig(cooldown_s=0)).evaluate_hang(row, 0.0, T0)[0]["summary"]


def test_the_console_and_the_trace_summary_tell_the_plan(job512):
    """The console's hang panel and ``trace``'s summary word a node loss with ``explain_hang``: the plan is there."""
    from analyzers.explain import explain_hang
    from analyzers.hang import Hang, to_tables

    spec, got = job512
    from analyzers.remedies.advise import plan_for_node_loss

    plan = plan_for_node_loss(got.recovery, {r: f"host-{r // GPUS_PER_HOST:02d}" for r in range(512)}, ["host-03"])
    lost = list(range(24, 32))
    hang = Hang("big", 0, "node_loss", "", -1, "host silent", [r for r in range(512) if r not in lost], lost,
                ["host-03"], T0, 31.0, {"recovery_plan": plan})
    (row,) = to_tables([hang], T0 + 31 * SEC)["hang"].to_pylist()
    sentence = explain_hang(row, None).sentence
    assert "Recovery plan: restart on the 63 surviving nodes" in sentence and "of the throughput before" in sentence
