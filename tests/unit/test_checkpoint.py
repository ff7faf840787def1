"""The shard's one exactly-once step: results stored, then offsets; nothing lost while the store is away."""
import dataclasses

import pyarrow as pa
import pytest

from core.config import Config
from core.layout import JobLayout
from generators.faultgen import hang_incident
from generators.fleetgen import JobSpec, generate_window
from ray_jobs.checkpoint import Checkpoint, Unit
from ray_jobs.shard import ShardStats, ShardWorker
from tests.fakes import FakeSink, FakeSource, ManualClock, messages_for
from storage.errors import StoreBusy
from tests.unit.test_shard import fake_analysis


class Journal(FakeSink):
    """A sink that logs every flush and offset store in order, and can be switched off or made to refuse."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, object]] = []
        self.down = False
        self.refuse: set[str] = set()  # table kinds whose rows the store refuses while up

    def flush(self):
        if self.down or self.refuse & set(self._buf):
            self._buf = {}
            raise ConnectionError("store away" if self.down else "refused: bad rows")
        self.log.append(("flush", sorted(self._buf)))
        super().flush()

    def store_offsets(self, source_id, offsets, log_ids=None):
        if self.down:
            raise ConnectionError("store away")
        self.log.append(("offsets", dict(offsets)))
        super().store_offsets(source_id, offsets, log_ids)

    def load_offsets(self, source_id, topics, partitions):
        if self.down:
            raise ConnectionError("store away")
        return super().load_offsets(source_id, topics, partitions)

    def window_stored(self, key):
        if self.down:
            raise ConnectionError("store away")
        return super().window_stored(key)


class Positions:
    def __init__(self, pos):
        self.pos = pos

    def positions(self):
        return dict(self.pos)

    def log_ids(self):
        return {}


def table(n=1):
    return pa.table({"x": list(range(n))})


def checkpoint(sink, interval_s=0.0, pos=None):
    pos = pos if pos is not None else {("t", 0): 5}
    clock = ManualClock()
    return Checkpoint(sink, sink, Positions(pos), lambda p: p, "src", interval_s, clock,
                      probe=lambda: sink.load_offsets("src", [], [])), clock


def test_results_are_stored_before_their_callbacks_and_before_the_offsets():
    sink = Journal()
    cp, _ = checkpoint(sink)
    seen = []
    cp.add(Unit("a", {"window": table()}, on_stored=lambda: seen.append(list(sink.log))))
    cp.commit(0.0)
    assert sink.log == [("flush", ["window"]), ("offsets", {("t", 0): 5})]
    assert seen == [[("flush", ["window"])]], "on_stored ran after the flush, before the offsets"


def test_a_store_outage_keeps_every_unit_and_holds_the_offsets_until_it_returns():
    sink = Journal()
    cp, _ = checkpoint(sink)
    done = []
    for kind in ("hang", "dead_letter", "job", "downtime"):
        cp.add(Unit(kind, {kind: table()}, on_stored=lambda k=kind: done.append(k)))
    sink.down = True
    for t in range(10):  # ten passes with the store away: nothing given up, nothing stored
        cp.commit(float(t))
    assert done == [] and len(cp.pending) == 4 and cp.units_dropped == 0 and sink.offsets == {}
    assert "store away" in cp.last_error
    sink.down = False
    cp.commit(10.0)
    assert sorted(done) == ["dead_letter", "downtime", "hang", "job"]
    assert all(len(sink.rows[k]) == 1 for k in done)
    assert sink.offsets["src"] == {("t", 0): 5}


def test_rows_a_live_store_keeps_refusing_are_given_up_and_stop_pinning_the_offsets():
    sink = Journal()
    sink.refuse = {"hang"}
    cp, _ = checkpoint(sink)
    instead = Unit("failed window", {"window": table()})
    cp.add(Unit("window", {"hang": table()}, give_up=lambda reason: instead))
    cp.add(Unit("dead letter", {"dead_letter": table()}))
    cp.commit(0.0)
    assert sink.rows["dead_letter"] and ("t", 0) not in sink.offsets.get("src", {}), "the refused unit holds them"
    cp.commit(1.0)
    cp.commit(2.0)  # the third refusal: replaced by what give_up returned
    assert cp.pending == [instead]
    cp.commit(3.0)
    assert sink.rows["window"] and sink.offsets["src"] == {("t", 0): 5}
    # Without give_up: dropped after the third refusal, counted, and the offsets move.
    cp.add(Unit("hangs", {"hang": table()}))
    for t in range(3):
        cp.commit(4.0 + t)
    assert cp.units_dropped == 1 and cp.pending == []


def test_a_refusal_the_store_calls_transient_waits_like_an_outage_and_is_never_given_up():
    """A replicated shard short of its quorum refuses writes while reads (the probe) still answer."""
    class Short(Journal):
        short = True

        def flush(self):
            if self.short:
                self._buf = {}
                raise StoreBusy("Code: 285. Number of alive replicas (1) is less than requested quorum (2)")
            super().flush()

    sink = Short()
    cp, _ = checkpoint(sink)
    cp.add(Unit("window", {"window": table()}, give_up=lambda reason: Unit("failed", {"window": table()})))
    for t in range(10):  # more passes than max_attempts: still waiting, nothing counted against it
        cp.commit(float(t))
    assert len(cp.pending) == 1 and cp.pending[0].what == "window" and cp.pending[0].attempts == 0
    assert "quorum" in cp.last_error and sink.offsets == {}
    sink.short = False
    cp.commit(10.0)
    assert sink.rows["window"] and sink.offsets["src"] == {("t", 0): 5}


def test_best_effort_rows_never_hold_anything_back():
    sink = Journal()
    cp, _ = checkpoint(sink)
    stored = []
    cp.add(Unit("spans", {"op_span": table()}, on_stored=lambda: stored.append("spans"), best_effort=True))
    cp.add(Unit("window", {"window": table()}, on_stored=lambda: stored.append("window")))
    sink.refuse = {"op_span"}
    cp.commit(0.0)
    assert stored == ["window"] and cp.pending == [] and sink.offsets["src"] == {("t", 0): 5}
    assert sink.log[0] == ("flush", ["window"]), "results first: alerts never wait for raw spans"


def test_offsets_are_stored_at_most_once_per_interval_unless_forced():
    sink = Journal()
    pos = {("t", 0): 1}
    cp, _ = checkpoint(sink, interval_s=2.0, pos=pos)
    for t in range(6):
        pos[("t", 0)] = t + 1
        cp.commit(0.5 * t)
    assert [off[("t", 0)] for what, off in sink.log if what == "offsets"] == [1, 5]  # at 0 s and 2 s
    cp.pos = pos
    cp.commit(2.6, force=True)
    assert sink.offsets["src"] == {("t", 0): 6}


def test_a_shard_loses_nothing_to_a_store_outage():
    """Hangs, their alerts, registrations and windows found while the store is away are all stored once
    it returns (the old loop dropped a flush's rows on failure), and no offset moved meanwhile."""
    inc = hang_incident("comm_hang", 8, 1)
    a = JobSpec("a", JobLayout(dp_size=2, pp_size=2), num_microbatches=4)
    msgs = messages_for([a.registration(0, 2), generate_window(a, 0, 2, 0), inc.ccl, inc.heartbeats])
    sink = Journal()
    clock = ManualClock(wall=lambda: inc.now_ns)
    cfg = Config().replace(hang={"floor_s": 60.0, "heartbeat_timeout_s": 30.0}, alerts={"min_gpus": 1},
                           pipeline={"commit_interval_s": 0.0, "state_interval_s": 0.0})
    w = ShardWorker(0, [0], cfg, "s", consumer_factory=lambda: FakeSource(msgs), sink_factory=lambda: sink,
                    submit=fake_analysis([]), clock=clock)
    w.setup()
    sink.down = True
    for i in range(8):
        clock.t = 1.5 * i
        w.step(poll_timeout_ms=0)
    assert sink.rows == {} and sink.offsets == {} and "store away" in w.stats.error
    assert w.stats.windows_stored == 0 and w.stats.hangs == 0 and w.stats.alerts == 0
    sink.down = False
    for i in range(8):
        clock.t = 20.0 + 1.5 * i
        w.step(poll_timeout_ms=0)
    assert [r["job_id"] for r in sink.rows["job"]] == ["a"]
    assert [r["job_id"] for r in sink.rows["window"]] == ["a"]
    assert [r["kind"] for r in sink.rows["hang"]] == ["comm_hang"]
    assert sorted(r["rule"] for r in sink.rows["alert"]) == ["hang", "slowdown"]
    assert w.stats.windows_stored == 1 and w.stats.hangs == 1 and w.stats.alerts == 2
    assert sink.offsets["s"] == w.source.positions(), "everything read is covered"


@pytest.mark.parametrize("reducer", ["windows", "hangs", "alerts", "downtime"])
def test_reducer_snapshots_name_shard_stats_fields(reducer):
    """Status is the reducers' snapshots: a key that is no field would vanish from status and metrics."""
    w = ShardWorker(0, [0], Config(), "s", consumer_factory=lambda: FakeSource([]), sink_factory=FakeSink,
                    submit=fake_analysis([]), clock=ManualClock())
    w.setup()
    fields = {f.name for f in dataclasses.fields(ShardStats)}
    assert set(getattr(w, reducer).snapshot()) <= fields
