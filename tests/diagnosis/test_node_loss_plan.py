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
    # Every stage of every pipeline placed on a surviving host, each host used once, the global batch shared out.
    placed = [(s["host"], s["gpu"]) for p in plan["assignment"] for s in p["stages"]]
    assert len(placed) == len(set(placed)) and "host-03" not in {h for h, _ in placed}, plan["assignment"]
    assert sum(p["microbatches"] for p in plan["assignment"]) == 8 * 16
    assert all(s["units"][1] >= s["units"][0] for p in plan["assignment"] for s in p["stages"])
    assert all(sorted(u for s in p["stages"] for u in range(s["units"][0], s["units"][1] + 1)) == list(range(32))
               for p in plan["assignment"])  # each pipeline holds the model's 32 layers once
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


def _lose(mon, clock, lost, everyone=range(512), host=lambda r: f"host-{r // GPUS_PER_HOST:02d}"):
    for second in range(0, 60, 2):
        clock.t = float(second)
        ranks = everyone if second < 10 else [r for r in everyone if r not in lost]
        hb = _heartbeats(T0 + second * SEC, ranks, step=40 + second)
        mon.add_heartbeats(hb.set_column(hb.schema.get_field_index("host"), "host",
                                         __import__("pyarrow").array([host(r) for r in ranks])), clock.t)
        hangs = mon.evaluate(clock.t).to_pylist()
        if hangs:
            return hangs
    return []


def test_a_process_loss_restarts_in_place_with_the_plan_should_its_host_be_drained(job512):
    """One rank gone while its host's other ranks report: no node is lost; the restart is in place, at the step
    time before, and the plan without that host is there should it have to be drained."""
    spec, got = job512
    clock = ManualClock(wall=lambda: T0 + int(clock.t * SEC))
    mon = HangReducer(HangConfig(), every_s=0.0, clock=clock, recovery_of=lambda j, a: got.recovery)
    (row,) = _lose(mon, clock, [27])
    assert (row["kind"], row["op"], row["missing_ranks"]) == ("node_loss", "process silent", "27"), row
    plan = json.loads(row["evidence_json"])["recovery_plan"]
    assert plan["in_place"] and (plan["n_nodes"], plan["nodes_alive"], plan["throughput_vs_before"]) == (64, 64, 1.0)
    assert plan["if_drained"]["nodes_alive"] == 63 and plan["if_drained"]["lost_hosts"] == ["host-03"]
    (alert,) = AlertRules(AlertConfig(cooldown_s=0)).evaluate_hang(row, 0.0, T0)
    assert "recovery: restart in place on the 64 nodes (rank 27 lost its process, host-03 still reports)" in \
        alert["summary"], alert["summary"]
    assert "as before; if host-03 must be drained: restart on the 63 surviving nodes" in alert["summary"]
    from analyzers.explain import explain_hang

    assert "Recovery plan: restart in place" in explain_hang(row, None).sentence


def test_hosts_of_unequal_size_are_paged_with_why_there_is_no_plan(job512):
    spec, got = job512
    clock = ManualClock(wall=lambda: T0 + int(clock.t * SEC))
    mon = HangReducer(HangConfig(), every_s=0.0, clock=clock, recovery_of=lambda j, a: got.recovery)
    # host-00 holds 9 ranks, host-01 7: node-sized templates cannot be placed.
    (row,) = _lose(mon, clock, range(24, 32), host=lambda r: "host-00" if r == 8 else f"host-{r // 8:02d}")
    ev = json.loads(row["evidence_json"])
    assert row["op"] == "host silent" and "recovery_plan" not in ev
    assert "unequal numbers of ranks" in ev["recovery_plan_missing"], ev
    (alert,) = AlertRules(AlertConfig(cooldown_s=0)).evaluate_hang(row, 0.0, T0)
    assert "; no recovery plan: the job's hosts ran unequal numbers of ranks" in alert["summary"], alert["summary"]
    assert json.loads(alert["details_json"])["recovery_plan_missing"] == ev["recovery_plan_missing"]
