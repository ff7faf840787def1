"""Collectives on GPUs, where NCCL returns from every call at once: the records' times are the GPU's.

Four real processes on the fake NCCL device (``tests/nccl_fake.py``: streams in order, events, calls that
return at once, collectives that complete when every member's stream reached them, through real gloo),
with the real exporter and ``ingest.torch_ccl``. Host-timed, every record of such a job is empty (enter and
exit microseconds apart, whoever was late): the link diagnosis sees nothing. GPU-timed, a late rank and a
slow link are named as on gloo, the control stays silent, and a rank stuck in a kernel is named by the
hang detector from the collective its peers' GPUs are inside. (Grouped p2p, ``batch_isend_irecv``, is one
NCCL kernel: every op of a group ends with the group, so a ring's slow link couples its neighbours'
records; per-peer times there need the collective library's own timing, ``analyzers/links/reported.py``.)
The last two tests run a job under the whole trace session of ``stragglerscope trace`` on the same device
(``nccl_fake_trace_worker.py``): compute and DP-communication spans from the GPU's events, analysed as the
pipeline analyses a window.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from analyzers.links import diagnose_window
from analyzers.links.history import FIRST_SEEN_CAP
from core.config import AlertConfig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("nccl_fake_worker.py")


def _launch(worker: Path, world: int, *args: str) -> None:
    """``world`` real processes of ``worker`` (RANK WORLD PORT ARGS...), each of which must succeed."""
    pytest.importorskip("torch")
    from services.ports import free_fixed_port

    port = free_fixed_port()
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(world), str(port), *args], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            p.kill()
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]


def run_job(tmp_path, scenario: str, timing: str = "gpu", world: int = 4) -> pa.Table:
    _launch(WORKER, world, str(tmp_path), scenario, timing)
    if scenario == "clock":
        return pa.table({"offset": [int((tmp_path / f"rank{r}.offset").read_text()) for r in range(world)]})
    return pa.concat_tables([pa.ipc.open_file(tmp_path / f"rank{r}.arrow").read_all() for r in range(world)])


def durations_ms(ccl: pa.Table, op: str) -> np.ndarray:
    t = ccl.filter(pa.compute.equal(ccl["op"], op))
    return (t["exit_ns"].to_numpy() - t["enter_ns"].to_numpy()) / 1e6


def test_host_timed_records_of_nccl_calls_are_empty(tmp_path):
    """The failure as reported: the calls return at once, so every record is empty and nothing is named."""
    ccl = run_job(tmp_path, "late", timing="host")
    assert np.median(durations_ms(ccl, "all_reduce")) < 1.0
    assert not [f for f in diagnose_window(ccl).faults if f.confidence >= 0.3]


def test_a_late_rank_is_named_from_the_gpu_times(tmp_path):
    ccl = run_job(tmp_path, "late")
    assert ccl.num_rows == 4 * 8 and len(set(ccl["rank"].to_pylist())) == 4
    d = durations_ms(ccl, "all_reduce")
    on_time = d[np.asarray(ccl["rank"].to_pylist())[np.asarray(ccl["op"].to_pylist()) == "all_reduce"] != 2]
    assert np.median(on_time) >= 30.0, d  # they waited for rank 2's 40 ms on the GPU
    faults = diagnose_window(ccl).faults
    top = faults[0] if faults else None
    assert top is not None and (top.kind, top.src) == ("noncomm_slow", 2) and top.confidence >= 0.5, faults


def test_a_rank_stuck_in_a_kernel_is_named_missing_from_the_collective_its_peers_wait_in(tmp_path):
    """Rank 1's GPU never ends a kernel in step 6 (outside the sampled steps). Every host has long returned
    from all_reduce #6; its peers' GPUs are inside it. Their heartbeats say so, rank 1's does not: the hang
    detector names rank 1 missing from world #6."""
    from analyzers.hang import HangParams, HangTracker

    ccl = run_job(tmp_path, "stuck")
    hb = pa.concat_tables([pa.ipc.open_file(tmp_path / f"rank{r}.hb.arrow").read_all() for r in range(4)])
    tracker = HangTracker("fake-nccl", params=HangParams(floor_s=1.0, min_s=1.0, k_steps=1.0))
    tracker.add_ccl(ccl)
    tracker.add_heartbeats(hb.sort_by("ts_ns"))
    hang = tracker.evaluate(int(pa.compute.max(hb["ts_ns"]).as_py()))
    assert hang is not None and hang.kind == "comm_hang", hang
    assert (hang.group, hang.seq, hang.missing_ranks, hang.stuck_ranks) == ("world", 6, [1], [0, 2, 3]), hang


def test_a_slow_link_is_named_and_the_control_stays_silent(tmp_path):
    """A 4-stage chain, transfers 1 -> 2 30 ms slower. Rank 1 sends only to 2 and rank 2 receives only from 1:
    egress 1, ingress 2 and link 1>2 are one observation, so the finding names the link with all three as
    candidates, at the confidence such an ambiguity gets (as on gloo)."""
    (tmp_path / "link").mkdir()
    faults = diagnose_window(run_job(tmp_path / "link", "link")).faults
    assert faults and (faults[0].kind, faults[0].src, faults[0].dst) == ("link", 1, 2), faults
    assert faults[0].confidence >= 0.3 and "link 1>2" in faults[0].evidence["candidates"], faults[0]
    for attempt in range(2):
        # On a loaded 2-core machine the four processes' scheduling can put one rank steadily behind (a healthy
        # control named rank 1 a late sender at 0.89, 13 ms = 23% of its step, once in a whole-suite run:
        # issue 52's precision); measured again once, a rule that names a healthy rank does it both times.
        (tmp_path / f"control{attempt}").mkdir()
        control = diagnose_window(run_job(tmp_path / f"control{attempt}", "control")).faults
        if not [f for f in control if f.confidence >= 0.3]:
            break
    assert not [f for f in control if f.confidence >= 0.3], control


def test_clocks_are_compared_over_a_gloo_group_of_our_own(tmp_path):
    """Under NCCL the default group's collectives would touch a device the script has not chosen yet; the
    trace session measures the offsets over its side gloo group instead (rank 1's clock 5 s ahead)."""
    offsets = run_job(tmp_path, "clock", world=2)["offset"].to_pylist()
    assert offsets[0] == 0 and abs(offsets[1] + 5_000_000_000) < 50_000_000, offsets


# -- the whole tracer of `stragglerscope trace` on the fake device -------------------------------------------

TRACED = Path(__file__).with_name("nccl_fake_trace_worker.py")


def run_traced(tmp_path, scenario: str, world: int = 4) -> dict[str, pa.Table]:
    """A job on the fake device under the real trace session: its registration, and its last profiled
    window (the first has the warm-up step) analysed as the pipeline analyses it: every window in order,
    the link findings weighed by the job's window before (``FindingHistory``, as in the shard)."""
    from analyzers.links.history import FindingHistory, found_in
    from analyzers.window import WindowContext, analyze_window
    from core.registration import Registration

    _launch(TRACED, world, str(tmp_path), scenario)
    got = {name: pa.concat_tables([pa.ipc.open_file(tmp_path / f"rank{r}.{name}.arrow").read_all()
                                   for r in range(world)]) for name in ("op", "ccl", "job")}
    assert got["job"].num_rows, "no registration was sent"
    reg = Registration.from_row(got["job"].to_pylist()[-1])
    ops, history = got["op"], FindingHistory()
    assert ops.num_rows and set(ops["rank"].to_pylist()) == set(range(world)), ops["rank"].to_pylist()
    windows = sorted(set(ops["window_id"].to_pylist()))
    assert len(windows) == 2, windows
    for window in windows:
        key = (reg.job_id, 0, window)
        window_ops = ops.filter(pa.compute.equal(ops["window_id"], window))
        tables = analyze_window(window_ops, reg, key, True, "",
                                got["ccl"].filter(pa.compute.equal(got["ccl"]["window_id"], window)),
                                context=WindowContext(prior=history.before(key)))
        history.record(key, found_in(tables["link_fault"]))
    return {**got, **tables, "op": window_ops}


def span_ms(ops: pa.Table, optype: str) -> dict[int, float]:
    """Median duration of ``optype`` per rank, in ms."""
    t = ops.filter(pa.compute.equal(ops["optype"], optype))
    ranks, ms = np.asarray(t["rank"].to_pylist()), t["duration_ns"].to_numpy() / 1e6
    return {int(r): float(np.median(ms[ranks == r])) for r in np.unique(ranks)}


def test_the_tracer_times_compute_and_dp_communication_on_the_gpu_and_names_the_late_rank(tmp_path):
    """Rank 2's backward kernels take 90 ms longer (150 against 60). The host queues every kernel and
    collective and goes on, so its own times would say nothing; the tracer's spans are the GPU's: rank 2's
    backward, and its peers' gradient all-reduce waiting for it on their GPUs (the DP communication comes
    from the events, not from the host). The what-if names DP rank 2 alone, and so does the link analysis."""
    got = run_traced(tmp_path, "late")
    bwd, comm = span_ms(got["op"], "backward-compute"), span_ms(got["op"], "grads-reduce-scatter")
    assert bwd[2] >= 140.0 and all(55.0 <= bwd[r] <= 95.0 for r in (0, 1, 3)), bwd
    assert all(comm[r] >= 70.0 for r in (0, 1, 3)) and comm[2] < 30.0, comm
    fwd = span_ms(got["op"], "forward-compute")
    assert all(m >= 28.0 for m in fwd.values()), fwd  # the 30 ms kernel (the host's part is ~0.1 ms)
    row = got["window"].to_pylist()[0]
    assert row["verdict"] == "worker" and row["slowdown"] >= 1.3, row
    s_w = {w["dp_rank"]: w["s_w"] for w in got["worker_slowdown"].to_pylist() if w["step"] == -1}
    assert s_w[2] >= 1.3 and all(s_w[r] <= 1.1 for r in (0, 1, 3)), s_w
    top = got["link_fault"].to_pylist()[0] if got["link_fault"].num_rows else None
    assert top is not None and (top["kind"], top["src"]) == ("noncomm_slow", 2), got["link_fault"].to_pylist()


def test_the_tracer_on_a_healthy_gpu_job_names_no_one(tmp_path):
    """The same job, no rank slowed. On 2 shared cores the fake device's kernels overrun by its thread's
    scheduling and the real gloo all-reduce under them varies, so S is 1.08-1.13 here (1.56 with the late
    rank); what a healthy job must not get is a worker standing out or a link finding above low confidence
    (one window's alone is 0.5 at most: a rank 11 ms late in one window, 1 of 8 runs here, gets that)."""
    got = run_traced(tmp_path, "control")
    row = got["window"].to_pylist()[0]
    assert row["verdict"] not in ("worker", "analysis_failed", "no_op_spans", "layout_conflict"), row
    assert row["slowdown"] < 1.25, row
    s_w = {w["dp_rank"]: w["s_w"] for w in got["worker_slowdown"].to_pylist() if w["step"] == -1}
    assert len(s_w) == 4 and max(s_w.values()) < 1.2, s_w
    assert not [f for f in got["link_fault"].to_pylist() if f["confidence"] > FIRST_SEEN_CAP], \
        got["link_fault"].to_pylist()


def test_the_tracer_on_a_gpu_pipeline_names_its_slow_link_and_its_control_nothing(tmp_path):
    """The same layers as a 4-stage GPipe pipeline (2 microbatches, isend/irecv over the pipeline group the
    job made, the gradients' norm all-reduced over every stage before the optimizer), transfers 1 -> 2
    40 ms slower. The tracer learns the pipeline from the group its transfers name and times them on the
    GPU; the what-if sees the step slowed by communication (S 1.19-1.20 against 1.02-1.08) and the link
    analysis names the sender's side of 1 -> 2. Rank 1 sends forward only to 2, and on this fake its
    backward sends to 0 do not always clear its NIC: over six runs 'link 1>2' three times (0.33-1.0),
    'egress 1' twice (0.5), 'comm_slow 1>2' once (0.30). The same pipeline without the fault gets no alert,
    no slow worker or stage and no link finding above one window's cap."""
    (tmp_path / "link").mkdir()
    got = run_traced(tmp_path / "link", "pipe-link")
    reg = got["job"].to_pylist()[-1]
    assert (reg["pp_size"], reg["dp_size"]) == (4, 1), reg
    assert {"forward-send", "forward-recv", "backward-send", "backward-recv"} <= set(got["op"]["optype"].to_pylist())
    row = got["window"].to_pylist()[0]
    assert row["verdict"] == "communication" and row["slowdown"] >= 1.1, row
    top = got["link_fault"].to_pylist()[0] if got["link_fault"].num_rows else None
    assert top is not None and top["src"] == 1 and top["dst"] in (2, -1) and top["confidence"] >= 0.25 \
        and top["kind"] in ("link", "source", "comm_slow"), got["link_fault"].to_pylist()
    for attempt in range(2):
        # What a healthy pipeline must not get is an alert (S from AlertConfig.slowdown_threshold, 1.1), a slow
        # worker or stage, or a link finding above one window's cap. Under S 1.1 the what-if still names the
        # largest source of what excess there is: 'communication' at S 1.078, 1 of 7 runs alone on the 2 cores,
        # the fake device's transfer threads being scheduled like any other. A whole-suite run (2026-11-30, load
        # 7) failed here once: measured again once; a rule that finds the healthy pipeline slow does it both times.
        (tmp_path / f"control{attempt}").mkdir()
        control = run_traced(tmp_path / f"control{attempt}", "pipe")
        row = control["window"].to_pylist()[0]
        loud = [f for f in control["link_fault"].to_pylist() if f["confidence"] > FIRST_SEEN_CAP]
        quiet = row["slowdown"] < AlertConfig.slowdown_threshold and row["verdict"] not in (
            "worker", "last_stage_imbalance")
        if quiet and not loud:
            break
    assert quiet, {k: row[k] for k in ("verdict", "slowdown", "window_id")}
    assert not loud, loud
