"""The exporter's CUDA path, without a GPU: a fake ``torch.cuda`` whose events complete when the test says.

What a real GPU run measures (benchmarks/gpu_exporter.py) rests on these
properties: the training thread only records events and never waits on one;
the resolver thread turns event pairs into spans in order; a step's records
leave when the step ends, even while training keeps the queue busy; close()
waits for the resolver, so the last ops are not lost.
"""
from __future__ import annotations

import threading
import time
import types

import pytest

from core import schema as S
from ingest.exporter import RankExporter, Sampling, place_anchor


class FakeGpu:
    """One stream. ``run(ms)`` is GPU work queued between two records; events complete up to
    ``complete()`` (or at once with ``auto``). Remembers every thread that waited on an event."""

    def __init__(self, auto: bool = True):
        self.auto = auto
        self.clock_ms = 0.0
        self.events: list[FakeEvent] = []
        self.done = -1
        self.cv = threading.Condition()
        self.waiters: set[int] = set()
        self.module = types.SimpleNamespace(Event=lambda enable_timing=False, blocking=False: FakeEvent(self))

    def run(self, ms: float) -> None:
        self.clock_ms += ms

    def complete(self, upto: int | None = None) -> None:
        with self.cv:
            self.done = len(self.events) - 1 if upto is None else upto
            self.cv.notify_all()

    def play(self, after_s: float) -> threading.Thread:
        """Run what is queued in real time, starting ``after_s`` from now (the GPU still busy with earlier
        work): event i completes at about ``after_s`` + its GPU time; ``ev.done_ns`` is when it did, on the
        host's perf_counter."""
        def run():
            time.sleep(after_s)
            base = time.perf_counter_ns()
            for ev in list(self.events):
                wait = base + ev.t * 1e6 - time.perf_counter_ns()
                if wait > 0:
                    time.sleep(wait / 1e9)
                ev.done_ns = time.perf_counter_ns()
                self.complete(upto=ev.idx)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


class FakeEvent:
    def __init__(self, gpu: FakeGpu):
        self.gpu, self.idx, self.t = gpu, None, None

    def record(self, stream=None) -> None:
        with self.gpu.cv:
            self.idx, self.t = len(self.gpu.events), self.gpu.clock_ms
            self.gpu.events.append(self)
        if self.gpu.auto:
            self.gpu.complete()

    def synchronize(self) -> None:
        self.gpu.waiters.add(threading.get_ident())
        with self.gpu.cv:
            assert self.gpu.cv.wait_for(lambda: self.gpu.done >= self.idx, timeout=10)

    def query(self) -> bool:
        return self.gpu.done >= self.idx

    def elapsed_time(self, end: "FakeEvent") -> float:
        self.gpu.waiters.add(threading.get_ident())
        if max(self.idx, end.idx) > self.gpu.done:
            raise RuntimeError("cudaErrorNotReady")  # what CUDA says for an event not yet complete
        return end.t - self.t


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu()
    monkeypatch.setattr(RankExporter, "_cuda_module", staticmethod(lambda use_cuda: fake.module))
    return fake


def _exporter(sent, sampling=Sampling(1, 1)):
    return RankExporter("job", 0, 0, 0, sent.append, sampling=sampling, heartbeat_s=3600, send_every_s=0.05)


def _rows(sent, kind):
    return [r for t in sent if S.kind_of(t.schema) == kind for r in t.to_pylist()]


def test_spans_come_from_event_pairs_in_order_and_the_training_thread_never_waits(gpu):
    sent = []
    exp = _exporter(sent)
    for step in range(2):
        with exp.step(step):
            gpu.run(1.0)
            for mb, ms in enumerate((3.0, 5.0)):
                with exp.op("forward-compute", mb_id=mb):
                    gpu.run(ms)
                gpu.run(0.5)
            # a host-timed op (a GC pause of 2 ms, timed on the host clock) between GPU work
            exp.record_op("gc", 10**12, 10**12 + 2_000_000)
            gpu.run(0.25)
            with exp.op("optimizer"):
                gpu.run(2.0)
    exp.close()
    assert threading.get_ident() not in gpu.waiters, "the training thread waited on an event"
    assert gpu.waiters, "nobody resolved the events"
    rows = _rows(sent, "op_span")
    order = (("forward-compute", 0), ("forward-compute", 1), ("gc", -1), ("optimizer", -1))
    rows.sort(key=lambda r: (r["step"], r["start_ns"]))
    assert [(r["step"], r["optype"], r["mb_id"]) for r in rows] == [(s, op, mb) for s in range(2) for op, mb in order]
    assert [r["duration_ns"] for r in rows] == [3_000_000, 5_000_000, 2_000_000, 2_000_000] * 2
    s0 = rows[:4]
    # starts keep the GPU's spacing: 3 ms of work and 0.5 ms of gap between the two forwards; the host-timed
    # op sits where the stream was when it was recorded (not at its host time), before the optimizer
    assert s0[1]["start_ns"] - s0[0]["start_ns"] == 3_500_000
    assert s0[2]["start_ns"] - s0[1]["start_ns"] == 5_500_000
    assert s0[3]["start_ns"] - s0[2]["start_ns"] == 250_000
    assert exp.stats.errors == 0


def test_a_step_is_sent_soon_after_it_ends_while_the_next_one_runs_on_the_gpu(monkeypatch):
    """Before, the resolver sent only when its queue stayed empty for 0.2 s (or at 4,096 ops), and the
    host-timed ops and collectives of a CUDA run waited for close(): a busy job sent nothing for hours."""
    gpu = FakeGpu(auto=False)
    monkeypatch.setattr(RankExporter, "_cuda_module", staticmethod(lambda use_cuda: gpu.module))
    sent, got_ccl = [], threading.Event()

    def sink(table):
        sent.append(table)
        if S.kind_of(table.schema) == "ccl_record":
            got_ccl.set()
    exp = RankExporter("job", 0, 0, 0, sink, sampling=Sampling(1, 1), heartbeat_s=3600, send_every_s=0.05)
    with exp.step(0):
        with exp.op("forward-compute"):
            gpu.run(4.0)
        exp.record_op("gc", 0, 1000)
        enter = exp.ccl_enter("all_reduce", "dp0", [0, 1], 0)
        exp.ccl_exit("all_reduce", "dp0", [0, 1], 0, enter, 1024, [1])
    step0_events = len(gpu.events)
    with exp.step(1):  # the next step's work is queued and still running on the GPU
        with exp.op("forward-compute"):
            gpu.run(4.0)
    gpu.complete(upto=step0_events - 1)
    try:
        assert got_ccl.wait(5), "step 0 was not sent while step 1 runs"
        got = {(r["step"], r["optype"]) for r in _rows(sent, "op_span")}
        assert got == {(0, "forward-compute"), (0, "gc")}
        assert [r["op"] for r in _rows(sent, "ccl_record")] == ["all_reduce"]
    finally:
        gpu.complete()
        exp.close()


def test_close_waits_for_events_still_running_on_the_gpu(monkeypatch):
    gpu = FakeGpu(auto=False)
    monkeypatch.setattr(RankExporter, "_cuda_module", staticmethod(lambda use_cuda: gpu.module))
    sent = []
    exp = _exporter(sent)
    with exp.step(0):
        for mb in range(3):
            with exp.op("backward-compute", mb_id=mb):
                gpu.run(7.0)
    threading.Timer(0.5, gpu.complete).start()  # the GPU finishes after training returned
    exp.close(timeout=10)
    rows = _rows(sent, "op_span")
    assert [(r["mb_id"], r["duration_ns"]) for r in rows] == [(0, 7_000_000), (1, 7_000_000), (2, 7_000_000)]


def test_collectives_recorded_while_the_resolver_sends_are_never_lost(gpu):
    sent = []
    exp = _exporter(sent)
    calls = 0
    for step in range(40):
        with exp.step(step):
            for seq in range(25):
                with exp.op("forward-compute"):
                    gpu.run(0.1)
                enter = exp.ccl_enter("all_reduce", "dp0", [0, 1], seq)
                exp.ccl_exit("all_reduce", "dp0", [0, 1], seq, enter, 8, [1])
                calls += 1
    exp.close()
    rows = _rows(sent, "ccl_record")
    assert len(rows) == calls
    assert len({(r["step"], r["seq"]) for r in rows}) == calls
    assert len(_rows(sent, "op_span")) == calls


def test_an_anchor_is_the_wake_time_when_waited_for_else_the_tightest_lower_bound():
    # waited on while pending: completion is when the resolver woke
    assert place_anchor(recorded_ns=100, seen_done_ns=900, waited=True, chained_ns=None) == 900
    # already complete when seen: between the record and the sighting; the chain is a second lower bound
    assert place_anchor(recorded_ns=100, seen_done_ns=900, waited=False, chained_ns=None) == 100
    assert place_anchor(recorded_ns=100, seen_done_ns=900, waited=False, chained_ns=600) == 600
    assert place_anchor(recorded_ns=700, seen_done_ns=900, waited=False, chained_ns=600) == 700
    # a chain that overshoots (its previous anchor a late wake-up) is cut at the sighting
    assert place_anchor(recorded_ns=100, seen_done_ns=900, waited=False, chained_ns=950) == 900


@pytest.mark.parametrize("gap_ms", [3.0, 0.0])  # unrecorded work between steps, or none (the chained anchor)
def test_spans_of_a_loop_running_ahead_of_the_gpu_are_placed_when_the_gpu_ran_them(monkeypatch, gap_ms):
    """The training thread queues three steps in a millisecond while the GPU is still busy for 150 ms more.
    Before, spans were placed from the host time at which their step was recorded: 150 ms early here, as
    early as the queue was deep in a real job that does not sync every step (found on the H100)."""
    gpu = FakeGpu(auto=False)
    monkeypatch.setattr(RankExporter, "_cuda_module", staticmethod(lambda use_cuda: gpu.module))
    sent = []
    exp = _exporter(sent)
    truth = {}  # (step, optype) -> (the step's reference event, GPU time of the span's start event in ms)
    for step in range(3):
        with exp.step(step):
            ref = exp._step_ref.ev
            gpu.run(gap_ms)
            for optype in ("forward-compute", "backward-compute"):
                with exp.op(optype):
                    truth[step, optype] = ref, gpu.clock_ms
                    gpu.run(15.0)
    player = gpu.play(after_s=0.15)
    player.join(5)
    exp.close()
    rows = _rows(sent, "op_span")
    assert len(rows) == 6 and exp.stats.errors == 0
    for r in rows:
        # when the GPU reached the step's first event, plus the GPU time from it to the span's start
        ref, t_ms = truth[r["step"], r["optype"]]
        expected = exp._to_job_clock(ref.done_ns + int((t_ms - ref.t) * 1e6))
        assert abs(r["start_ns"] - expected) < 8_000_000, (r["step"], r["optype"], (r["start_ns"] - expected) / 1e6)
        assert r["duration_ns"] == 15_000_000


def test_heartbeats_say_which_collective_the_gpu_is_inside(monkeypatch):
    """NCCL's calls return at once: the host is in no collective while its GPU waits in one. The heartbeat
    names the collective the GPU reached and has not finished, in unsampled steps too."""
    gpu = FakeGpu(auto=False)
    monkeypatch.setattr(RankExporter, "_cuda_module", staticmethod(lambda use_cuda: gpu.module))
    exp = RankExporter("job", 0, 0, 0, [].append, sampling=Sampling(1, 10), heartbeat_s=3600, nvml=False,
                       tcp_flows=False)

    def inflight():
        (hb,) = exp.heartbeat().to_pylist()
        return hb["inflight_op"], hb["inflight_group"], hb["inflight_seq"]

    exp.start_step(5)  # not sampled: untimed events, no record, still followed
    gpu.run(10.0)
    m = exp.gpu_mark("all_reduce", "world", 0)
    exp.ccl_exit("all_reduce", "world", [0, 1], 0, exp.now_ns(), 4, [1], gpu_enter=m)
    assert inflight() == ("", "", -1)  # the GPU has not reached it (still in the work before)
    gpu.complete(upto=m.enter.idx)
    assert inflight() == ("all_reduce", "world", 0)  # reached, not finished: what this rank waits in
    gpu.complete()
    assert inflight() == ("", "", -1)
    waited_never = exp.gpu_mark("all_reduce", "world", 1)  # async, never waited on: its end is unknown
    m2 = exp.gpu_mark("all_gather", "world", 2)
    exp.ccl_exit("all_gather", "world", [0, 1], 2, exp.now_ns(), 4, [1], gpu_enter=m2)
    gpu.complete(upto=m2.enter.idx)
    assert waited_never.exit is None and inflight() == ("all_gather", "world", 2)
    gpu.complete()
    exp.finish_step()
    exp.close()
    assert exp.stats.errors == 0
