"""The hang detector on the jobs fleets run most (issue 55): who is named when a rank stops, dies, finishes early
or holds its lock; the threshold that adapts to the job's pace; checkpoints and pauses that are not hangs; the
end of a stall. Heartbeats are written as the exporter and the rank's watch write them."""
from __future__ import annotations

import json

from analyzers.hang import HangParams, HangTracker, hang_summary, to_tables
from core import codec
from core import schema as S

SEC = 10**9
NOW = 10_000 * SEC
PARAMS = HangParams()  # the defaults the pipeline runs with


def hb(rank, ts, *, step=50, last_end=None, op="", group="", seq=-1, since=-1, state="", quiet=400_000_000,
       step_done=None, host="vm", period=2.0):
    return dict(job_id="j", attempt=0, rank=rank, host=host, pid=100 + rank, ts_ns=ts, step=step, last_op="optimizer",
                last_op_end_ns=ts - SEC if last_end is None else last_end, inflight_op=op, inflight_group=group,
                inflight_seq=seq, inflight_since_ns=since, clock_offset_ns=0, stack="",
                step_done=step - 1 if step_done is None else step_done, step_done_ns=-1, proc_state=state,
                heartbeat_s=period, quiet_ns=quiet)


def feed(t: HangTracker, rows: list[dict]) -> HangTracker:
    t.add_heartbeats(codec.from_rows(S.HEARTBEAT, rows))
    return t


def ddp_job(stall_s: float, rank2: dict, world=4) -> HangTracker:
    """A 4-rank DDP job stalled for ``stall_s``: ranks other than 2 wait in DDP's gradient all-reduce (the
    tracer's ``waiting_in``: no sequence number), rank 2 as given."""
    last = NOW - int(stall_s * SEC)
    rows = [hb(r, NOW - SEC // 2, last_end=last, op="all_reduce", group="world", seq=-1, since=last + SEC // 10)
            for r in range(world) if r != 2]
    rows.append(hb(2, NOW - SEC // 2, last_end=last, **rank2))
    return feed(HangTracker("j", params=PARAMS), rows)


def test_a_stopped_ddp_rank_is_the_missing_rank_not_its_waiting_peers():
    t = ddp_job(12, dict(op="forward-compute", since=NOW - 12 * SEC, state="stopped"))
    h = t.evaluate(NOW, input_alive=True)
    assert h.kind == "comm_hang" and h.missing_ranks == [2] and h.stuck_ranks == [0, 1, 3]
    assert (h.group, h.seq, h.op) == ("world", -1, "all_reduce")
    assert h.evidence["states"] == {"2": "stopped"} and h.evidence["wait_chain"]["root"] == "2"
    [row] = to_tables([h], NOW)["hang"].to_pylist()
    assert hang_summary(row) == ("j: communication hang in all_reduce of group world for 12 s; missing ranks 2 "
                                 "(stopped) on vm")
    # The wait chain does not fold the stopped rank into its peers' row, and says whom they wait for.
    rows = {r["ranks"]: r for r in h.evidence["wait_chain"]["rows"]}
    assert rows["2"]["state"] == "stopped" and rows["0-1,3"]["waits_for"] == "2"


def test_a_ddp_rank_stuck_in_a_long_compute_is_the_one_awaited():
    t = ddp_job(12, dict(op="forward-compute", since=NOW - 12 * SEC))
    h = t.evaluate(NOW, input_alive=True)
    assert h.kind == "comm_hang" and h.missing_ranks == [2] and h.evidence["states"] == {}


def test_no_hang_before_the_job_s_own_threshold():
    # Ranks report a pace of 0.4 s: the threshold is min_s (8 s); 7 s of stall is nothing yet.
    t = ddp_job(7, dict(op="forward-compute", since=NOW - 7 * SEC, state="stopped"))
    assert t.threshold_s() == PARAMS.min_s
    assert t.evaluate(NOW, input_alive=True) is None


def test_the_threshold_adapts_to_the_job_s_pace():
    t = HangTracker("j", params=PARAMS)
    # The first steps: no pace reported yet, the floor.
    feed(t, [hb(r, NOW, quiet=-1) for r in range(4)])
    assert t.threshold_s() == PARAMS.floor_s
    feed(t, [hb(r, NOW + SEC, quiet=4 * SEC) for r in range(4)])
    assert t.threshold_s() == PARAMS.quiet_factor * 4
    feed(t, [hb(r, NOW + 2 * SEC, quiet=SEC // 10) for r in range(4)])
    assert t.threshold_s() == PARAMS.min_s
    # One odd rank does not set it: the median rank's pace does.
    feed(t, [hb(0, NOW + 3 * SEC, quiet=60 * SEC)])
    assert t.threshold_s() == PARAMS.min_s


def test_a_rank_0_checkpoint_behind_a_barrier_is_not_a_hang():
    """Rank 0 writes a checkpoint (torch.save, under trace: checkpoint-save in flight) while the others wait in
    the barrier after it: 70 s of it pages nobody."""
    last = NOW - 70 * SEC
    rows = [hb(0, NOW, last_end=last, op="checkpoint-save", since=last + SEC)]
    rows += [hb(r, NOW, last_end=last, op="barrier", group="world", seq=7, since=last + SEC) for r in (1, 2, 3)]
    t = feed(HangTracker("j", params=PARAMS), rows)
    assert t.threshold_s() == PARAMS.checkpoint_s
    assert t.evaluate(NOW, input_alive=True) is None


def stall_then_resume(t: HangTracker, at: int, seconds: float, step_done: int, doing: dict | None = None) -> int:
    """The job pauses for ``seconds`` from ``at`` after completing ``step_done``, evaluated every 2 s, then goes
    on. Returns the hangs reported during it."""
    hangs = 0
    ranks = range(4)
    for k in range(int(seconds // 2) + 1):
        now = at + k * 2 * SEC
        rows = [dict(hb(r, now, last_end=at, step=step_done + 1, step_done=step_done), **(doing or {}).get(r, {}))
                for r in ranks]
        feed(t, rows)
        h = t.evaluate(now, input_alive=True)
        hangs += h is not None and h.kind != "hang_ended"
    end = at + int(seconds * SEC)
    feed(t, [hb(r, end + SEC, last_end=end, step=step_done + 2, step_done=step_done + 1) for r in ranks])
    t.evaluate(end + SEC, input_alive=True)
    return hangs


def test_a_pause_that_recurs_every_n_steps_is_learned_as_the_job_s_own():
    """A checkpoint written some other way (no checkpoint-save in flight): rank 0 busy, the others in a
    barrier. The first pages; once it came back at the same interval, it is the job's own."""
    t = HangTracker("j", params=PARAMS)
    doing = {0: dict(op=""), **{r: dict(op="barrier", group="world", seq=-1) for r in (1, 2, 3)}}
    t0 = NOW
    assert stall_then_resume(t, t0, 30, step_done=99, doing=doing) == 1      # step 100: unknown, paged
    assert t.pauses and t.pauses[-1][0] == 99 and 29 <= t.pauses[-1][1] <= 31
    assert stall_then_resume(t, t0 + 500 * SEC, 30, step_done=199, doing=doing) == 0  # step 200: due, expected
    assert stall_then_resume(t, t0 + 1000 * SEC, 30, step_done=299, doing=doing) == 0  # 300: due
    # Off the interval, the same stall is a hang.
    assert stall_then_resume(t, t0 + 1500 * SEC, 30, step_done=333, doing=doing) == 1


def test_a_stall_that_ends_is_reported_as_ended_with_what_it_was():
    last = NOW - 20 * SEC
    rows = [hb(0, NOW, last_end=last, op="")] + [hb(r, NOW, last_end=last, op="barrier", group="world", seq=9,
                                                     since=last + SEC) for r in (1, 2, 3)]
    t = feed(HangTracker("j", params=PARAMS), rows)
    h = t.evaluate(NOW, input_alive=True)
    assert h.kind == "comm_hang" and h.missing_ranks == [0]
    assert t.evaluate(NOW + SEC, input_alive=True) is None  # reported once
    feed(t, [hb(r, NOW + 52 * SEC, last_end=NOW + 50 * SEC, step=52) for r in range(4)])
    end = t.evaluate(NOW + 52 * SEC, input_alive=True)
    assert end.kind == "hang_ended" and end.missing_ranks == [0] and round(end.duration_s) == 70
    [row] = to_tables([end], NOW + 52 * SEC)["hang"].to_pylist()
    assert hang_summary(row).startswith("j: the communication hang in barrier of group world ended after 70 s")
    assert "barrier (ranks 1-3)" in json.loads(row["evidence_json"])["what"]
    assert t.evaluate(NOW + 53 * SEC, input_alive=True) is None  # and said once


def test_a_rank_that_exited_while_its_peers_wait_is_a_process_loss():
    last = NOW - 20 * SEC
    rows = [hb(r, NOW, last_end=last, op="all_reduce", group="world", seq=5, since=last) for r in (0, 1, 3)]
    rows.append(hb(2, NOW - 10 * SEC, last_end=last, state="exited"))
    t = feed(HangTracker("j", params=PARAMS), rows)
    h = t.evaluate(NOW, input_alive=True)
    assert h.kind == "node_loss" and h.missing_ranks == [2] and h.op == "process exited"
    assert "process loss" in h.summary() and "ranks 2: process exited" in h.summary()


def test_a_job_stopped_by_its_launcher_is_not_a_loss():
    """Every rank exited within a moment (torchrun's teardown, a cancelled job): the job's end."""
    rows = [hb(r, NOW + r * SEC // 10, state="exited") for r in range(4)]
    t = feed(HangTracker("j", params=PARAMS), rows)
    assert t.evaluate(NOW + 60 * SEC, input_alive=True) is None


def test_a_rank_that_finished_early_is_the_one_its_peers_wait_for():
    """Uneven data: rank 3 ran out of batches and exited cleanly; the others wait for it in an all-reduce."""
    last = NOW - 20 * SEC
    rows = [hb(r, NOW, last_end=last, op="all_reduce", group="world", seq=40, since=last) for r in (0, 1, 2)]
    rows.append(hb(3, last, last_end=last, state="finished", step=39))
    t = feed(HangTracker("j", params=PARAMS), rows)
    h = t.evaluate(NOW, input_alive=True)
    assert h.kind == "comm_hang" and h.missing_ranks == [3] and h.evidence["states"] == {"3": "finished"}
    # A job whose every rank finished is done, not hung.
    t = feed(HangTracker("j", params=PARAMS), [hb(r, last, last_end=last, state="finished") for r in range(4)])
    assert t.evaluate(NOW + 600 * SEC, input_alive=True) is None


def test_a_rank_whose_lock_is_held_is_the_suspect_of_a_noncomm_stall():
    """Its own heartbeats stopped, its watch sees it running: unresponsive, not gone."""
    last = NOW - 12 * SEC
    rows = [hb(r, NOW, last_end=last, op="data-loading", since=last) for r in (0, 1, 3)]
    rows.append(hb(2, NOW, last_end=last, op="forward-compute", since=last + SEC, state="unresponsive"))
    h = feed(HangTracker("j", params=PARAMS), rows).evaluate(NOW, input_alive=True)
    assert h.kind == "noncomm_hang" and h.stuck_ranks == [2] and h.evidence["states"] == {"2": "unresponsive"}


def test_a_stopped_rank_becomes_a_process_loss_after_the_timeout_and_its_return_ends_it():
    t = ddp_job(12, dict(op="forward-compute", since=NOW - 12 * SEC, state="stopped"))
    assert t.evaluate(NOW, input_alive=True).kind == "comm_hang"
    # Still stopped 31 s after its watch first said so: a process loss.
    later = NOW + 31 * SEC
    feed(t, [hb(r, later, last_end=NOW - 12 * SEC, op="all_reduce", group="world", since=NOW - 11 * SEC)
             for r in (0, 1, 3)] + [hb(2, later, last_end=NOW - 12 * SEC, state="stopped")])
    h = t.evaluate(later, input_alive=True)
    assert h.kind == "node_loss" and h.op == "process stopped" and h.missing_ranks == [2]
    # SIGCONT: it reports again and the job moves: the first hang's end is reported.
    back = later + 5 * SEC
    feed(t, [hb(r, back, last_end=back - SEC, step=51) for r in range(4)])
    end = t.evaluate(back, input_alive=True)
    assert end.kind == "hang_ended" and end.missing_ranks == [2]


def test_old_records_without_the_new_fields_still_work():
    """Exporters before schema 8 send no pace, period or state: the floor and the 5 s period apply."""
    rows = [{k: v for k, v in hb(r, NOW, last_end=NOW - 50 * SEC).items()
             if k not in ("proc_state", "heartbeat_s", "quiet_ns")} for r in range(4)]
    t = feed(HangTracker("j", params=PARAMS), rows)
    assert t.threshold_s() == PARAMS.floor_s
    assert t.evaluate(NOW, input_alive=True).kind == "noncomm_hang"


def test_a_lost_node_s_every_rank_is_missing_even_where_the_chain_reaches_only_one():
    """A DP2 x PP2 pipeline whose second node (ranks 2 and 3, stage 1) froze: rank 0 waits for its transfer
    from rank 2, rank 1 for rank 3's; the chain from the longest wait reaches rank 2 alone (benchmark run)."""
    last = NOW - 12 * SEC
    rows = [hb(0, NOW, last_end=last, op="recv", group="p2p:2>0", seq=40, since=last),
            hb(1, NOW, last_end=last, op="recv", group="p2p:3>1", seq=40, since=last + SEC),
            hb(2, NOW - 9 * SEC, last_end=last), hb(3, NOW - 9 * SEC, last_end=last)]
    h = feed(HangTracker("j", params=PARAMS), rows).evaluate(NOW, input_alive=True)
    assert h.kind == "comm_hang" and h.missing_ranks == [2, 3] and h.stuck_ranks == [0, 1]
    assert h.evidence["states"] == {"2": "silent", "3": "silent"}


def test_stacks_dumped_in_a_pause_the_rank_came_out_of_are_not_its_stacks_now():
    """A slow first step made rank 2 dump its stacks; it went on, then stopped (SIGSTOP cannot dump): the hang's
    merged stacks are its peers' alone and rank 2 is named as having none (a console showed the old ones)."""
    t = HangTracker("j", params=PARAMS)
    early, last = NOW - 60 * SEC, NOW - 12 * SEC
    feed(t, [hb(2, early, step=1, last_end=early - 5 * SEC, op="forward-compute", since=early - 4 * SEC)
             | dict(stack="MainThread;train.py:main:10;rendezvous.py:wait:3")])
    waiting = dict(stack="MainThread;train.py:main:12;ddp.py:wait:7")
    feed(t, [hb(r, NOW - SEC // 2, last_end=last, op="all_reduce", group="world", since=last + SEC // 10) | waiting
             for r in (0, 1, 3)]
         + [hb(2, NOW - SEC // 2, last_end=last, op="forward-compute", since=last, state="stopped")])
    h = t.evaluate(NOW, input_alive=True)
    assert h.kind == "comm_hang" and h.missing_ranks == [2], h
    assert h.evidence["ranks_with_stacks"] == "0-1,3" and "rendezvous" not in h.evidence["stacks_folded"]
