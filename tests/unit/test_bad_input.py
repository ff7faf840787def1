"""Bad input at the shard's boundary: every kind is a dead letter (or a flagged result) with its reason,
and the good job beside it keeps its exact result.

The campaign of issue 18 as a table: each case builds one or a few messages,
all of them are fed to one shard (real what-if analysis, in process) together
with a good job, and then each case's outcome is checked. A case that crashed
the shard, or changed the good job's S, fails the whole table.
"""
from __future__ import annotations

import io
import math
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from core import codec, topics
from core import schema as S
from core.config import Config
from core.layout import JobLayout
from generators.fleetgen import JobSpec, generate_window
from analyzers.window import analyze_window
from ray_jobs.kafka_source import Message
from ray_jobs.shard import ShardWorker
from tests.fakes import FakeSink, FakeSource, ManualClock

STEPS = 2
NOW_NS = time.time_ns() // 10**9 * 10**9  # the shard's wall clock (the real one, for the pipeline test)
T0 = NOW_NS - 3600 * 10**9  # the jobs ran an hour ago
HOUR_NS = 3600 * 10**9


def spec(job_id, dp=2, pp=2):
    return JobSpec(job_id, JobLayout(dp_size=dp, pp_size=pp), num_microbatches=4)


def ops(job_id="bad", window=0, **layout):
    return generate_window(spec(job_id, **layout), window, STEPS, T0)


def reg(job_id="bad", **changes):
    t = spec(job_id).registration(T0, STEPS)
    return t.from_pylist([dict(t.to_pylist()[0], **changes)], schema=t.schema)


def setcol(t: pa.Table, name: str, values) -> pa.Table:
    i = t.column_names.index(name)
    return t.set_column(i, t.field(i), pa.array(values, type=t.field(i).type) if not isinstance(values, pa.Array)
                        else values)


def first_row(t: pa.Table, name: str, value) -> pa.Table:
    """``t`` with ``name`` of its first row set to ``value``."""
    col = t[name].to_pylist()
    col[0] = value
    return setcol(t, name, col)


def raw(t: pa.Table, compression=None) -> bytes:
    return codec.encode(t, compression=compression)


def with_metadata(t: pa.Table, **md: bytes) -> bytes:
    schema = codec.wire_schema(t.schema)
    meta = dict(schema.metadata)
    meta.update({f"stragglerscope.{k}".encode(): v for k, v in md.items()})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, schema.with_metadata(meta)) as w:
        w.write_table(t.cast(schema.with_metadata(meta)))
    return sink.getvalue()


def poison_offsets(t: pa.Table) -> bytes:
    """Valid schema, but a string offset of job_id points far past the data: Arrow's reader lets it through."""
    payload = bytearray(raw(t))
    ends = np.arange(t.num_rows + 1, dtype=np.int32) * len(t["job_id"][0].as_py())
    at = payload.find(ends.tobytes())
    assert at > 0, "the offsets buffer of job_id was not found"
    payload[at + 4 * 5: at + 4 * 6] = np.int32(1 << 30).tobytes()
    return bytes(payload)


def bad_utf8(t: pa.Table) -> bytes:
    payload = bytearray(raw(t))
    at = payload.find(b"bad" * 3)  # the string data of job_id
    payload[at] = 0xFF
    return bytes(payload)


def ccl(job_id="bad", enter_ns=T0, exit_ns=T0 + 10**6, rank=0) -> pa.Table:
    return codec.from_rows(S.CCL_RECORD, [dict(
        job_id=job_id, attempt=0, rank=rank, host="h0", window_id=-1, step=1, group="dp:pp=0", group_ranks=[0, 1],
        seq=1, op="all_reduce", algorithm="ring", nbytes=1024, enter_ns=enter_ns, exit_ns=exit_ns, peers=[1],
        peer_transfer_ns=[1000], peer_bytes=[1024], recv_wait_ns=0)])


def heartbeat(job_id="bad", ts_ns=NOW_NS, rank=0, **changes) -> pa.Table:
    row = dict(job_id=job_id, attempt=0, rank=rank, host="h0", pid=1, ts_ns=ts_ns, step=3, last_op="optimizer",
               last_op_end_ns=ts_ns - 10**9, inflight_op="", inflight_group="", inflight_seq=-1,
               inflight_since_ns=-1, clock_offset_ns=0, stack="", step_done=2, step_done_ns=ts_ns - 10**9)
    row.update(changes)
    return codec.from_rows(S.HEARTBEAT, [row])


def checkpoint(job_id="bad", **changes) -> pa.Table:
    row = dict(job_id=job_id, attempt=0, rank=0, step=1, ts_ns=T0, duration_ns=10**9, kind="save")
    row.update(changes)
    return codec.from_rows(S.CHECKPOINT, [row])


def clock_skewed_window(job_id="skewed") -> pa.Table:
    t = ops(job_id)
    one = pc.and_(pc.equal(t["dp_rank"], 1), pc.equal(t["pp_rank"], 0))
    return setcol(t, "start_ns", pc.if_else(one, pc.add(t["start_ns"], 3 * HOUR_NS), t["start_ns"]))


def compressed_bomb(job_id="bad", batches=8, mb=16) -> bytes:
    """Good op spans of one row, each batch with an extra column of ``mb`` MB of zero bytes: 128 MB decoded, a few KB
    with zstd. Decompressing it held a shard's loop for as long as it took; refused from its metadata, it costs
    microseconds."""
    one = ops(job_id).slice(0, 1)
    schema = codec.wire_schema(one.schema)
    zeros = pa.array(np.zeros(mb << 20, np.uint8)).buffers()[1]
    pad = pa.FixedSizeBinaryArray.from_buffers(pa.binary(mb << 20), 1, [None, zeros])
    batch = pa.Table.from_arrays(one.cast(schema).columns + [pad], schema=schema.append(pa.field("pad", pad.type)))
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        for _ in range(batches):
            w.write_table(batch)
    return sink.getvalue()


def foreign_optimizers() -> pa.Table:
    """Optimizer ops of workers outside the 2 x 2 good job's layout, under its key: they used to close its
    window early as failed and drop its real ops as late. (Ops inside the layout look like real data.)"""
    t = ops("good", dp=8, pp=4)
    outside = pc.or_(pc.greater_equal(t["dp_rank"], 2), pc.greater_equal(t["pp_rank"], 2))
    return t.filter(pc.and_(pc.and_(pc.equal(t["optype"], "optimizer"), pc.equal(t["step"], t["step"][0])), outside))


# (case, topic, key, payload, expected outcome). Outcome: a substring of the dead letter's reason, or
# ("window", verdict substring) for a stored, flagged window of that job, or ("corrected", None).
OPS, JOBS, HB, CCL, CKPT = (topics.TOPIC_OPS, topics.TOPIC_JOBS, topics.TOPIC_HEARTBEATS, topics.TOPIC_CCL,
                            topics.TOPIC_CHECKPOINTS)
CASES = [
    ("garbage", OPS, "bad", b"not arrow at all", "not an Arrow IPC stream"),
    ("empty payload", OPS, "bad", b"", "not an Arrow IPC stream"),
    ("truncated stream", OPS, "bad", raw(ops())[:700], "not an Arrow IPC stream"),
    ("string offsets past the data", OPS, "bad", poison_offsets(ops()), "invalid Arrow buffers"),
    ("job id not UTF-8", OPS, "bad", bad_utf8(ops(job_id="badbadbad")), "invalid Arrow buffers"),
    ("version superscript two", OPS, "bad", with_metadata(ops(), version="\u00b2".encode()), "not ASCII"),
    ("version not UTF-8", OPS, "bad", with_metadata(ops(), version=b"\xff\xfe"), "not ASCII"),
    ("kind not UTF-8", OPS, "bad", with_metadata(ops(), kind=b"\xc3\x28"), "not ASCII"),
    ("unknown kind", OPS, "bad", with_metadata(ops(), kind=b"op_spam"), "unknown record kind"),
    ("version 99", OPS, "bad", with_metadata(ops(), version=b"99"), "schema version"),
    ("kind on the wrong topic", HB, "bad", raw(ops()), "record on topic"),
    ("missing column", OPS, "bad", raw(ops().drop_columns(["duration_ns"])), "missing column"),
    ("string where an int goes", OPS, "bad", raw(ops().set_column(
        ops().column_names.index("step"), pa.field("step", pa.string()), pa.array(["x"] * ops().num_rows))),
     "column 'step'"),
    ("rank past int32", OPS, "bad", raw(ops().set_column(2, pa.field("rank", pa.int64()), pa.array(
        [1 << 40] * ops().num_rows, pa.int64()))), "column 'rank'"),
    ("nulls in a required column", OPS, "bad", raw(ops().set_column(
        ops().column_names.index("duration_ns"), pa.field("duration_ns", pa.int64()),
        pa.nulls(ops().num_rows, pa.int64()))), "nulls"),
    ("newline in the job id", OPS, "a\nb", raw(ops(job_id="a\nb")), "characters outside"),
    ("job id of 1000 characters", OPS, "j" * 1000, raw(ops(job_id="j" * 1000)), "longer than 128"),
    ("empty job id", OPS, "", raw(ops(job_id="")), "job id is empty"),
    ("key differs from the job id", OPS, "other", raw(ops(job_id="bad")), "differs from the Kafka key"),
    ("no key", OPS, None, raw(ops(job_id="bad")), "no Kafka key"),
    ("negative attempt", OPS, "bad", raw(setcol(ops(), "attempt", [-1] * ops().num_rows)), "negative attempt"),
    ("duration 2^63-1", OPS, "bad", raw(first_row(ops(), "duration_ns", (1 << 63) - 1)), "duration over"),
    ("duration 10^15 ns", OPS, "bad", raw(first_row(ops(), "duration_ns", 10**15)), "duration over"),
    ("negative duration", OPS, "bad", raw(first_row(ops(), "duration_ns", -5)), "negative duration"),
    ("negative start", OPS, "bad", raw(first_row(ops(), "start_ns", -1)), "start_ns outside"),
    ("start in 2200", OPS, "bad", raw(first_row(ops(), "start_ns", 1 << 62)), "start_ns outside"),
    ("negative step", OPS, "bad", raw(first_row(ops(), "step", -3)), "negative step"),
    ("microbatch -7", OPS, "bad", raw(first_row(ops(), "mb_id", -7)), "microbatch below -1"),
    ("optimizer ops of ranks outside the good job's layout", OPS, "good",
     raw(foreign_optimizers()), "dp_rank outside 0..1"),
    ("registration dp_size 0", JOBS, "bad", raw(reg(dp_size=0)), "layout sizes must be at least 1"),
    ("registration world 10^10", JOBS, "bad", raw(reg(dp_size=100_000, pp_size=100_000, n_gpus=0)),
     "over validation.max_world_size"),
    ("registration n_gpus 2^31-1", JOBS, "bad", raw(reg(n_gpus=(1 << 31) - 1)), "differs from the layout"),
    ("registration NaN peak FLOP/s", JOBS, "bad", raw(reg(peak_flops=float("nan"))), "finite"),
    ("registration negative microbatches", JOBS, "bad", raw(reg(num_microbatches=-4)), "negative num_microbatches"),
    ("registration job id with a space", JOBS, "a b", raw(reg(job_id="a b")), "characters outside"),
    ("registration without a Kafka key", JOBS, None, raw(reg("nokey")), "no Kafka key"),
    ("registration keyed by another job", JOBS, "good", raw(reg("thief")), "differs from the Kafka key"),
    ("CCL exit before enter", CCL, "bad", raw(ccl(exit_ns=T0 - 10**9)), "exit_ns before enter_ns"),
    ("CCL of 11 days", CCL, "bad", raw(ccl(exit_ns=T0 + 10**15)), "longer than"),
    ("CCL in flight since 1970", CCL, "bad", raw(ccl(enter_ns=10**9, exit_ns=-1)), "in flight since"),
    ("CCL entered 3 h in the future", CCL, "bad", raw(ccl(enter_ns=NOW_NS + 3 * HOUR_NS, exit_ns=-1)), "ahead of"),
    ("CCL rank outside the layout", CCL, "good", raw(ccl("good", rank=9)), "rank outside the registered layout"),
    ("heartbeat last op in the future", HB, "bad", raw(heartbeat(last_op_end_ns=NOW_NS + 5 * HOUR_NS)),
     "last_op_end_ns outside"),
    ("heartbeat of a negative rank", HB, "bad", raw(heartbeat(rank=-2)), "rank outside"),
    ("checkpoint of an unknown kind", CKPT, "bad", raw(checkpoint(kind="snapshot")), "kind other than save"),
    ("checkpoint of 2^62 ns", CKPT, "bad", raw(checkpoint(duration_ns=1 << 62)), "duration negative or over"),
    ("checkpoint of a negative rank", CKPT, "bad", raw(checkpoint(rank=-1)), "rank outside"),
    ("CCL of negative bytes", CCL, "bad", raw(ccl(rank=1).set_column(
        ccl().column_names.index("nbytes"), pa.field("nbytes", pa.int64()), pa.array([-1], pa.int64()))),
     "negative nbytes"),
    ("registration of a negative attempt", JOBS, "bad", raw(reg(attempt=-1)), "negative attempt"),
    ("registration stamped before 1970", JOBS, "bad", raw(reg(ts_ns=-5)), "ts_ns outside"),
    ("op span of global rank 99 in a 2 x 2 job", OPS, "good", raw(first_row(ops("good", window=500), "rank", 99).slice(0, 1)),
     "rank outside the registered layout"),
    ("heartbeat clock in 1970", HB, "hb1970", raw(heartbeat("hb1970", ts_ns=10**9, last_op_end_ns=5 * 10**8,
                                                          step_done_ns=5 * 10**8)), ("corrected", None)),
    ("heartbeat clock 3 h ahead", HB, "hbahead", raw(heartbeat("hbahead", ts_ns=NOW_NS + 3 * HOUR_NS)),
     ("corrected", None)),
    ("one worker's clock 3 h ahead", OPS, "skewed", raw(clock_skewed_window()), ("window", "clock_skew")),
    ("compressed bomb: 128 MB in a few KB", OPS, "bad", compressed_bomb(), "would decompress to 128 MB, over "
                                                                          "validation.max_decoded_mb (64 MB)"),
    ("unregistered ranks implying 4e10 workers", OPS, "huge",
     raw(setcol(setcol(ops("huge"), "dp_rank", [200_000] * ops().num_rows), "pp_rank", [200_000] * ops().num_rows)),
     ("window", "analysis_failed")),
]


def letter_of(letters: list[dict], topic: str, key: str | None, payload: bytes) -> str | None:
    """The reason of the dead letter of exactly this message (same topic, key and bytes), or None."""
    for r in letters:
        stored = bytes(r["payload"]) if "payload" in r else bytes.fromhex(r["payload_hex"])  # the store's view: hex
        if r["source_topic"] == topic and r["key"] == (key or "") and stored == payload[:65536]:
            return r["reason"]
    return None


def messages(entries) -> list[Message]:
    offsets: dict[str, int] = {}
    out = []
    for topic, key, payload in entries:
        off = offsets.get(topic, 0)
        offsets[topic] = off + 1
        out.append(Message(topic, 0, off, None if key is None else key.encode(), payload))
    return out


def run_shard(entries, cfg=None, sink=None):
    cfg = (cfg or Config()).replace(pipeline={"idle_timeout_s": 5.0, "commit_interval_s": 0.0,
                                              "state_interval_s": 0.0}, alerts={"min_gpus": 1})
    src = FakeSource(messages(entries), batch=8)
    sink = sink or FakeSink()
    clock = ManualClock(wall=lambda: NOW_NS)
    w = ShardWorker(0, [0], cfg, "bad-input", consumer_factory=lambda: src, sink_factory=lambda: sink,
                    submit=analyze_window, clock=clock)
    w.setup()
    for i in range(40):
        clock.t = i * 0.5  # past the idle timeout: every window closes
        w.step(poll_timeout_ms=0)
    w.stop()
    return w, sink


GOOD = [(JOBS, "good", raw(spec("good").registration(T0, STEPS))), (OPS, "good", raw(ops("good")))]


@pytest.fixture(scope="module")
def baseline():
    _, sink = run_shard(GOOD)
    (row,) = sink.rows["window"]
    return row


@pytest.fixture(scope="module")
def campaign():
    entries = list(GOOD)
    # The skewed job registers, so its window is judged on a known layout.
    entries.append((JOBS, "skewed", raw(spec("skewed").registration(T0, STEPS))))
    entries += [(topic, key, payload) for _, topic, key, payload, _ in CASES]
    return run_shard(entries)


def test_the_campaign_has_at_least_fifty_kinds_of_bad_input():
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)


def test_bad_input_never_costs_the_good_job_its_exact_result(campaign, baseline):
    w, sink = campaign
    (good,) = [r for r in sink.rows["window"] if r["job_id"] == "good"]
    assert good["complete"] and good["verdict"] != "analysis_failed"
    assert good["slowdown"] == pytest.approx(baseline["slowdown"], rel=1e-12)
    assert good["gpu_hours"] == pytest.approx(baseline["gpu_hours"], rel=1e-12)
    assert good["n_ops"] == baseline["n_ops"]
    assert w.stats.error == "", "no loop iteration failed"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_bad_input_has_its_outcome(campaign, case):
    w, sink = campaign
    name, topic, key, _payload, want = case
    if isinstance(want, str):
        got = letter_of(sink.rows.get("dead_letter", []), topic, key, _payload)
        assert got and want in got, f"{name}: dead letter {got!r} does not say {want!r}"
    elif want[0] == "window":
        rows = [r for r in sink.rows["window"] if r["job_id"] == key]
        assert rows and all(want[1] in r["verdict"] for r in rows), rows
        assert all(r["gpu_hours"] == 0 and math.isnan(r["slowdown"]) for r in rows), "kept out of fleet statistics"
    else:
        assert w.stats.clock_corrected_rows >= 2
        assert not [r for r in sink.rows.get("dead_letter", []) if r["key"] == key]


def test_no_absurd_value_is_stored(campaign):
    _, sink = campaign
    for r in sink.rows["window"]:
        assert r["gpu_hours"] < 1.0 and r["wasted_gpu_hours"] < 1.0, r
        assert math.isnan(r["slowdown"]) or r["slowdown"] < 10, r
        assert r["n_gpus"] <= 16
    assert len(sink.rows.get("worker_slowdown", [])) < 1000
    for r in sink.rows.get("hang", []):
        assert r["duration_s"] < 7200, r
    for r in sink.rows.get("job", []):
        assert r["job_id"] in ("good", "skewed")


def test_every_offset_moves_past_the_bad_input(campaign):
    w, sink = campaign
    committed = sink.offsets["bad-input"]
    for topic in (OPS, JOBS, HB, CCL, CKPT):
        sent = sum(1 for _, t, _, _, _ in CASES if t == topic) + sum(1 for t, _, _ in GOOD if t == topic) + (
            topic == JOBS)
        assert committed.get((topic, 0), 0) == sent, topic


def test_a_stored_registration_that_does_not_validate_is_skipped_at_start():
    """It used to raise in every shard start: Ray gave the actor up and `run` exited with a traceback."""
    sink = FakeSink()
    sink.rows["job"] = reg("old", dp_size=0).to_pylist() + reg("fine").to_pylist()
    w, sink = run_shard([(OPS, "fine", raw(ops("fine")))], sink=sink)
    assert w.stats.bad_stored_jobs == 1
    (row,) = sink.rows["window"]
    assert row["job_id"] == "fine" and row["complete"]


def test_an_analysis_that_raises_is_a_failed_window_and_the_others_are_stored():
    cfg = Config().replace(pipeline={"idle_timeout_s": 5.0, "commit_interval_s": 0.0, "state_interval_s": 0.0},
                           alerts={"min_gpus": 1})
    entries = [(JOBS, j, raw(spec(j).registration(T0, STEPS))) for j in ("x", "y", "z")]
    entries += [(OPS, j, raw(ops(j))) for j in ("x", "y", "z")]
    src = FakeSource(messages(entries), batch=16)
    sink = FakeSink()

    def submit(ops_, info, key, *rest):
        if key[0] == "y":
            raise OverflowError("int32 overflow in the analysis")
        return analyze_window(ops_, info, key, *rest)

    w = ShardWorker(0, [0], cfg, "s", consumer_factory=lambda: src, sink_factory=lambda: sink, submit=submit,
                    clock=ManualClock(wall=lambda: NOW_NS))
    w.setup()
    for _ in range(10):
        w.step(poll_timeout_ms=0)
    by_job = {r["job_id"]: r for r in sink.rows["window"]}
    assert set(by_job) == {"x", "y", "z"}
    assert by_job["y"]["verdict"] == "analysis_failed" and "OverflowError" in by_job["y"]["note"]
    assert by_job["x"]["complete"] and by_job["z"]["complete"]
    assert sink.offsets["s"][(OPS, 0)] == 3


class RefusingSink(FakeSink):
    """A store that refuses the rows of one job's window (a value it cannot take) and takes the rest."""

    def __init__(self, refuse: str):
        super().__init__()
        self.refuse = refuse

    def flush(self):
        for t in self._buf.get("window", []):
            if any(r["job_id"] == self.refuse and r["verdict"] != "analysis_failed" for r in t.to_pylist()):
                self._buf = {}
                raise ValueError("Code: 53. Type mismatch")
        super().flush()


def test_a_window_the_store_keeps_refusing_is_stored_as_failed_and_its_offset_moves_on():
    entries = [(JOBS, j, raw(spec(j).registration(T0, STEPS))) for j in ("p", "q")]
    entries += [(OPS, "p", raw(ops("p"))), (OPS, "q", raw(ops("q")))]
    w, sink = run_shard(entries, sink=RefusingSink("q"))
    by_job = {r["job_id"]: r for r in sink.rows["window"]}
    assert by_job["p"]["complete"]
    assert by_job["q"]["verdict"] == "analysis_failed" and "refused" in by_job["q"]["note"]
    assert sink.offsets["bad-input"][(OPS, 0)] == 2
