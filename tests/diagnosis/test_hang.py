"""Hang detection on generated incidents and on hand-made edge cases."""
import pytest

from core import codec
from core import schema as S

from analyzers.hang import HangParams, HangTracker, _Rank, to_tables
from analyzers.stacks import merge_stacks
from generators.faultgen import hang_incident

PARAMS = HangParams(floor_s=60, k_steps=10, heartbeat_timeout_s=30)


def tracker_for(inc):
    t = HangTracker("hangjob", params=PARAMS)
    t.add_ccl(inc.ccl)
    t.add_heartbeats(inc.heartbeats)
    return t


@pytest.mark.parametrize("n", [8, 64, 1024])
@pytest.mark.parametrize("kind", ["comm_hang", "noncomm_hang", "node_loss"])
def test_classifies_and_names_the_ranks(kind, n):
    for seed in range(3):
        inc = hang_incident(kind, n, seed)
        hang = tracker_for(inc).evaluate(inc.now_ns, input_alive=True)
        assert hang is not None and hang.kind == kind
        assert hang.missing_ranks == inc.truth["missing"]
        if kind != "node_loss":
            assert hang.stuck_ranks == inc.truth["stuck"]
        assert inc.truth["host"] in hang.suspect_hosts
        assert hang.duration_s >= 60


@pytest.mark.parametrize("n", [8, 1024])
def test_a_progressing_job_is_not_hung(n):
    for seed in range(3):
        inc = hang_incident("healthy", n, seed)
        assert tracker_for(inc).evaluate(inc.now_ns) is None


def test_threshold_follows_the_step_time():
    t = HangTracker("j", params=HangParams(floor_s=10, k_steps=10))
    t.ranks[0] = _Rank(step=3)
    assert t.threshold_s() == 10
    t.step_times = [5.0] * 10
    assert t.threshold_s() == 50


def test_reported_once_until_it_changes():
    inc = hang_incident("comm_hang", 16, 0)
    t = tracker_for(inc)
    assert t.evaluate(inc.now_ns) is not None
    assert t.evaluate(inc.now_ns + 10**9) is None


def test_row_and_wait_chain():
    inc = hang_incident("comm_hang", 16, 3)
    hang = tracker_for(inc).evaluate(inc.now_ns)
    culprit = inc.truth["missing"][0]
    [row] = to_tables([hang], inc.now_ns)["hang"].to_pylist()
    assert row["missing_ranks"] == str(culprit)
    chain = hang.evidence["wait_chain"]
    assert chain["root"] == str(culprit)
    waiting = [r for r in chain["rows"] if r["waits_for"] == str(culprit)]
    assert waiting and waiting[0]["op"] == "all_reduce"
    assert "communication hang" in hang.summary()


def test_merged_stacks_name_ranks_in_and_out():
    stacks = {r: "MainThread;train.py:main:10;train.py:step:20;dist:all_reduce:5" for r in (0, 1, 3)}
    stacks[2] = "MainThread;train.py:main:10;train.py:step:22;data.py:load:7"
    m = merge_stacks(stacks)
    text = m.folded()
    assert "dist:all_reduce:5 [ranks 0-1,3 | not 2]" in text
    assert "data.py:load:7 [ranks 2 | not 0-1,3]" in text
    svg = m.svg()
    assert svg.startswith("<svg") and "data.py:load:7" in svg


def test_a_silent_job_is_not_node_loss_while_our_input_may_be_down():
    """Every rank silent while our input may be down proves nothing: no loss, and no stall of silent ranks."""
    inc = hang_incident("node_loss", 8, 0)  # one host: every rank silent
    assert tracker_for(inc).evaluate(inc.now_ns, input_alive=False) is None
    assert tracker_for(inc).evaluate(inc.now_ns, input_alive=True).kind == "node_loss"


@pytest.mark.parametrize("name, members", [("world", {0, 1, 2, 3}), ("ranks:0-1,3", {0, 1, 3}), ("p2p:2>3", {2, 3})])
def test_group_members_from_exporter_names(name, members):
    from analyzers.hang import group_members

    assert group_members(name, [0, 1, 2, 3]) == members


def test_a_silent_process_on_a_live_host_is_the_missing_rank_then_a_process_loss():
    import pyarrow as pa

    # A SIGSTOPped rank without its watch: its heartbeats stop, but its host's other ranks still report.
    inc = hang_incident("comm_hang", 16, 2, ranks_per_host=16)
    culprit = inc.truth["missing"][0]
    hb = inc.heartbeats

    def silent_for(seconds):
        ts = hb["ts_ns"].to_numpy().copy()
        ts[culprit] = inc.now_ns - seconds * 10**9
        t = HangTracker("hangjob", params=PARAMS)
        t.add_ccl(inc.ccl)
        t.add_heartbeats(hb.set_column(hb.schema.get_field_index("ts_ns"), "ts_ns", pa.array(ts)))
        return t.evaluate(inc.now_ns, input_alive=True)

    # Silent 20 s (over three of the 5 s periods these ranks report at), within the heartbeat timeout: the
    # stall names it, and says it is silent.
    hang = silent_for(20)
    assert hang.kind == "comm_hang" and hang.missing_ranks == [culprit]
    assert hang.evidence["states"] == {str(culprit): "silent"}
    assert f"missing ranks {culprit} (silent)" in hang.summary()
    # Silent past the timeout: a process loss (its host still reports), the docs' node or process loss.
    hang = silent_for(200)
    assert hang.kind == "node_loss" and hang.missing_ranks == [culprit] and hang.op == "process silent"
    assert "process loss" in hang.summary()


def test_the_chain_is_followed_to_the_rank_that_waits_for_nobody():
    """Rank 2 has waited longest, on rank 0; but rank 0 waits inside a collective for rank 1 (stopped)."""

    from core import codec
    from core import schema as S

    now = 1_000 * 10**9
    s = 10**9

    def hb(rank, ts, group, seq, since, op="recv"):
        return dict(job_id="j", attempt=0, rank=rank, host="h0", pid=rank, ts_ns=ts, step=6, last_op="x",
                    last_op_end_ns=now - 200 * s, inflight_op=op if group else "", inflight_group=group,
                    inflight_seq=seq, inflight_since_ns=since, clock_offset_ns=0, stack="")
    rows = [hb(0, now, "ranks:0-1", 12, now - 190 * s, "all_reduce"),
            hb(1, now - 10 * s, "ranks:0-1", 11, now - 196 * s, "all_reduce"),  # stopped: silent 10 s
            hb(2, now, "p2p:0>2", 40, now - 199 * s),
            hb(3, now, "p2p:1>3", 40, now - 198 * s)]
    t = HangTracker("j", params=PARAMS)
    t.add_heartbeats(codec.from_rows(S.HEARTBEAT, rows))
    # Rank 0 sent 39 messages to rank 2 and rank 1 completed all-reduce 11.
    t.add_ccl(codec.from_rows(S.CCL_RECORD, [
        dict(job_id="j", attempt=0, rank=0, window_id=-1, step=5, group="p2p:0>2", group_ranks=[0, 2], seq=39,
             op="send", algorithm="", nbytes=1, enter_ns=now - 201 * s, exit_ns=now - 200 * s, peers=[],
             peer_transfer_ns=[], peer_bytes=[], recv_wait_ns=0),
        dict(job_id="j", attempt=0, rank=1, window_id=-1, step=5, group="ranks:0-1", group_ranks=[0, 1], seq=11,
             op="all_reduce", algorithm="", nbytes=1, enter_ns=now - 201 * s, exit_ns=now - 200 * s, peers=[],
             peer_transfer_ns=[], peer_bytes=[], recv_wait_ns=0)]))
    hang = t.evaluate(now, input_alive=True)
    assert hang.kind == "comm_hang"
    assert hang.missing_ranks == [1] and (hang.group, hang.seq) == ("ranks:0-1", 12)
    assert hang.stuck_ranks == [0, 2, 3]


def test_a_lagging_input_is_judged_as_of_its_newest_heartbeat():
    """A backlog (records older than the wall clock) must not read as every job being hung."""
    from ray_jobs.hang_monitor import HangReducer

    inc = hang_incident("healthy", 8, 0, job_id="lagging")
    mon = HangReducer(HangParams(floor_s=60), every_s=0.0)
    mon.add_ccl(inc.ccl, 0.0)
    mon.add_heartbeats(inc.heartbeats, 0.0)
    # The same data evaluated ten minutes of wall clock later: the input lags, nothing is hung.
    assert mon.evaluate(1.0, inc.now_ns + 600 * 10**9).num_rows == 0


def test_a_starting_job_gets_the_startup_threshold_not_the_floor():
    """Before the first step (heartbeats say step -1), ranks that wait for slower starters are not hung."""
    from core import codec
    from core import schema as S

    s = 10**9
    params = HangParams(floor_s=4, k_steps=10, heartbeat_timeout_s=3, startup_s=30)

    def hb(rank, ts, step):
        return dict(job_id="j", attempt=0, rank=rank, host="h0", pid=rank, ts_ns=ts, step=step, last_op="",
                    last_op_end_ns=0, inflight_op="", inflight_group="", inflight_seq=-1, inflight_since_ns=-1,
                    clock_offset_ns=0, stack="")

    t = HangTracker("j", params=params)
    t.add_heartbeats(codec.from_rows(S.HEARTBEAT, [hb(0, r * s // 2, -1) for r in range(63)]))
    assert t.threshold_s() == 30
    assert t.evaluate(10 * s, input_alive=True) is None  # 10 s of start-up: past the floor, not a hang
    hang = t.evaluate(31 * s, input_alive=True)
    assert hang is not None and hang.kind == "noncomm_hang"  # stuck in start-up for longer than startup_s
    t.add_heartbeats(codec.from_rows(S.HEARTBEAT, [hb(0, 32 * s, 0)]))
    assert t.threshold_s() == 4  # training began: the floor (and the step time) rule again


# -- a rank with a wrong clock, corrected at the shard's boundary, then lost ----------------------------------
_WALL0 = 1_760_000_000 * 10**9  # the shard's wall clock when the job starts
_CLOCKS = {"in 1970": 10**9 - _WALL0, "3 h ahead": 3 * 3600 * 10**9}


def _hb(job, rank, host, ts, step, **more):
    from core import codec
    from core import schema as S

    s = 10**9
    return codec.from_rows(S.HEARTBEAT, [dict(
        job_id=job, attempt=0, rank=rank, host=host, pid=100 + rank, ts_ns=ts, step=step, last_op="optimizer",
        last_op_end_ns=ts - s // 2, inflight_op="", inflight_group="", inflight_seq=-1, inflight_since_ns=-1,
        clock_offset_ns=0, stack="", step_done=step - 1, step_done_ns=ts - s // 2, **more)])


def _through_the_boundary(skew_ns, delay_s, silent_from=24, beats=60, skewed_first=False):
    """What the shard does with heartbeats: ``ClockGuard`` corrects them, ``check_heartbeats`` checks them, the
    ``HangReducer`` tracks them. Job "j": rank 0 on hostA (a good clock) and rank 1 on hostB (off by ``skew_ns``),
    a heartbeat every 5 s each; rank 1's node is lost after ``silent_from`` beats. Job "other" (one host, good
    clocks) shares the shard and keeps running. Each heartbeat reaches the shard ``delay_s`` after it was sent
    (``delay_s[i]`` for beat i: a consumer lag, a backlog replayed in a burst); ``skewed_first``: rank 1's
    heartbeat is read before the others' in each beat (the shard's very first heartbeat is a wrong clock's).
    Returns the HANG rows."""
    from core.config import ValidationConfig
    from ray_jobs import boundary as B
    from ray_jobs.hang_monitor import HangReducer
    from tests.fakes import ManualClock

    s = 10**9
    limits = ValidationConfig()
    guard = B.ClockGuard(limits)
    wall = [_WALL0]
    mon = HangReducer(HangParams(floor_s=120, heartbeat_timeout_s=30), every_s=0.0,
                      clock=ManualClock(wall=lambda: wall[0]))
    rows = []
    for i in range(beats):
        sent = _WALL0 + i * 5 * s
        beat = [("j", 0, "hostA", 0), ("j", 1, "hostB", skew_ns), ("other", 0, "hostC", 0), ("other", 1, "hostC", 0)]
        if skewed_first:
            beat = beat[1:2] + beat[:1] + beat[2:]
        for job, rank, host, skew in beat:
            if (job, rank) == ("j", 1) and i >= silent_from:
                continue
            wall[0] = max(wall[0], sent + int(delay_s(i) * s))
            fixed = guard.correct_heartbeats(_hb(job, rank, host, sent + skew, i), wall[0])
            split = B.check_heartbeats(fixed, job, None, limits, wall[0])
            assert not split.refused or (i, rank, skewed_first) == (0, 1, True), split.reason
            mon.add_heartbeats(split.good, wall[0] / 1e9)
        rows += mon.evaluate(wall[0] / 1e9 + 1e-3, wall[0]).to_pylist()
    for k in range(1, 13):  # the input is idle after the last beat: evaluations go on
        rows += mon.evaluate(wall[0] / 1e9 + k, wall[0] + k * s).to_pylist()
    return rows


@pytest.mark.parametrize("clock", list(_CLOCKS))
@pytest.mark.parametrize("delivery", ["live", "lagging 45 s", "backlog in a burst", "skewed rank read first"])
def test_node_loss_names_the_lost_rank_whose_clock_was_corrected(clock, delivery):
    """The tester's incident: rank 1 (hostB) stamps its heartbeats in 1970, the boundary corrects them, rank 1's
    node is lost, and the page named rank 0 on hostA. The correction put each of rank 1's heartbeats at its arrival
    time, while rank 0's honest times trail arrival by the input's delay: under a lag longer than the heartbeat
    timeout the healthy rank read as the silent one (and the hang monitor's held-back clock, pushed to the wall by
    rank 1, judged every lagging job of the shard against the wall). A backlog read in a burst made the lost rank
    look alive instead: all its old heartbeats arrived "now". Read first, before any plausible clock, a wrong
    clock's heartbeat has nothing to be measured against: it is refused, not put at its arrival."""
    burst = lambda i: 300.0 - i * 5.0 + 0.01 * i  # noqa: E731
    delay = {"live": lambda i: 0.05, "lagging 45 s": lambda i: 45.0, "backlog in a burst": burst,
             "skewed rank read first": burst}[delivery]
    rows = _through_the_boundary(_CLOCKS[clock], delay, skewed_first=delivery == "skewed rank read first")
    assert [(r["job_id"], r["kind"], r["missing_ranks"], r["suspect_hosts"]) for r in rows] == \
        [("j", "node_loss", "1", "hostB")], rows
    # Rank 1's last beat was number 23, at 115 s. Its corrected time is measured against its peer's latest
    # heartbeat, which during a burst is up to one heartbeat interval (5 s) older than rank 1's.
    assert rows[0]["since_ns"] == pytest.approx(_WALL0 + 115 * 10**9, abs=6 * 10**9)


def _phased(lag_s, beats=40):
    """Two jobs on two hosts each, honest clocks, each rank's heartbeat at its own phase of the 5 s period, all of
    them reaching the shard ``lag_s`` late; the HANG rows the monitor emits."""
    from ray_jobs.hang_monitor import HangReducer
    from tests.fakes import ManualClock

    s = 10**9
    wall = [_WALL0]
    mon = HangReducer(HangParams(floor_s=120, heartbeat_timeout_s=30), every_s=0.0,
                      clock=ManualClock(wall=lambda: wall[0]))
    ranks = [("j", 0, "hostA", 0.0), ("j", 1, "hostB", 2.5), ("k", 0, "hostC", 1.0), ("k", 1, "hostD", 4.0)]
    rows = []
    for i in range(beats):
        for job, rank, host, phase in sorted(ranks, key=lambda x: x[3]):
            sent = _WALL0 + int((i * 5 + phase) * s)
            wall[0] = sent + int(lag_s * s)
            mon.add_heartbeats(_hb(job, rank, host, sent, i), wall[0] / 1e9)
            rows += mon.evaluate(wall[0] / 1e9 + 1e-3, wall[0]).to_pylist()
    return rows


def test_a_lagging_input_does_not_page_the_ranks_of_a_job_behind_its_newest_heartbeat():
    """Input 45 s late, every clock right: a rank whose heartbeat is 2.5 s older than its peer's was called lost
    (node loss, the healthy host named), the pages flipping between the job's hosts at every heartbeat. Within a job
    the tracker now compares its ranks with each other. (Whole jobs read as silent are the next test's.)"""
    assert [r for r in _phased(45.0) if r["stuck_ranks"]] == []  # node loss naming some ranks while others report
    assert _phased(0.05) == []


def test_a_lagging_input_pages_no_job():
    """Input 45 s late: every job's newest heartbeat is older than the shard's newest one, and the evaluation
    clock, held at the newest heartbeat plus the timeout, read whole jobs as silent. It now runs on from the
    newest heartbeat only by the wall time since that arrived."""
    assert _phased(45.0) == []


@pytest.mark.parametrize("ahead_s", [60, 300])
def test_a_peer_clock_ahead_within_the_tolerance_does_not_make_a_reporting_rank_look_lost(ahead_s):
    """Rank 1's clock is minutes ahead, inside validation.max_clock_skew_s (so not corrected), the input live:
    rank 0 is not 'silent' for the minutes by which rank 1's stamps run ahead of the evaluation clock."""
    rows = _through_the_boundary(ahead_s * 10**9, lambda i: 0.05, silent_from=1000, beats=30)
    assert rows == []


def test_a_rank_inside_a_checkpoint_save_is_given_checkpoint_s_not_the_floor():
    """Issue 41: the floor is 45 s so a hang is named within a minute; a save says it is one and gets longer."""
    def beat(rank, ts, inflight="", since=-1):
        return dict(job_id="j", attempt=0, rank=rank, host=f"h{rank}", pid=1, ts_ns=ts, step=5,
                    last_op="optimizer", last_op_end_ns=0, inflight_op=inflight, inflight_group="", inflight_seq=-1,
                    inflight_since_ns=since, clock_offset_ns=0, stack="", step_done=4, step_done_ns=0)

    s = 10**9
    params = HangParams()
    assert params.floor_s == 45.0
    for inflight, hung_at in (("", 45), ("checkpoint-save", 900)):  # no op has ended since 0
        t = HangTracker("j", params=params)
        t.add_heartbeats(codec.from_rows(S.HEARTBEAT, [beat(r, 1 * s, inflight if r == 0 else "", 0)
                                                        for r in range(4)]))
        for now in range(2, 1000):
            t.add_heartbeats(codec.from_rows(S.HEARTBEAT, [beat(r, now * s, inflight if r == 0 else "", 0)
                                                            for r in range(4)]))
            if t.evaluate(now * s, input_alive=True) is not None:
                break
        assert now == hung_at, (inflight, now)


def _backlog(finished: bool, partition_read_last_unread: bool = True):
    """A shard reading a backlog ten minutes old, one partition after the other (as a consumer may): job "busy"
    (partition 0) reported for 600 s; job "ended" (partition 1) for 60 s, then, if ``finished``, its ranks said
    so (else they fell silent: its node was lost). Partition 0 is read first, to its end; partition 1 after it,
    unread until then (``partition_read_last_unread``: what the source says). Returns the HANG rows."""
    from core import codec
    from core import schema as S
    from ray_jobs.hang_monitor import HangReducer
    from tests.fakes import ManualClock

    s = 10**9
    wall = [_WALL0 + 700 * s]
    mon = HangReducer(HangParams(floor_s=120, heartbeat_timeout_s=30), every_s=0.0,
                      clock=ManualClock(wall=lambda: wall[0]))
    busy, ended = ("ss.heartbeats", 0), ("ss.heartbeats", 1)

    def beats(job, host, until_s, state=""):
        return [dict(_hb(job, rank, host, _WALL0 + t * s, t // 5).to_pylist()[0], proc_state=state)
                for t in range(0, until_s, 5) for rank in (0, 1)]

    late = beats("ended", "hostE", 60) + ([dict(r, ts_ns=_WALL0 + 61 * s, proc_state="finished")
                                           for r in beats("ended", "hostE", 5)] if finished else [])
    rows = []
    mon.unread = {busy, ended} if partition_read_last_unread else {busy}
    for i, row in enumerate(beats("busy", "hostB", 600)):
        mon.add_heartbeats(codec.from_rows(S.HEARTBEAT, [row]), wall[0] / 1e9, busy)
        if i == 0:  # the ended job's first heartbeats were read in the first fetch, before partition 0's rest
            mon.add_heartbeats(codec.from_rows(S.HEARTBEAT, late[:2]), wall[0] / 1e9, ended)
        wall[0] += s // 100
        rows += mon.evaluate(wall[0] / 1e9, wall[0]).to_pylist()
    mon.unread = {ended}
    for row in late[2:]:
        mon.add_heartbeats(codec.from_rows(S.HEARTBEAT, [row]), wall[0] / 1e9, ended)
        wall[0] += s // 100
        rows += mon.evaluate(wall[0] / 1e9, wall[0]).to_pylist()
    mon.unread = set()  # caught up; the busy job keeps reporting, live
    for k in range(60):
        wall[0] += s
        for rank in (0, 1):
            mon.add_heartbeats(_hb("busy", rank, "hostB", wall[0], 200 + k), wall[0] / 1e9, busy)
        rows += mon.evaluate(wall[0] / 1e9, wall[0]).to_pylist()
    return rows


def test_a_backlog_read_one_partition_after_another_pages_no_job_that_finished():
    """Seen in the whole suite: each test module's pipeline read the shared broker from its start, and every
    traced job of the modules before it, long finished, was paged critical as a node loss ("missing ranks 0-3
    (silent)"): judged by the clock of the partitions read first, their own "finished" heartbeats not read yet.
    A job on a partition with records still unread is judged as of what was read of that partition."""
    assert [(r["job_id"], r["kind"]) for r in _backlog(finished=True)] == []
    # Without knowing which partitions are behind (the clock of before), the same backlog pages the ended job.
    assert ("ended", "node_loss") in [(r["job_id"], r["kind"]) for r in _backlog(True, False)]


def test_a_job_lost_whole_is_paged_once_its_partition_is_read():
    """The per-partition clock holds only while the partition has records unread: a job whose every rank fell
    silent (its node lost) is paged once its partition is read to its end, by the time the other partitions
    show, once."""
    rows = _backlog(finished=False)
    assert [(r["job_id"], r["kind"], r["missing_ranks"]) for r in rows] == [("ended", "node_loss", "0-1")], rows


def test_the_ranks_of_a_lost_host_are_named_together_though_their_last_heartbeats_are_apart():
    """A host's ranks heartbeat at their own moments: after the loss one passes the timeout first, and is not a
    process loss on a host that still reports (the real two-host job: tests/netfaults/test_host_loss.py)."""
    s = 10**9
    t = HangTracker("hostjob", params=HangParams(silent_s=3.0, heartbeat_timeout_s=6.0))
    # Every rank reports every second, rank 3 at a tenth past; host b's until 10 s: rank 3 last 0.9 s before rank 2.
    last = {2: 10 * s, 3: 9 * s + s // 10}
    for ts in range(0, 30 * s, s // 10):
        for r, host in ((0, "a"), (1, "a"), (2, "b"), (3, "b")):
            if ts > last.get(r, ts) or ts % s != (s // 10 if r == 3 else 0):
                continue
            t.add_heartbeats(_hb("hostjob", r, host, ts, ts // s, heartbeat_s=1.0))
        hang = t.evaluate(ts, input_alive=True)
        if hang is not None and hang.kind == "node_loss":
            break
    assert (hang.op, hang.missing_ranks, hang.suspect_hosts) == ("host silent", [2, 3], ["b"]), hang
    assert 16 * s <= ts <= 17 * s  # rank 2 past the 6 s timeout: not later than the host's last rank allows


def test_a_silent_rank_whose_host_mates_report_is_still_a_process_loss():
    s = 10**9
    t = HangTracker("procjob", params=HangParams(silent_s=3.0, heartbeat_timeout_s=6.0))
    for ts in range(0, 30 * s, s):
        for r, host in ((0, "a"), (1, "a"), (2, "b"), (3, "b")):
            if r == 3 and ts > 10 * s:
                continue
            t.add_heartbeats(_hb("procjob", r, host, ts, ts // s, heartbeat_s=1.0))
        hang = t.evaluate(ts, input_alive=True)
        if hang is not None and hang.kind == "node_loss":
            break
    assert (hang.op, hang.missing_ranks, hang.suspect_hosts) == ("process silent", [3], ["b"]), hang


@pytest.mark.parametrize("silent_s, shown", [(20, False), (0, True)])
def test_a_silent_rank_s_old_stacks_do_not_stand_in_for_it(silent_s, shown):
    """A rank that SIGSTOPs itself with no watch beside it (the console's real-hang test: the example job runs
    without `trace`) had dumped stacks in a quiet spell and gone on without an op ending; its heartbeats then
    stopped, and those old stacks stood in for it in the hang's picture (twice in whole-suite runs). Silent,
    it cannot be where they say; still reporting, its stacks are its own, and shown."""
    inc = hang_incident("comm_hang", 16, 3)
    t = tracker_for(inc)
    culprit = inc.truth["missing"][0]
    st = t.ranks[culprit]
    st.ts = inc.now_ns - silent_s * 10**9
    st.stack, st.stack_ts = "MainThread;train.py:main:10;train.py:step:20", st.ts
    hang = t.evaluate(inc.now_ns)
    assert hang is not None and hang.kind == "comm_hang" and hang.missing_ranks == [culprit]
    assert (str(culprit) in hang.evidence["ranks_with_stacks"].split(",")) is shown, hang.evidence["ranks_with_stacks"]
