"""A shard killed (no stop, no final commit) resumes from its saved state: the same hangs, alerts and downtime.

One job of 4 ranks steps every 20 s, saves a checkpoint at step 5 and hangs
at step 12 (ranks 0, 1 and 3 wait in all_reduce #12, rank 2 never enters it);
its hang threshold is 10 median step times (200 s) above the 60 s floor. The
operator restarts it (attempt 1 loads step 5). Records are released as the
wall clock reaches them. The shard is killed three times: during the hang's
grace period, just after the hang was found, and while the fault incident is
open. The rows stored must be those
of a shard that was never killed.
"""
from __future__ import annotations

import pyarrow as pa
import pytest

from core import codec
from core import schema as S
from core.config import Config
from generators.fleetgen import JobSpec
from core.layout import JobLayout
from ray_jobs.shard import ShardWorker
from ray_jobs.state import FORMAT, decode, encode
from tests.fakes import FakeSink, FakeSource, ManualClock, messages_for

NS = 10**9
T0 = 1_700_000_000 * NS
STEP_S, HB_S, RANKS = 20, 5, 4
HANG_STEP = 12
T_HANG = T0 + HANG_STEP * STEP_S * NS  # step 12 starts; nobody finishes it
RESTART = T_HANG + 400 * NS
END_S = (RESTART - T0) // NS + 900


def _hb(attempt, rank, ts, step, done_ns, last_end, inflight="", group="", seq=-1, since=-1):
    return dict(job_id="j", attempt=attempt, rank=rank, host=f"h{rank}", pid=100 + rank, ts_ns=ts, step=step,
                last_op="optimizer" if not inflight else "forward-compute", last_op_end_ns=last_end,
                inflight_op=inflight, inflight_group=group, inflight_seq=seq, inflight_since_ns=since,
                clock_offset_ns=0, stack="", step_done=step - 1, step_done_ns=done_ns)


def scenario() -> list[tuple[int, pa.Table]]:
    """(release wall ns, table) in the order an exporter would send them."""
    spec = JobSpec("j", JobLayout(dp_size=RANKS, pp_size=1), num_microbatches=1)
    out = [(T0, spec.registration(T0, 2))]
    for t in range(T0 + HB_S * NS, RESTART, HB_S * NS):
        rows = []
        for r in range(RANKS):
            if t < T_HANG:
                step = (t - T0) // (STEP_S * NS)
                done = T0 + step * STEP_S * NS
                rows.append(_hb(0, r, t, step, done, t - NS))
            elif r == 2:  # stuck in its own compute, never reaches the collective
                rows.append(_hb(0, r, t, HANG_STEP, T_HANG, T_HANG, "forward-compute", "", -1, T_HANG))
            else:
                rows.append(_hb(0, r, t, HANG_STEP, T_HANG, T_HANG + NS, "all_reduce", "world", HANG_STEP,
                                T_HANG + NS))
        out.append((t, codec.from_rows(S.HEARTBEAT, rows)))
        if t == T0 + 6 * STEP_S * NS + HB_S * NS:  # the save of step 5, reported when it ended
            out.append((t, codec.from_rows(S.CHECKPOINT, [dict(job_id="j", attempt=0, rank=r, step=5,
                                                               ts_ns=t - 4 * NS, duration_ns=3 * NS, kind="save")
                                                          for r in range(RANKS)])))
    out.append((RESTART, JobSpec("j", JobLayout(dp_size=RANKS, pp_size=1), num_microbatches=1, attempt=1)
                .registration(RESTART, 2)))
    out.append((RESTART + 10 * NS, codec.from_rows(S.CHECKPOINT, [
        dict(job_id="j", attempt=1, rank=r, step=5, ts_ns=RESTART + 5 * NS, duration_ns=4 * NS, kind="load")
        for r in range(RANKS)])))
    resume = RESTART + 20 * NS
    for t in range(resume + HB_S * NS, T0 + END_S * NS, HB_S * NS):
        step = 6 + (t - resume) // (STEP_S * NS)
        done = resume + (step - 6) * STEP_S * NS
        out.append((t, codec.from_rows(S.HEARTBEAT, [_hb(1, r, t, step, done, t - NS) for r in range(RANKS)])))
    return out


class TimedSource(FakeSource):
    """Releases each message once the wall clock reaches the time it was sent (as a live exporter would)."""

    def __init__(self, messages, release_ns, clock):
        super().__init__(messages, batch=50)
        self.release = release_ns
        self.clock = clock

    def poll(self, timeout_ms):
        out = []
        while self._i < len(self._pending) and len(out) < self.batch:
            m = self._pending[self._i]
            if self.release[(m.topic, m.offset)] > self.clock.wall_ns():
                break
            out.append(m)
            self._i += 1
        return out


def run(kill_at_s=(), sink=None, forget_state=False):
    """Step a shard second by second to the end; at each of ``kill_at_s`` drop it (kill -9: nothing more is
    stored) and start a new one on the same store. Returns the sink."""
    timed = scenario()
    messages = messages_for([t for _, t in timed])
    release = {(m.topic, m.offset): ns for m, (ns, _) in zip(messages, timed)}
    clock = ManualClock(wall=lambda: T0 + int(clock.t * NS))
    cfg = Config().replace(hang={"floor_s": 60.0, "k_steps": 10.0, "heartbeat_timeout_s": 30.0},
                           pipeline={"commit_interval_s": 2.0, "state_interval_s": 10.0})
    sink = sink or FakeSink()

    def start():
        src = TimedSource(messages, release, clock)
        if forget_state:
            sink.states.clear()  # as a shard did before its state was kept
        w = ShardWorker(0, [0], cfg, "src", consumer_factory=lambda: src, sink_factory=lambda: sink,
                        submit=lambda *a: pytest.fail("no window here"), clock=clock)
        w.setup()
        return w

    w = start()
    kills = sorted(kill_at_s)
    for second in range(END_S):
        clock.t = float(second)
        if kills and second == kills[0]:
            kills.pop(0)
            w = start()  # the old one is dropped mid-stream: whatever it did not store is gone
        w.step(poll_timeout_ms=0)
    return sink


def _rows(sink, kind, drop=()):
    return sorted((tuple((k, v) for k, v in r.items() if k not in drop) for r in sink.rows.get(kind, [])))


def test_a_kill_during_the_grace_period_and_while_an_incident_is_open_changes_no_stored_result():
    hang_at = (T_HANG - T0) // NS
    # In the 200 s grace; 4 s after the detection (before the next 10 s snapshot would have been due); while
    # the incident is open, before the restart.
    kills = (hang_at + 100, hang_at + 205, hang_at + 300)
    calm = run()
    killed = run(kills)
    # One hang: attempt 0's ranks falling silent once attempt 1 registered is the restart, not node loss.
    (hang,) = calm.rows["hang"]
    assert hang["kind"] == "comm_hang"
    assert hang["missing_ranks"] == "2" and hang["hang_id"] >= T_HANG + 200 * NS  # the 200 s threshold held
    assert calm.rows.get("downtime"), "the incident closed and was stored"
    for kind in ("hang", "alert", "downtime"):
        assert _rows(killed, kind) == _rows(calm, kind), kind


def test_without_the_saved_state_the_same_kills_change_the_results():
    """What the test above guards against: a restarted shard that forgot its state called the hang early
    (only the 60 s floor was left of its threshold) or twice, and lost the open incident's timeline."""
    hang_at = (T_HANG - T0) // NS
    calm = run()
    forgot = run((hang_at + 100, hang_at + 300), forget_state=True)
    assert any(_rows(forgot, kind) != _rows(calm, kind) for kind in ("hang", "alert", "downtime"))


def test_offsets_never_pass_the_saved_state():
    """Offsets are stored every 2 s but never beyond the positions the last saved state (every 10 s) covers."""
    sink = run()
    (fmt, blob), = sink.states.values()
    assert fmt == FORMAT and set(decode(blob)) == {"hangs", "alerts", "downtime", "regressions", "windows"}
    # What the shard resumes from is what the shard's last snapshot held.
    assert encode(decode(blob)) == blob


def test_a_state_row_is_data_never_code():
    import pickle

    import os

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    bad = __import__("zlib").compress(pickle.dumps({"hangs": Evil()}))
    with pytest.raises(pickle.UnpicklingError, match=r"\.system is not part of a shard's state"):
        decode(bad)
    sink = FakeSink()
    sink.states[("src", "p0")] = (FORMAT, bad)
    cfg = Config().replace(pipeline={"state_interval_s": 0.0, "commit_interval_s": 0.0})
    w = ShardWorker(0, [0], cfg, "src", consumer_factory=lambda: FakeSource([]), sink_factory=lambda: sink,
                    clock=ManualClock())
    w.setup()  # logged and ignored: the shard starts empty
    assert w.hangs.trackers == {}
