"""Run-time control: the one check of a change, what is in force, and an exporter taking a change at a step end."""
from __future__ import annotations

import json

import pytest

from core.control import (ControlBook, ControlError, check, hang_overrides, make_change, parse_duration,
                          records_of)
from ingest.control import PAUSED, ControlFollower
from ingest.exporter import RankExporter, Sampling

T0 = 1_700_000_000 * 10**9


def record(**over) -> dict:
    base = dict(change_id="c1", who="alice", when=T0, scope="job:j1", what={"sample": "5/10"}, until=0)
    return {**base, **over}


@pytest.mark.parametrize("over, why", [
    (dict(what={"sample": "0/0"}), "need 1 <= K <= N"),
    (dict(what={"sample": "7/5"}), "need 1 <= K <= N"),
    (dict(what={"sample": "every"}), "is not K/N"),
    (dict(what={"sampel": "5/10"}), "unknown setting 'sampel'"),
    (dict(what={"hang_min_s": 0}), "hang_min_s = 0 is out of range"),
    (dict(what={"hang_min_s": float("nan")}), "out of range"),
    (dict(what={"hang_min_s": True}), "must be a number"),
    (dict(what={"heartbeat_s": 1000}), "heartbeat_s = 1000 is out of range"),
    (dict(what={"profiling": "off"}), "profiling must be 'on' or 'paused'"),
    (dict(what={}), "sets nothing"),
    (dict(scope="job:"), "the job id is empty"),
    (dict(scope="job:" + "x" * 129), "over 128"),
    (dict(scope="job:a b"), "characters outside"),
    (dict(scope="team:x"), "scope must be 'fleet' or 'job:<job id>'"),
    (dict(until=T0 - 1), "until must be after when"),
    (dict(when=-5), "when must be nanoseconds"),
    (dict(who=""), "who must be"),
    (dict(extra=1), "unknown field 'extra'"),
    (dict(what={"hang_silent_s": 40, "hang_heartbeat_timeout_s": 30}), "must be below hang_heartbeat_timeout_s"),
])
def test_bad_changes_are_refused_with_their_reason(over, why):
    with pytest.raises(ControlError, match=why.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")) as e:
        check(json.dumps(record(**over)))
    assert "\n" not in str(e.value)


def test_one_bad_setting_refuses_the_whole_change():
    """Nothing applies half: a good sampling beside a bad threshold is not taken either."""
    book = ControlBook()
    assert book.add(json.dumps(record(what={"sample": "1/1", "hang_min_s": -3}))) is None
    assert book.settings(T0, "j1") == {} and "hang_min_s" in book.refused[0]
    assert book.add(b"not json") is None and len(book.refused) == 2


def test_a_good_change_round_trips_and_values_are_normalised():
    c = make_change("bob", T0, "j1", {"sample": " 5 / 10 ", "hang_min_s": "30"}, for_s=600)
    assert c.what == {"sample": "5/10", "hang_min_s": 30.0} and c.until == T0 + 600 * 10**9
    assert check(c.to_json()) == c
    assert c.row()["job_id"] == "j1" and json.loads(c.row()["what_json"]) == c.what
    with pytest.raises(ControlError, match="the job id is empty"):
        make_change("bob", T0, "", {"sample": "1/1"})


def test_what_is_in_force_job_over_fleet_later_over_earlier_until_it_ends_or_is_cleared():
    book = ControlBook()
    fleet = make_change("a", T0, None, {"hang_min_s": 30, "sample": "1/100"})
    job = make_change("a", T0 + 1, "j1", {"sample": "5/10"}, for_s=60)
    for c in (fleet, job):
        book.add(c.to_json())
    assert book.settings(T0 + 2, "j1") == {"hang_min_s": 30.0, "sample": "5/10"}
    assert book.settings(T0 + 2, "j2") == {"hang_min_s": 30.0, "sample": "1/100"}
    assert book.settings(T0 + 61 * 10**9, "j1") == {"hang_min_s": 30.0, "sample": "1/100"}  # the job's ran out
    assert book.next_expiry(T0 + 2) == job.until
    assert hang_overrides(book.settings(T0 + 2, "j1")) == {"min_s": 30.0}
    book.add(make_change("a", T0 + 3, None, {}, clears=fleet.change_id).to_json())
    assert book.settings(T0 + 4, "j2") == {}
    book.add(job.to_json())  # read again after a restart: taken once, nothing changes
    assert [c.change_id for c in book.in_force(T0 + 4)] == [job.change_id]
    book.add(make_change("a", T0 + 5, "j1", {}, clears="*").to_json())
    assert book.in_force(T0 + 6) == []


def test_durations():
    assert parse_duration("10m") == 600 and parse_duration("90") == 90 and parse_duration("1.5h") == 5400
    with pytest.raises(ControlError):
        parse_duration("soon")


class FakeSource:
    def __init__(self):
        self.records: list[bytes] = []

    def poll(self, timeout_ms: int) -> list[bytes]:
        out, self.records = self.records, []
        return out


def test_an_exporter_takes_a_sampling_change_at_its_next_step_end():
    sent = []
    exp = RankExporter("j1", 0, 0, 0, sent.append, sampling=Sampling(1, 1000), heartbeat_s=3600, use_cuda=False,
                       tcp_flows=False, nvml=False, port_counters=False, peer_timings=False)
    source = FakeSource()
    follower = ControlFollower(exp, source)  # driven by hand here: no thread
    try:
        with exp.step(1):
            assert not exp.profiling
            change = make_change("a", T0, "j1", {"sample": "1/1", "heartbeat_s": 1}, for_s=60)
            source.records.append(change.to_json())
            follower.take(source.poll(0), T0 + 1)
            assert not exp.profiling and exp.sampling == Sampling(1, 1000)  # not within the step in progress
        assert exp.heartbeat_s == 1.0
        with exp.step(2):
            assert exp.profiling  # every step from the next on
        other = make_change("a", T0, "j2", {"profiling": "paused"})
        follower.take([other.to_json()], T0 + 2)  # another job's change leaves this one alone
        with exp.step(3):
            assert exp.profiling
        follower.take([], change.until)  # the change ran out: the job's own sampling and heartbeats again
        with exp.step(4):
            pass
        with exp.step(5):
            assert not exp.profiling and exp.sampling == Sampling(1, 1000) and exp.heartbeat_s == 3600
        follower.take([make_change("a", T0, None, {"profiling": "paused"}).to_json()], change.until + 1)
        with exp.step(6):
            pass
        assert exp.sampling is PAUSED
        with exp.step(2000):  # would be sampled by its own 1/1000
            assert not exp.profiling
    finally:
        exp.close()


def test_a_shard_stores_each_change_and_judges_the_job_by_its_thresholds_until_the_change_ends():
    from core.config import Config
    from generators.faultgen import hang_incident
    from ray_jobs.shard import ShardWorker
    from tests.fakes import FakeControls, FakeSink, FakeSource, ManualClock

    clock, sink, controls = ManualClock(), FakeSink(), FakeControls()
    cfg = Config().replace(pipeline={"commit_interval_s": 0.0, "state_interval_s": 0.0},
                           hang={"floor_s": 60, "heartbeat_timeout_s": 30})
    w = ShardWorker(0, [0], cfg, "s", consumer_factory=lambda: FakeSource([]), sink_factory=lambda: sink,
                    clock=clock, control_factory=lambda: controls)
    w.setup()
    try:
        inc = hang_incident("comm_hang", 8, 0, job_id="j1")
        now_ns = clock.wall_ns()
        quiet = make_change("a", now_ns, "j1", {"hang_floor_s": 86400, "hang_min_s": 86400}, for_s=60)
        fleet = make_change("a", now_ns, None, {"hang_silent_s": 20})
        controls.records += [quiet.to_json(), fleet.to_json(), b'{"change_id": "x"}']
        w.step(poll_timeout_ms=0)
        assert w.stats.control_changes == 2 and w.stats.control_refused == 1
        stored = sorted(r["change_id"] for r in sink.rows["control_change"])
        assert stored == sorted([quiet.change_id, fleet.change_id])
        w.hangs.add("ccl_record", inc.ccl, now=clock.t)
        w.hangs.add("heartbeat", inc.heartbeats, now=clock.t)
        tr = w.hangs.trackers[("j1", 0)]
        assert (tr.params.floor_s, tr.params.silent_s, tr.params.heartbeat_timeout_s) == (86400, 20, 30)
        assert w.hangs.params_for("other").floor_s == 60 and w.hangs.params_for("other").silent_s == 20
        clock.t += 2
        w.step(poll_timeout_ms=0)  # the shard's own evaluation: quieted, the stall is no hang for this job
        assert "hang" not in sink.rows and w.stats.hangs == 0
        clock.t += 60  # the job's change runs out; the fleet's stays
        w.step(poll_timeout_ms=0)
        assert (tr.params.floor_s, tr.params.silent_s) == (60, 20)
        [hang] = sink.rows["hang"]
        assert hang["job_id"] == "j1" and hang["kind"] == "comm_hang"
        controls.records.append(make_change("a", clock.wall_ns(), None, {}, clears="*").to_json())
        w.step(poll_timeout_ms=0)
        assert w.hangs.params_for("j1") == cfg.hang and len(sink.rows["control_change"]) == 3
    finally:
        w.stop()
    assert controls.closed


def test_the_shard_stores_the_step_a_change_starts_from_and_status_shows_it():
    """The audit carries ``from_step`` (the control_changes table); `control status` says from which step a change
    applies on the job's ranks, or "next" (each rank's next step end) for one without a step."""
    from actions.control import format_status
    from core.config import Config
    from core.schema import CONTROL_CHANGE
    from ray_jobs.shard import ShardWorker
    from tests.fakes import FakeControls, FakeSink, FakeSource, ManualClock

    clock, sink, controls = ManualClock(), FakeSink(), FakeControls()
    w = ShardWorker(0, [0], Config().replace(pipeline={"commit_interval_s": 0.0, "state_interval_s": 0.0}), "s",
                    consumer_factory=lambda: FakeSource([]), sink_factory=lambda: sink, clock=clock,
                    control_factory=lambda: controls)
    w.setup()
    try:
        now_ns = clock.wall_ns()
        stepped = make_change("a", now_ns, "j1", {"sample": "1/1", "hang_min_s": 30}, from_step=1017)
        fleet = make_change("a", now_ns, None, {"sample": "1/10"})
        controls.records += [r.to_json() for _, r in records_of(stepped)] + [fleet.to_json()]
        w.step(poll_timeout_ms=0)
    finally:
        w.stop()
    rows = {r["change_id"]: r for r in sink.rows["control_change"]}
    assert set(rows[stepped.change_id]) == set(CONTROL_CHANGE.names)
    assert (rows[stepped.change_id]["from_step"], rows[fleet.change_id]["from_step"]) == (1017, 0)
    assert json.loads(rows[stepped.change_id]["what_json"]) == {"sample": "1/1", "hang_min_s": 30.0}  # whole
    book = ControlBook()
    book.take([r.to_json() for _, r in records_of(stepped)] + [fleet.to_json()])
    book.flush()
    lines = format_status([stepped, fleet], book).splitlines()
    assert "from step" in lines[0]
    assert " 1017 " in lines[1] and " next " in lines[2], lines


@pytest.mark.parametrize("argv, why", [
    (["set", "--job", "j1", "--sample", "0/0"], "sample 0/0: need 1 <= K <= N"),
    (["set", "--job", "j1", "--sample", "12/10"], "sample 12/10: need 1 <= K <= N"),
    (["set", "--fleet", "--hang-min-s", "-1"], "hang_min_s = -1.0 is out of range"),
    (["set", "--job", "", "--sample", "1/1"], "the job id is empty"),
    (["set", "--job", "x" * 200, "--sample", "1/1"], "over 128"),
    (["set", "--job", "j1"], "set needs at least one setting"),
    (["set", "--sample", "1/1"], "set needs --job JOB or --fleet"),
    (["set", "--job", "j1", "--sample", "1/1", "--for", "soon"], "duration 'soon'"),
    (["clear", "--job", "j1", "--sample", "1/1"], "clear takes no settings"),
])
def test_the_command_refuses_bad_input_in_one_line_before_publishing(argv, why, capsys, monkeypatch):
    """Refused before any connection (the unit tier would fail a socket): nothing is published."""
    from stragglerscope.cli import main

    monkeypatch.setenv("STRAGGLERSCOPE_KAFKA_BOOTSTRAP", "127.0.0.1:9")
    assert main(["control", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stragglerscope control: error: ") and why in err and err.count("\n") == 1, err


# -- an agreed step: the ranks of a job start a sampling change at the same step ------------------------------------

def rank(r: int) -> tuple[RankExporter, ControlFollower]:
    exp = RankExporter("j1", r, r, 0, lambda t: None, sampling=Sampling(1, 1000), heartbeat_s=3600, use_cuda=False,
                       tcp_flows=False, nvml=False, port_counters=False, peer_timings=False)
    return exp, ControlFollower(exp, FakeSource())  # driven by hand: no thread


def test_two_ranks_hearing_of_a_change_at_different_steps_start_it_at_the_same_step():
    """Rank 0 hears of the change during step 10, rank 1 during step 13 (a slow poll): both sample every step from
    step 15 on (applied at the end of step 14), and neither before; a rank that hears of it only after step 14
    applies it at its next step end and counts it, once said."""
    change = make_change("a", T0, "j1", {"sample": "1/1"}, from_step=15)
    ranks = [rank(0), rank(1), rank(2)]
    hears_at = {0: 10, 1: 13, 2: 17}
    profiled: dict[int, list[int]] = {0: [], 1: [], 2: []}
    try:
        for step in range(5, 21):
            for r, (exp, follower) in enumerate(ranks):
                with exp.step(step):
                    if step == hears_at[r]:
                        follower.take([change.to_json()], T0 + 1)
                    if exp.profiling:
                        profiled[r].append(step)
        assert profiled[0] == profiled[1] == list(range(15, 21))
        assert profiled[2] == list(range(18, 21))  # heard of it during step 17: from its next step on
        assert [exp.stats.control_late for exp, _ in ranks] == [0, 0, 1]
        # the plan handed over names the step; a change without one is taken at the next step end, as before
        exp, follower = ranks[0]
        follower.take([make_change("a", T0 + 2, "j1", {"profiling": "paused"}).to_json()], T0 + 3)
        with exp.step(21):
            assert exp.profiling  # the step in progress keeps its window
        with exp.step(22):
            assert not exp.profiling and exp.sampling is PAUSED
    finally:
        for exp, _ in ranks:
            exp.close()


def test_until_its_step_a_stepped_change_leaves_the_one_it_replaces_in_force():
    """A job sampled 5/10 by a change; a change to 1/1 from step 100 replaces it, not before step 100."""
    book = ControlBook()
    book.take([make_change("a", T0, "j1", {"sample": "5/10"}).to_json(),
               make_change("a", T0 + 1, "j1", {"sample": "1/1"}, from_step=100).to_json()])
    assert book.settings(T0 + 2, "j1", step=99) == {"sample": "5/10"}
    assert book.settings(T0 + 2, "j1", step=100) == book.settings(T0 + 2, "j1") == {"sample": "1/1"}
    assert book.step_points("j1", ("sample",)) == [100]
    [c] = book.in_force(T0 + 2, "j1")
    assert c.from_step == 100


def test_records_without_the_new_fields_still_parse():
    old = dict(change_id="c0", who="alice", when=T0, scope="job:j1", what={"sample": "5/10", "hang_min_s": 30},
               until=0, clears="")
    c = check(json.dumps(old))
    assert (c.from_step, c.parts, c.unset) == (0, 1, ())
    book = ControlBook()
    book.take([json.dumps(old), json.dumps(dict(old, change_id="c1", what={}, clears="c0"))])
    assert book.settings(T0, "j1") == {}  # an old clear by id: the settings its change held
    with pytest.raises(ControlError, match="a clear takes no step"):
        check(json.dumps(dict(old, what={}, clears="*", from_step=5)))
    with pytest.raises(ControlError, match="only a record that clears"):
        check(json.dumps(dict(old, unset=["sample"])))


# -- the compacted control topic: one record per scope and setting ---------------------------------------------------

def publish_to(log: list, change) -> None:
    from core.control import records_of

    log.extend((key, part.to_json()) for key, part in records_of(change))


def compacted(log: list) -> list:
    """What the log cleaner leaves: the newest record of each key, in their order."""
    newest = {key: i for i, (key, _) in enumerate(log)}
    return [rec for i, (key, rec) in enumerate(log) if newest[key] == i]


def test_a_change_of_several_settings_is_one_record_per_setting_applied_together():
    from core.control import records_of

    change = make_change("a", T0, "j1", {"sample": "1/1", "hang_min_s": 30, "heartbeat_s": 1}, from_step=7)
    recs = records_of(change)
    assert [k for k, _ in recs] == [b"job:j1|hang_min_s", b"job:j1|heartbeat_s", b"job:j1|sample"]
    assert all(p.parts == 3 and p.change_id == change.change_id and p.from_step == 7 for _, p in recs)
    book = ControlBook()
    assert book.take([p.to_json() for _, p in recs[:2]]) == [] and book.settings(T0, "j1") == {}  # not half
    [whole] = book.take([recs[2][1].to_json()])
    assert whole.what == change.what and book.settings(T0, "j1") == change.what
    assert book.take([p.to_json() for _, p in recs]) == []  # read again: taken once


def test_the_compacted_log_gives_what_the_whole_log_gives():
    """Random changes, clears and expiries of the fleet and two jobs: the settings in force, read from the whole
    log and from only the newest record of each key, are the same at every time; and the compacted log holds at
    most one record per scope and setting."""
    import random

    from core.control import SETTINGS

    names = ["sample", "profiling", "heartbeat_s", "hang_min_s", "alerts_cooldown_s"]
    values = {"sample": "1/1", "profiling": "paused", "heartbeat_s": 1, "hang_min_s": 30, "alerts_cooldown_s": 60}
    for seed in range(40):
        rnd, log, made = random.Random(seed), [], []
        for i in range(rnd.randint(1, 30)):
            job = rnd.choice([None, "j1", "j2"])
            when = T0 + i * 10**9
            if made and rnd.random() < 0.25:
                if rnd.random() < 0.5:
                    change = make_change("a", when, job, {}, clears="*")
                else:  # one change: the settings it still holds (as `control clear --change` reads them)
                    book = ControlBook()
                    book.take(r for _, r in log)
                    target = rnd.choice(made)
                    unset = sorted(n for (sc, n), h in book.held.items() if h[-1].change_id == target.change_id)
                    if not unset:
                        continue
                    change = make_change("a", when, target.job_id, {}, clears=target.change_id, unset=unset)
            else:
                what = {n: values[n] for n in rnd.sample(names, rnd.randint(1, 3))}
                change = make_change("a", when, job, what, for_s=rnd.choice([0, 5, 50]),
                                     from_step=rnd.choice([0, 0, 40]) if job else 0)
                made.append(change)
            publish_to(log, change)
        whole, small = ControlBook(), ControlBook()
        whole.take(r for _, r in log)
        whole.flush()
        small.take(compacted(log))
        small.flush()
        for t in range(0, 90, 3):
            now = T0 + t * 10**9
            for job in (None, "j1", "j2"):
                assert whole.settings(now, job) == small.settings(now, job), (seed, t, job)
                assert whole.settings(now, job, step=10**6) == small.settings(now, job, step=10**6), (seed, t, job)
        assert len(compacted(log)) <= 3 * len(SETTINGS)
