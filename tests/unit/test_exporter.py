"""The exporter on CPU: sampling, spans, heartbeats with stacks, never raising into training."""
import threading

import pytest

from core import codec
from core import schema as S
from core.layout import fold_ranks
from ingest.exporter import RankExporter, Sampling, folded_stacks


@pytest.mark.parametrize("ranks, folded", [([0, 1, 2, 3, 5], "0-3,5"), ([7], "7"), ([], ""), ([3, 1, 2, 9, 8], "1-3,8-9")])
def test_fold_ranks(ranks, folded):
    assert fold_ranks(ranks) == folded


def test_sampling_profiles_k_of_every_n():
    s = Sampling(profile_steps=3, every=10)
    assert [s.window_of(i) for i in (0, 2, 3, 9, 10, 12, 13)] == [0, 0, None, None, 10, 10, None]
    with pytest.raises(ValueError):
        Sampling(profile_steps=11, every=10)


class SteppedTime:
    """Stands in for the exporter's ``time`` module: perf_counter_ns moves only when a test moves it."""

    def __init__(self):
        import time as real

        self.perf_ns = 10**12
        self.time_ns = real.time_ns

    def perf_counter_ns(self):
        return self.perf_ns

    def advance(self, seconds: float) -> None:
        self.perf_ns += int(seconds * 1e9)


@pytest.fixture
def clock(monkeypatch):
    fake = SteppedTime()
    monkeypatch.setattr("ingest.exporter.time", fake)
    return fake


def _exporter(sent, **kw):
    return RankExporter("job", 3, 1, 1, sent.append, sampling=Sampling(2, 4), heartbeat_s=3600, use_cuda=False, **kw)


def test_only_sampled_steps_emit_ops_with_seq_ids_and_window(clock):
    sent = []
    exp = _exporter(sent)
    for step in range(6):
        with exp.step(step):
            for mb in range(2):
                with exp.op("forward-compute", mb_id=mb):
                    clock.advance(0.001)
            with exp.op("optimizer"):
                pass
    exp.close()
    ops = [t for t in sent if S.kind_of(t.schema) == "op_span"]
    rows = [r for t in ops for r in t.to_pylist()]
    assert sorted({r["step"] for r in rows}) == [0, 1, 4, 5]
    assert {r["window_id"] for r in rows if r["step"] in (4, 5)} == {4}
    fwd = [r for r in rows if r["optype"] == "forward-compute" and r["step"] == 0]
    assert [r["seq_id"] for r in fwd] == [0, 1] and [r["mb_id"] for r in fwd] == [0, 1]
    assert all(r["duration_ns"] >= 1_000_000 for r in fwd)
    assert fwd[0]["start_ns"] + fwd[0]["duration_ns"] <= fwd[1]["start_ns"]
    assert all((r["rank"], r["dp_rank"], r["pp_rank"]) == (3, 1, 1) for r in rows)


def test_sink_failure_never_reaches_training():
    def broken(_):
        raise RuntimeError("kafka on fire")
    exp = RankExporter("job", 0, 0, 0, broken, sampling=Sampling(1, 1), heartbeat_s=3600, use_cuda=False)
    with exp.step(0):
        with exp.op("forward-compute"):
            pass
    assert exp.stats.errors == 1


def test_heartbeat_reports_the_op_in_flight_and_dumps_stacks_when_stuck(clock):
    sent = []
    exp = _exporter(sent, hang_dump_s=0.05)
    inside, release = threading.Event(), threading.Event()

    def training():
        with exp.step(0):
            with exp.op("forward-recv"):
                inside.set()
                release.wait(5)
    t = threading.Thread(target=training, name="trainer")
    t.start()
    assert inside.wait(5)
    clock.advance(0.15)  # stuck for three times hang_dump_s
    hb = exp.heartbeat().to_pylist()[0]
    assert hb["inflight_op"] == "forward-recv" and hb["step"] == 0
    assert "trainer" in hb["stack"] and "training" in hb["stack"]
    assert exp.heartbeat().to_pylist()[0]["stack"] == "", "one dump per stuck op"
    exp.request_stacks()
    assert exp.heartbeat().to_pylist()[0]["stack"]
    release.set()
    t.join()
    hb = exp.heartbeat().to_pylist()[0]
    assert hb["inflight_op"] == "" and hb["last_op"] == "forward-recv"


def test_folded_stacks_name_every_thread():
    text = folded_stacks()
    assert "MainThread" in text


def test_heartbeats_report_the_last_completed_step_and_close_sends_the_last_one():
    sent = []
    exp = _exporter(sent)
    assert exp.heartbeat().to_pylist()[0]["step_done"] == -1
    for step in range(3):
        with exp.step(step):
            pass
    before = exp.now_ns()
    with pytest.raises(RuntimeError):
        with exp.step(3):
            raise RuntimeError("a step that fails did not complete")
    hb = exp.heartbeat().to_pylist()[0]
    assert hb["step"] == 3 and hb["step_done"] == 2 and 0 < hb["step_done_ns"] <= before
    exp.close()
    exp.close()
    hbs = [t for t in sent if S.kind_of(t.schema) == "heartbeat"]
    assert len(hbs) == 1 and hbs[0].to_pylist()[0]["step_done"] == 2, "close() sends one last heartbeat"


def test_checkpoint_records_and_bad_arguments_never_raise(clock):
    sent = []
    exp = _exporter(sent)
    exp.checkpoint(99, "save", start_ns=10**18, duration_ns=5 * 10**9)
    with exp.checkpointing(99, kind="load"):
        clock.advance(0.001)
    with pytest.raises(OSError):
        with exp.checkpointing(199):
            raise OSError("disk full: a failed save is not reported")
    exp.checkpoint(5, "copy")
    exp.checkpoint(-1)
    rows = [r for t in sent if S.kind_of(t.schema) == "checkpoint" for r in t.to_pylist()]
    assert [(r["step"], r["kind"], r["rank"], r["job_id"]) for r in rows] == [(99, "save", 3, "job"),
                                                                              (99, "load", 3, "job")]
    assert rows[0]["ts_ns"] == 10**18 and rows[0]["duration_ns"] == 5 * 10**9
    assert rows[1]["duration_ns"] >= 1_000_000
    assert exp.stats.checkpoints == 2 and exp.stats.errors == 2
    kind, back = codec.decode(codec.encode(sent[-1]))
    assert kind == "checkpoint" and back.num_rows == 1


def test_ccl_records_carry_per_peer_timing_only_where_the_library_gave_it(clock):
    sent = []
    exp = _exporter(sent)
    with exp.step(0):
        t0 = exp.ccl_enter("all_reduce", "world", [0, 3], 0)
        clock.advance(0.002)
        exp.ccl_exit("all_reduce", "world", [0, 3], 0, t0, 4096, [0])  # from Python: enter and exit only
        t1 = exp.ccl_enter("send", "p2p:3>0", [3, 0], 0)
        exp.ccl_exit("send", "p2p:3>0", [3, 0], 0, t1, 4096, [0], peer_transfer_ns=[1500], peer_bytes=[4096],
                     recv_wait_ns=0)  # a library that timed its peer
        with pytest.raises(ValueError, match="2 per-peer transfer times for 1 peers"):
            exp.ccl_exit("send", "p2p:3>0", [3, 0], 1, t1, 4096, [0], peer_transfer_ns=[1, 2])
    exp.close()
    rows = [r for t in sent if S.kind_of(t.schema) == "ccl_record" for r in t.to_pylist()]
    plain, timed = sorted(rows, key=lambda r: r["op"])
    assert (plain["peer_transfer_ns"], plain["peer_bytes"], plain["recv_wait_ns"]) == ([], [], -1)
    assert plain["exit_ns"] - plain["enter_ns"] >= 2_000_000
    assert (timed["peer_transfer_ns"], timed["peer_bytes"], timed["recv_wait_ns"]) == ([1500], [4096], 0)


def test_a_checkpoint_save_is_in_flight_in_the_heartbeats_while_it_runs():
    """The hang detector waits hang.checkpoint_s for a rank that says it is saving (issue 41)."""
    sent = []
    exp = RankExporter("job", 0, 0, 0, sent.append, sampling=Sampling(1, 1), heartbeat_s=3600, use_cuda=False)
    with exp.checkpointing(step=7):
        (beat,) = exp.heartbeat().to_pylist()
        assert beat["inflight_op"] == "checkpoint-save" and beat["inflight_since_ns"] > 0
    (after,) = exp.heartbeat().to_pylist()
    assert after["inflight_op"] == "" and after["last_op"] == "checkpoint-save"
    assert after["last_op_end_ns"] >= beat["inflight_since_ns"]
    exp.close()


def test_a_checkpoint_save_stays_in_flight_through_its_own_collectives():
    """torch.distributed.checkpoint gathers plans and meets at a barrier inside its save: the wrapped
    collectives must not leave the heartbeats saying nothing while the writes go on (a 40 s save was paged)."""
    from ingest.exporter import RankExporter

    exp = RankExporter("j", 0, 0, 0, lambda t: None, use_cuda=False, tcp_flows=False, nvml=False, heartbeat_s=3600)
    try:
        with exp.checkpointing(10):
            t = exp.ccl_enter("all_gather_object", "world", [0, 1], 3)
            assert exp.heartbeat().to_pylist()[0]["inflight_op"] == "checkpoint-save"
            exp.ccl_exit("all_gather_object", "world", [0, 1], 3, t, 8, [])
            row = exp.heartbeat().to_pylist()[0]
            assert row["inflight_op"] == "checkpoint-save" and row["inflight_since_ns"] > 0
        assert exp.heartbeat().to_pylist()[0]["inflight_op"] == ""
    finally:
        exp.close()


def test_this_machine_has_one_host_id():
    from ingest.exporter import host_id

    assert host_id() == host_id() and isinstance(host_id(), int)
