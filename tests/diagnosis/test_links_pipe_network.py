"""A pipeline's network fault named from its transfers' times stands where the kernel's counters did not judge it.

The data are real: ``data/pp4net_*.arrow`` are windows of three runs of the netfault harness's ``pipe`` job
(tests/netfaults/scenarios.py: DP2 x PP2 over ``torch.distributed.pipelining``, each rank in its own network
namespace), traced by ``stragglerscope trace`` (2-core VM, 2026-11-30): ``pipe_ingress2_severe``, window 6
with rank 2's ingress at 20mbit; ``pipe_ingress2_mild``, window 0 with it at 40mbit; ``pipe_link02_mild``,
window 0 with the link 0>2 at 40mbit; ``pipe_ingress2_severe_b``, window 6 of another run at 20mbit;
``pipe_nic1_severe_hog``, windows 0 and 6 with rank 1's NIC at 20mbit and a CPU hog beside the job
(``benchmarks/diagnosis_accuracy.py --cpu-hogs 1 --keep``); ``pipe_healthy_hog``, windows 0 and 6 of a healthy run
beside the hog. The transfer into rank 2 (0>2) waits on the next stage, so its flow is
never judged slow or healthy; it was busy 25% of the window, exactly where a flow counts as a bottleneck the
flows could not confirm. In a sweep on a loaded host (load 11) 3 of 6 such faults were held at 0.25, under
what is printed, because the all-reduce flows alone were judged, all healthy; and a capped ingress was named
the link into it (issue 52).
"""
import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analyzers.links import CCL_ONLY_CAP, LinkFault, _weigh_by_flows, diagnose_window
from analyzers.links.tcp import Flow, FlowVerdict, TcpParams, flows, judge_flows, receiver_queued
from core.config import AlertConfig

DATA = Path(__file__).parent / "data"


def _read(kind: str, job: str = "pipe_ingress2_severe") -> pa.Table:
    t = pa.ipc.open_file(pa.OSFile(str(DATA / f"pp4net_{kind}.arrow"))).read_all()
    return t.filter(pc.equal(t["job_id"], job))


def _longer_steps(tcp: pa.Table, factor: float) -> pa.Table:
    """The same transfers in steps ``factor`` times as long: what a busier host does to a pipeline's window."""
    i = tcp.schema.get_field_index("elapsed_ns")
    longer = (tcp["elapsed_ns"].to_numpy() * factor).astype(np.int64)
    return tcp.set_column(i, "elapsed_ns", pa.array(longer, tcp.schema.field(i).type))


def test_the_receiver_s_ingress_stands_though_the_flows_judged_every_other_transfer_healthy():
    ccl, tcp = _read("ccl_record"), _longer_steps(_read("tcp_flow"), 1.2)
    verdicts = judge_flows(flows(tcp))
    # As on the loaded host: no flow slow, none busy like an unconfirmed bottleneck, the judged ones healthy...
    assert all(v.status in ("ok", "unknown") for v in verdicts)
    assert all(v.flow.busy_fraction < TcpParams().bottleneck_busy for v in verdicts if v.status == "unknown")
    # ... but 0>2, the transfer through the named ingress, is not one of the judged.
    into = [v for v in verdicts if (v.flow.src, v.flow.dst) == (0, 2)]
    assert [v.status for v in into] == ["unknown"]
    top = diagnose_window(ccl, tcp=tcp).faults[0]
    assert (top.kind, top.dst) == ("destination", 2) and top.confidence >= AlertConfig.link_shown_confidence, top
    assert "tcp" not in top.evidence


def test_as_recorded_the_ingress_is_named_with_the_same_confidence():
    top = diagnose_window(_read("ccl_record"), tcp=_read("tcp_flow")).faults[0]
    longer = diagnose_window(_read("ccl_record"), tcp=_longer_steps(_read("tcp_flow"), 1.2)).faults[0]
    assert (top.kind, top.dst, top.confidence) == (longer.kind, longer.dst, longer.confidence)
    assert top.confidence >= 0.9


def _flow(src: int, dst: int, mb_per_s: float, busy: float = 0.1) -> Flow:
    return Flow(src, dst, 10_000_000, 10 / mb_per_s, 10 / mb_per_s / busy, 500.0, 100.0, 0, 0.0, 0.0, 0, 5)


def test_a_finding_whose_transfers_the_kernel_judged_healthy_stays_a_hint():
    ring = [FlowVerdict(_flow(r, (r - 1) % 8, 30.0), "ok", 1.0) for r in range(8)]
    times = [LinkFault("p2p", "link", 4, 3, 0.8, 2.7, {}), LinkFault("p2p", "source", 4, -1, 0.7, 2.7, {}),
             LinkFault("p2p", "destination", -1, 3, 0.7, 2.7, {}), LinkFault("", "noncomm_slow", 6, -1, 0.9, 5, {})]
    out = {(f.kind, f.src, f.dst): f for f in _weigh_by_flows(times, ring, [])}
    for key in [("link", 4, 3), ("source", 4, -1), ("destination", -1, 3)]:
        assert out[key].confidence == CCL_ONLY_CAP and "healthy" in out[key].evidence["tcp"], out[key]
    assert out[("noncomm_slow", 6, -1)].confidence == 0.9  # a late sender is not the network's to clear
    # The same ring where the kernel could not judge 4>3: the link, 4's NIC and 3's ingress keep their confidence.
    unjudged = [v if (v.flow.src, v.flow.dst) != (4, 3) else FlowVerdict(v.flow, "unknown", 1.0) for v in ring]
    out = {(f.kind, f.src, f.dst): f.confidence for f in _weigh_by_flows(times, unjudged, [])}
    assert out == {("link", 4, 3): 0.8, ("source", 4, -1): 0.7, ("destination", -1, 3): 0.7, ("noncomm_slow", 6, -1): 0.9}


def test_a_capped_ingress_is_told_from_the_link_into_it_by_its_other_sender_s_queue():
    ccl, tcp = _read("ccl_record", "pipe_ingress2_mild"), _read("tcp_flow", "pipe_ingress2_mild")
    top = diagnose_window(ccl, tcp=tcp).faults[0]
    assert (top.kind, top.src, top.dst) == ("destination", -1, 2), top
    assert top.evidence["named_first"] == "link 0>2"  # what the times alone said
    queued = top.evidence["receiver_queued"]
    assert queued["flow"] == "3>2" and queued["rtt_ms"] >= 10 * queued["reference_ms"] and queued["queued_kb"] >= 50
    # The link capped instead: rank 3's all-reduce flow into 2 kept its RTT, and the link stays the answer.
    ccl, tcp = _read("ccl_record", "pipe_link02_mild"), _read("tcp_flow", "pipe_link02_mild")
    top = diagnose_window(ccl, tcp=tcp).faults[0]
    assert (top.kind, top.src, top.dst) == ("link", 0, 2) and "receiver_queued" not in top.evidence, top
    assert receiver_queued(flows(tcp), 0, 2) is None


def test_only_another_sender_s_queue_moves_a_link_to_its_receiver():
    ref = [_flow(1, 3, 20.0), _flow(3, 1, 20.0)]  # touching neither end: the reference RTT, 0.5 ms
    slow_link = _flow(0, 2, 1.0)
    queued_link = dataclasses.replace(slow_link, rtt_us=40_000.0)  # the link's own queue says nothing
    assert receiver_queued(ref + [queued_link, _flow(3, 2, 20.0)], 0, 2) is None
    into = dataclasses.replace(_flow(3, 2, 4.0), rtt_us=30_000.0)  # 60x, 118 KB at 4 MB/s
    assert receiver_queued(ref + [slow_link, into], 0, 2)["flow"] == "3>2"
    small = dataclasses.replace(_flow(3, 2, 0.2), rtt_us=2_000.0)  # 4x, but 0.3 KB: a sender's own packets
    assert receiver_queued(ref + [slow_link, small], 0, 2) is None


def test_the_flows_own_ingress_rule_hears_the_other_sender_s_queue_too():
    """The flows judged 0>2 the bottleneck; its own queue held 8.0 KB, a hair under what names a receiver, so the
    sender's side was left and rank 0 sends faster elsewhere: "link 0>2" (0.60). Rank 3's flow into rank 2
    ran at 45x the reference RTT: the ingress."""
    ccl, tcp = _read("ccl_record", "pipe_ingress2_severe_b"), _read("tcp_flow", "pipe_ingress2_severe_b")
    (top,) = [f for f in diagnose_window(ccl, tcp=tcp).faults if f.group == "tcp"]
    assert (top.kind, top.src, top.dst) == ("destination", -1, 2), top
    assert top.evidence["rtt"]["queued_kb"] < TcpParams().queue_bytes / 1e3 + 0.1
    assert top.evidence["receiver_queued"]["flow"] == "3>2"


def test_where_the_times_and_the_flows_name_the_same_nic_the_answer_is_as_sure_as_the_surer():
    """Rank 1's NIC at 20mbit beside a CPU hog, window 6: the times named it at 0.96 (its pipeline send 1>3 and
    its all-reduce both slow, everything else cleared); the flows at 0.51 (their one judged slow flow, 1>0, at
    2.1 MB/s against healthy flows the hog had slowed too). The flows' finding stood instead of the times', and
    the job's answer was 0.51, on the printed line's edge."""
    ccl, tcp = (_read(k, "pipe_nic1_severe_hog") for k in ("ccl_record", "tcp_flow"))
    ccl6, tcp6 = (t.filter(pc.equal(t["window_id"], 6)) for t in (ccl, tcp))
    (times,) = [f for f in diagnose_window(ccl6).faults if f.kind == "source"]
    assert times.src == 1 and times.confidence >= 0.9, times
    faults = diagnose_window(ccl6, tcp=tcp6).faults
    top = faults[0]
    assert (top.group, top.kind, top.src) == ("tcp", "source", 1), faults[:3]
    agree = top.evidence["times_agree"]
    assert agree["flows_confidence"] < 0.6 and top.confidence >= 0.9 and agree["confidence"] == round(top.confidence, 3)
    assert not [f for f in faults if f.group != "tcp" and f.kind == "source"], faults  # one finding, not two


def test_a_healthy_rank_late_in_one_window_beside_a_cpu_hog_is_not_printed():
    """A healthy DP2 x PP2 run beside a CPU hog: rank 2 last into 2 of its 3 collectives of window 6 by 9.5 ms
    (4% of its step, against 1.8 ms of the job's jitter), nothing in window 0. It was printed as the job's
    late sender at 0.50, the first-seen cap; a late sender is a stable margin across windows (issue 52)."""
    from analyzers.links.history import FindingHistory

    ccl, tcp = (_read(k, "pipe_healthy_hog") for k in ("ccl_record", "tcp_flow"))
    history = FindingHistory()
    for w in (0, 6):
        faults = history.weigh(("pipe_healthy_hog", 0, w), diagnose_window(
            ccl.filter(pc.equal(ccl["window_id"], w)), tcp=tcp.filter(pc.equal(tcp["window_id"], w))).faults)
    (late,) = [f for f in faults if f.kind == "noncomm_slow"]
    assert late.src == 2 and late.evidence["persistence"]["window_confidence"] > 0.5, late
    assert not [f for f in faults if f.confidence >= AlertConfig.link_shown_confidence], faults
