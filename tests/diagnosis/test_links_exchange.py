"""Jobs whose ranks exchange with several peers at once (a hand-written ring): late senders.

The data are real: ``data/ring8_*.arrow`` are window 6 (steps 6-10) of six runs of tests/netfaults/ring_job.py
(8 ranks, each in its own network namespace, exchanging with both neighbours twice a step through
``batch_isend_irecv``; 2-core VM, 2026-11-28), traced by ``stragglerscope trace``: the CCL records and TCP
counters the exporters sent. ``job_id`` names the run: ``late3_*`` is rank 3 with 30 ms (mild) or 60 ms
(severe) more compute per forward and backward, ``healthy_*`` has no fault. ``late3_mild_hog``, ``healthy_3``
and ``healthy_hog`` are windows 0 and 6 of three later runs (``benchmarks/diagnosis_accuracy.py --keep``,
2026-11-30; ``*_hog`` beside a CPU hog, ``--cpu-hogs 1``); their TCP counters include the path probes
(``probe``: false in the others).
"""
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from analyzers.links import diagnose_window
from analyzers.links.history import LATE_STEADY_SHARE, LATE_STEADY_STEPS, SEEN, FindingHistory
from analyzers.links.localise import late_senders
from analyzers.links.measured import MeasuredParams, exchange_arrivals, judge, p2p_observations
from core import codec
from core import schema as S
from core.config import AlertConfig

DATA = Path(__file__).parent / "data"


def _run(kind: str, job: str) -> pa.Table:
    t = pa.ipc.open_file(pa.OSFile(str(DATA / f"ring8_{kind}.arrow"))).read_all()
    return t.filter(pc.equal(t["job_id"], job))


@pytest.mark.parametrize("job", ["late3_mild_1", "late3_mild_2", "late3_severe_1", "late3_severe_2"])
def test_a_late_rank_in_a_ring_is_named_though_every_receiver_waits_for_somebody(job):
    """Before: 2 of these 4 runs named a slow transfer instead (comm_slow at 0.23), the other 2 rank 3; the
    median wait of rank 3's receivers (17-69 ms) was no larger than the others' (47-81 ms)."""
    d = diagnose_window(_run("ccl_record", job), tcp=_run("tcp_flow", job))
    top = d.faults[0]
    assert (top.kind, top.src) == ("noncomm_slow", 3) and top.confidence >= 0.9, d.faults[:3]
    assert top.evidence["exchange_peers"] == [2, 4] and top.evidence["late_steps"] >= 4
    assert all(f.src != 3 for f in d.faults[1:] if f.kind == "noncomm_slow")
    # The margin is the delay the job was given (30 or 60 ms more per forward and per backward), read from its
    # work between exchanges; its arrival after the neighbours was 39-106 ms for the same 60 ms.
    injected = 60e6 if "mild" in job else 120e6
    assert top.evidence["late_by"] == "work" and 0.8 * injected < top.evidence["margin_ns"] < 1.2 * injected, top


@pytest.mark.parametrize("job", ["healthy_1", "healthy_2"])
def test_a_healthy_ring_gets_nothing_the_trace_summary_would_print(job):
    """Before: healthy_1 had 'late sender: rank 2' at 0.99 (it came after both neighbours in 2 of 5 steps)."""
    d = diagnose_window(_run("ccl_record", job), tcp=_run("tcp_flow", job))
    shown = [f for f in d.faults if f.confidence >= AlertConfig.link_shown_confidence]
    assert shown == [], shown
    assert not [f for f in d.faults if f.kind == "noncomm_slow"]


def test_arrivals_compare_each_rank_with_its_own_exchange_peers_step_by_step():
    arr = exchange_arrivals(_run("ccl_record", "late3_severe_1"))
    assert sorted(arr) == list(range(8))
    assert all(a.peers == tuple(sorted(((r - 1) % 8, (r + 1) % 8))) for r, a in arr.items())
    late = arr[3]
    assert len(late.steps) == 5 and (late.margin_ns > 20e6).all()  # after both neighbours, every step
    assert 150e6 < late.period_ns < 400e6
    others_late = [int((a.margin_ns > 0.1 * a.period_ns).sum()) for r, a in arr.items() if r != 3]
    assert max(others_late) <= 2, others_late


def _rec(rank, src, dst, seq, op, enter_ms, exit_ms, step=0, nbytes=1 << 20):
    return dict(job_id="j", attempt=0, rank=rank, window_id=0, step=step, group=f"p2p:{src}>{dst}",
                group_ranks=[src, dst], seq=seq, op=op, algorithm="", nbytes=nbytes, enter_ns=int(enter_ms * 1e6),
                exit_ns=int(exit_ms * 1e6), peers=[dst if op.endswith("send") else src], peer_transfer_ns=[],
                peer_bytes=[], recv_wait_ns=-1)


def test_a_pipeline_stage_is_not_judged_by_its_arrival_at_an_exchange():
    """A 3-stage chain: stage 0 reaches its first call (a send) after a forward by design, stage 1 posts its
    receive at the step's start. A stage sends back to a peer long after it received from it: no exchange,
    so the step-by-step arrival rule judges no stage (the pipeline's own rules do), and nothing is named."""
    rows, seq = [], {}

    def nxt(g):
        seq[g] = seq.get(g, -1) + 1
        return seq[g]
    for step in range(5):
        t = 200.0 * step
        for a, b, off in ((0, 1, 20), (1, 2, 40)):  # activations forward
            n = nxt((a, b))
            posted = t + off - 30 if b == 1 else t + 1  # the middle stage posts its receive early
            rows += [_rec(a, a, b, n, "send", t + off, t + off + 2, step),
                     _rec(b, a, b, n, "recv", posted, t + off + 2, step)]
        for a, b, off in ((2, 1, 120), (1, 0, 150)):  # gradients back
            n = nxt((a, b))
            rows += [_rec(a, a, b, n, "send", t + off, t + off + 2, step),
                     _rec(b, a, b, n, "recv", t + off - 5, t + off + 2, step)]
    ccl = codec.from_rows(S.CCL_RECORD, rows)
    arr = exchange_arrivals(ccl)
    assert arr == {}
    obs = p2p_observations(ccl)
    judge(obs)
    assert late_senders(obs, MeasuredParams(), arr) == []


def _ring(work_ms, n: int = 8) -> pa.Table:
    """A hand-written ring of ``n`` ranks, five steps: each rank works ``work_ms(step, rank)`` after its previous
    exchange ended (compute; at the first step, from the job's start), then posts its sends to and receives
    from both neighbours at once; a transfer ends 5 ms after the later of its two ends arrived, and a rank's
    exchange when its last transfer did. Event-driven, as a job runs: no step starts on a clock of its own, so
    a rank that waited for a late neighbour starts its next step late too."""
    rows, seq = [], {}
    ended = {r: 0.0 for r in range(n)}
    for step in range(5):
        at = {r: ended[r] + work_ms(step, r) for r in range(n)}
        for s in range(n):
            for d in ((s - 1) % n, (s + 1) % n):
                k = seq[(s, d)] = seq.get((s, d), -1) + 1
                done = max(at[s], at[d]) + 5.0
                ended[s], ended[d] = max(ended[s], done), max(ended[d], done)
                rows += [_rec(s, s, d, k, "isend", at[s], done, step, 128 << 10),
                         _rec(d, s, d, k, "irecv", at[d], done, step, 128 << 10)]
    return codec.from_rows(S.CCL_RECORD, rows)


def test_a_rank_consistently_six_percent_of_its_step_late_is_named_with_its_margin():
    """Issue 52: a ring rank 40 ms late before its sends (6% of its 0.62 s step) was not named, under a
    floor of 10% of the step. It is last every step by a margin the job's own jitter (a few ms) never makes."""
    rng = np.random.default_rng(7)
    jitter = rng.uniform(0.0, 6.0, size=(5, 8))
    ccl = _ring(lambda step, r: 600.0 + jitter[step, r] + (40.0 if r == 6 else 0.0))
    late = [f for f in diagnose_window(ccl).faults if f.kind == "noncomm_slow"]
    assert [f.src for f in late] == [6], late
    ev = late[0].evidence
    assert late[0].confidence >= 0.9
    assert 30e6 < ev["margin_ns"] < 45e6 and 0.05 < ev["margin_share_of_step"] < 0.075, ev
    # Judged by its work between exchanges: the window's first step has no exchange before it in the window.
    assert ev["jitter_ns"] < 10e6 and ev["late_steps"] == ev["steps"] == 4 and ev["late_by"] == "work", ev


def test_a_healthy_ring_whose_ranks_are_now_and_then_scheduled_late_names_nobody():
    """Issue 52: healthy rings on 2 loaded cores had rank 7 (or another) named a late sender at 0.45-0.57 in
    2 of 4 runs: scheduling put it behind both neighbours by more than 10% of a step in 3 of 5 steps. Every
    rank is delayed like that now and then; none is late by a margin that holds across its steps."""
    rng = np.random.default_rng(3)
    delay = rng.uniform(0.0, 20.0, size=(5, 8))
    for step, ranks in enumerate([(7, 2), (7, 4), (1, 5), (7, 3), (2, 5)]):  # rank 7 in 3 of 5 steps
        for r in ranks:
            delay[step, r] += rng.uniform(70.0, 130.0)
    ccl = _ring(lambda step, r: 600.0 + delay[step, r])
    seven = exchange_arrivals(ccl)[7]
    assert (seven.margin_ns > 0.1 * seven.period_ns).sum() == 3  # what a fixed floor of a tenth of a step named
    assert [f for f in diagnose_window(ccl).faults if f.kind == "noncomm_slow"] == []


def _windows(job: str):
    """Windows 0 and 6 of a run: each one's findings, and as the pipeline weighs them in that order
    (``analyzers.links.history``)."""
    h = FindingHistory()
    ccl, tcp = _run("ccl_record", job), _run("tcp_flow", job)
    for w in (0, 6):
        faults = diagnose_window(ccl.filter(pc.equal(ccl["window_id"], w)),
                                 tcp=tcp.filter(pc.equal(tcp["window_id"], w))).faults
        yield faults, h.weigh((job, 0, w), faults)


def test_a_late_rank_the_first_window_missed_beside_a_cpu_hog_is_printed_where_every_step_shows_it():
    """Sweep 15 (issue 52): beside a CPU hog, window 0 of the ring's mild late rank 3 lost it in the job's jitter;
    window 6 had it last by 23% of the step in all 4 steps, and it stayed a hint at 0.45 (one window's late rank),
    not printed."""
    (_, w0), (_, w6) = _windows("late3_mild_hog")
    assert not [f for f in w0 if f.kind == "noncomm_slow" and f.src == 3 and f.confidence >= SEEN], w0[:3]
    top = w6[0]
    assert (top.kind, top.src) == ("noncomm_slow", 3) and top.confidence >= AlertConfig.link_shown_confidence, w6[:3]
    ev = top.evidence
    assert ev["persistence"]["first_seen"] and ev["late_steps"] == ev["steps"] >= LATE_STEADY_STEPS, ev
    assert ev["margin_share_of_step"] >= LATE_STEADY_SHARE, ev


@pytest.mark.parametrize("job", ["healthy_3", "healthy_hog"])
def test_a_healthy_rank_last_in_one_window_only_stays_a_hint(job):
    """Healthy rings with one rank last in one window only: ``healthy_3``'s rank 5 in all 4 steps of window 6 by 5%
    of the step, ``healthy_hog``'s rank 1 (beside a CPU hog) in 3 of 4 steps by 8%."""
    (_, w0), (raw6, w6) = _windows(job)
    late = [f for f in raw6 if f.kind == "noncomm_slow"]
    assert late and late[0].confidence >= AlertConfig.link_shown_confidence, raw6[:3]  # the window alone names it
    assert [f for f in w0 + w6 if f.confidence >= AlertConfig.link_shown_confidence] == [], (w0[:2], w6[:2])
