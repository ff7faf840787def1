"""The shard's boundary checks one by one (``ray_jobs.boundary``); tests/unit/test_bad_input.py runs them in a shard."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from analyzers.clock_skew import ClockSkew, worker_clock_skew
from analyzers.window import analyze_window
from core import codec
from core import schema as S
from core.config import ValidationConfig
from core.layout import JobLayout
from core.registration import Registration
from generators.fleetgen import JobSpec, generate_window
from ray_jobs import boundary as B

LIMITS = ValidationConfig()
S_NS = 10**9
HOUR_NS = 3600 * S_NS
T0 = 1_700_000_000 * S_NS


# -- registrations ---------------------------------------------------------------------------------------------
def registration(job_id="j"):
    return JobSpec(job_id, JobLayout(dp_size=2, pp_size=2), num_microbatches=4).registration(T0, 2).to_pylist()[0]


def test_a_registration_without_a_kafka_key_is_refused_like_an_op_span():
    """It was stored: a keyless record can reach a shard that holds none of its job's records."""
    why = B.check_registration(registration("j"), None, LIMITS)
    assert why == "no Kafka key (Kafka key)"
    ops = generate_window(JobSpec("j", JobLayout(2, 2), num_microbatches=4), 0, 1, T0)
    assert B.check_op_spans(ops, None, None, LIMITS).reason.endswith(why)


@pytest.mark.parametrize("key, reason", [("other", "job_id differs from the Kafka key 'other'"),
                                         ("", "job id is empty (Kafka key)"),
                                         ("a b", "characters outside")])
def test_a_registration_needs_the_key_its_job_id_names(key, reason):
    assert reason in B.check_registration(registration("j"), key, LIMITS)


def test_a_registration_read_back_from_the_store_has_no_key_to_check():
    assert B.check_registration(registration("j"), None, LIMITS, stored=True) == ""
    assert B.check_registration(registration("j"), "j", LIMITS) == ""
    assert "layout sizes" in B.check_registration(dict(registration("j"), dp_size=0), None, LIMITS, stored=True)


# -- ClockGuard -------------------------------------------------------------------------------------------------
def heartbeat(job, rank, ts, host="h"):
    return codec.from_rows(S.HEARTBEAT, [dict(
        job_id=job, attempt=0, rank=rank, host=host, pid=1, ts_ns=ts, step=3, last_op="optimizer",
        last_op_end_ns=ts - S_NS, inflight_op="", inflight_group="", inflight_seq=-1, inflight_since_ns=-1,
        clock_offset_ns=0, stack="", step_done=2, step_done_ns=ts - S_NS)])


@pytest.mark.parametrize("skew_ns", [86400 * S_NS - T0, 3 * HOUR_NS], ids=["in 1970", "3 h ahead"])
def test_a_skewed_rank_is_put_on_its_peers_time_not_on_the_arrival_time(skew_ns):
    """The input lags 50 s: rank 0's honest heartbeat arrives 50 s after it was sent, so rank 1's, sent with it,
    must read 50 s old too. Put at its arrival, it read 50 s fresher than rank 0 (the wrong node-loss page)."""
    g = B.ClockGuard(LIMITS)
    sent, arrival = T0, T0 + 50 * S_NS
    assert g.correct_heartbeats(heartbeat("j", 0, sent), arrival)["ts_ns"][0].as_py() == sent
    fixed = g.correct_heartbeats(heartbeat("j", 1, sent + skew_ns), arrival + 10**6)
    assert fixed["ts_ns"][0].as_py() == sent + 10**6
    assert fixed["last_op_end_ns"][0].as_py() == sent + 10**6 - S_NS
    assert g.skew[("j", 0, 1)] == skew_ns - 10**6


def test_a_job_with_no_plausible_clock_takes_the_delay_of_the_rest_of_the_input():
    g = B.ClockGuard(LIMITS)
    g.correct_heartbeats(heartbeat("other", 0, T0), T0 + 40 * S_NS)
    fixed = g.correct_heartbeats(heartbeat("j", 0, S_NS), T0 + 40 * S_NS)
    assert fixed["ts_ns"][0].as_py() == T0


def test_before_any_plausible_clock_there_is_nothing_to_measure_a_skew_against():
    """A shard starting on a backlog: a 1970 heartbeat read first, put at its arrival, would read as the freshest
    of the backlog (and newer than its own next heartbeats, which the hang tracker then drops as out of order)."""
    g = B.ClockGuard(LIMITS)
    first = g.correct_heartbeats(heartbeat("j", 1, S_NS * 86400), T0)
    assert first["ts_ns"][0].as_py() == S_NS * 86400 and not g.skew  # left as it is: the checks refuse it
    assert B.check_heartbeats(first, "j", None, LIMITS, T0).refused
    g.correct_heartbeats(heartbeat("j", 0, T0 - 300 * S_NS), T0)  # the backlog is 5 minutes behind
    assert g.correct_heartbeats(heartbeat("j", 1, S_NS * 86400), T0)["ts_ns"][0].as_py() == T0 - 300 * S_NS
    blind = B.ClockGuard(LIMITS)  # every clock the shard hears is wrong: arrival becomes the reference
    fixed = [blind.correct_heartbeats(heartbeat("j", 0, S_NS * (86400 + k)), T0 + k * S_NS)["ts_ns"][0].as_py()
             for k in range(B.ClockGuard._BLIND_ROWS + 2)]
    assert fixed[B.ClockGuard._BLIND_ROWS - 1] < T0 and fixed[-1] == T0 + (B.ClockGuard._BLIND_ROWS + 1) * S_NS


def test_one_skew_per_rank_and_table_keeps_the_spacing_of_its_heartbeats():
    """An exporter's spooled heartbeats, sent together: each at the arrival time, they all read as one instant."""
    g = B.ClockGuard(LIMITS)
    g.correct_heartbeats(heartbeat("j", 0, T0), T0)
    spooled = pa.concat_tables([heartbeat("j", 1, S_NS + k * 5 * S_NS) for k in range(4)])
    fixed = g.correct_heartbeats(spooled, T0)
    assert fixed["ts_ns"].to_pylist() == [T0 - 15 * S_NS, T0 - 10 * S_NS, T0 - 5 * S_NS, T0]


def test_collectives_and_checkpoints_of_a_skewed_rank_are_shifted_by_its_skew():
    g = B.ClockGuard(LIMITS)
    g.correct_heartbeats(heartbeat("j", 0, T0), T0)
    g.correct_heartbeats(heartbeat("j", 1, S_NS), T0)
    ckpt = codec.from_rows(S.CHECKPOINT, [dict(job_id="j", attempt=0, rank=r, step=1, ts_ns=S_NS // 2,
                                               duration_ns=S_NS, kind="save") for r in (1, 0)])
    assert g.correct_checkpoints(ckpt)["ts_ns"].to_pylist() == [T0 - S_NS // 2, S_NS // 2]
    ccl = codec.from_rows(S.CCL_RECORD, [dict(
        job_id="j", attempt=0, rank=1, host="h", window_id=-1, step=1, group="world", group_ranks=[0, 1], seq=1,
        op="all_reduce", algorithm="ring", nbytes=1, enter_ns=S_NS // 2, exit_ns=-1, peers=[0],
        peer_transfer_ns=[1], peer_bytes=[1], recv_wait_ns=0)])
    fixed = g.correct_ccl(ccl)
    assert (fixed["enter_ns"][0].as_py(), fixed["exit_ns"][0].as_py()) == (T0 - S_NS // 2, -1)


# -- a window's worker clocks ----------------------------------------------------------------------------------
def window(dp=2, pp=2, shifted=(), job_id="skewed"):
    """Op spans of a window of a dp x pp job; ``shifted``: ((dp_rank, pp_rank), ns added to its times)."""
    t = generate_window(JobSpec(job_id, JobLayout(dp_size=dp, pp_size=pp), num_microbatches=4), 0, 3, T0)
    start = t["start_ns"]
    for (d, p), by in shifted:
        one = pc.and_(pc.equal(t["dp_rank"], d), pc.equal(t["pp_rank"], p))
        start = pc.if_else(one, pc.add(start, by), start)
    i = t.column_names.index("start_ns")
    return t.set_column(i, t.field(i), start)


def offsets(skew):
    return {w: round(off, 1) for w, off in skew.workers}


def test_each_shifted_worker_is_named_with_its_own_offset_to_the_others():
    """Two of four workers 3 h ahead: the median of all four sat halfway, so the note said +5400 s and named one."""
    skew = worker_clock_skew(window(shifted=[((1, 0), 3 * HOUR_NS), ((1, 1), 3 * HOUR_NS)]))
    assert skew.describe() == "dp1/pp0 +10800.0 s, dp1/pp1 +10800.0 s off the other workers"
    assert 1.0 <= skew.threshold_s < 60


def test_shifts_of_either_sign_are_measured_against_the_majority():
    skew = worker_clock_skew(window(dp=4, pp=2, shifted=[((1, 0), 3 * HOUR_NS), ((2, 1), 3 * HOUR_NS),
                                                           ((3, 1), -50 * 365 * 24 * HOUR_NS)]))
    assert offsets(skew) == {(1, 0): 10800.0, (2, 1): 10800.0, (3, 1): -50 * 365 * 24 * 3600.0}


@pytest.mark.parametrize("who, want", [((1, 0), {(1, 0): 10800.0}), ((0, 0), {(0, 0): 10800.0})])
def test_one_worker_of_four(who, want):
    assert offsets(worker_clock_skew(window(shifted=[(who, 3 * HOUR_NS)]))) == want


def test_with_no_majority_the_workers_are_measured_against_rank_0s_clock():
    """Two workers: pairwise, and rank 0's is the job clock (the exporters align the other clocks to it)."""
    assert offsets(worker_clock_skew(window(dp=2, pp=1, shifted=[((1, 0), 3 * HOUR_NS)]))) == {(1, 0): 10800.0}
    assert offsets(worker_clock_skew(window(dp=2, pp=1, shifted=[((0, 0), 3 * HOUR_NS)]))) == {(1, 0): -10800.0}


def test_a_window_of_agreeing_clocks_has_no_skew():
    assert worker_clock_skew(window(dp=4, pp=4)) is None
    assert worker_clock_skew(window(shifted=[((1, 0), S_NS // 100)])) is None  # 10 ms: a DP wait, not a clock


def test_the_window_note_lists_every_shifted_worker():
    t = window(shifted=[((1, 0), 3 * HOUR_NS), ((1, 1), 3 * HOUR_NS)])
    info = Registration.from_row(registration("skewed"))
    (row,) = analyze_window(t, info, ("skewed", 0, 0), True, "")["window"].to_pylist()
    assert row["verdict"] == "clock_skew" and not row["complete"] and row["gpu_hours"] == 0
    assert "dp1/pp0 +10800.0 s, dp1/pp1 +10800.0 s off the other workers" in row["note"]


def test_a_long_list_of_shifted_workers_is_cut_in_the_note():
    skew = ClockSkew(tuple(((d, 0), 10800.0) for d in range(20)), 2.0)
    assert skew.describe() == ", ".join(f"dp{d}/pp0 +10800.0 s" for d in range(8)) + \
        ", 12 more workers off the other workers"
