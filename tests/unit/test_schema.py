"""The schema module: units, versions, IPC round trips, and bad input as errors with reasons."""
import pyarrow as pa
import pytest

from core import codec, topics
from core import schema as S
from core.layout import JobLayout
from generators.fleetgen import JobSpec, generate_window
from ingest.producer import split_for_wire


def _spans(n_steps=2):
    spec = JobSpec("job-a", JobLayout(dp_size=2, pp_size=2), num_microbatches=4)
    return generate_window(spec, 0, n_steps, 1_000_000_000)


@pytest.mark.parametrize("schema", list(S.ALL_SCHEMAS.values()), ids=list(S.ALL_SCHEMAS))
def test_every_schema_has_kind_version_and_documented_fields(schema):
    md = schema.metadata
    assert md[b"stragglerscope.version"] == str(S.SCHEMA_VERSION).encode()
    assert md[b"stragglerscope.kind"].decode() in S.ALL_SCHEMAS
    for f in schema:
        assert f.metadata and f.metadata.get(b"doc"), f"{f.name} has no doc"
        assert b"unit" in f.metadata


@pytest.mark.parametrize("name", ["start_ns", "duration_ns"])
def test_time_fields_are_nanoseconds(name):
    assert S.unit_of(S.OP_SPAN, name) == "ns"


def test_round_trip_op_spans():
    t = _spans()
    kind, back = codec.decode(codec.encode(t))
    assert kind == "op_span"
    assert back.equals(t)


def test_wire_payload_is_compact():
    t = _spans(4)
    assert len(codec.encode(t)) / t.num_rows < 40  # bytes per op record after zstd


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "not an Arrow IPC stream"),
        (b"\x00garbage" * 10, "not an Arrow IPC stream"),
    ],
)
def test_garbage_is_a_decode_error_with_reason(payload, reason):
    with pytest.raises(codec.DecodeError, match=reason):
        codec.decode(payload)


def test_unknown_kind_and_version_are_rejected():
    t = pa.table({"x": [1]})
    with pytest.raises(codec.DecodeError, match="unknown record kind"):
        codec.decode(codec.encode(t))
    future = _spans().replace_schema_metadata({b"stragglerscope.kind": b"op_span", b"stragglerscope.version": b"99"})
    with pytest.raises(codec.DecodeError, match="unsupported schema version '99'"):
        codec.decode(codec.encode(future))


def test_missing_and_mistyped_columns_name_the_column():
    t = _spans()
    with pytest.raises(codec.DecodeError, match="missing column 'seq_id'"):
        codec.conform(t.drop_columns(["seq_id"]), S.OP_SPAN)
    bad = t.set_column(t.schema.get_field_index("step"), "step", pa.array(["x"] * t.num_rows))
    with pytest.raises(codec.DecodeError, match="column 'step'"):
        codec.conform(bad, S.OP_SPAN)


def test_nulls_in_required_columns_are_rejected():
    t = _spans()
    col = pa.array([None] + t["duration_ns"].to_pylist()[1:], pa.int64())
    with pytest.raises(codec.DecodeError, match="'duration_ns' has 1 nulls"):
        codec.conform(t.set_column(t.schema.get_field_index("duration_ns"), "duration_ns", col), S.OP_SPAN)


def test_safe_casts_are_applied():
    t = _spans()
    i = t.schema.get_field_index("dp_rank")
    widened = t.set_column(i, "dp_rank", t["dp_rank"].cast(pa.int64()))
    assert codec.conform(widened, S.OP_SPAN).schema.field("dp_rank").type == pa.int32()


def test_validate_op_spans_splits_bad_rows_with_reason():
    t = _spans()
    d = t["duration_ns"].to_pylist()
    d[3] = -5
    t = t.set_column(t.schema.get_field_index("duration_ns"), "duration_ns", pa.array(d, pa.int64()))
    good, bad, reason = codec.validate_op_spans(t)
    assert bad.num_rows == 1 and good.num_rows == t.num_rows - 1
    assert "negative" in reason


def test_split_for_wire_respects_the_message_limit():
    t = pa.concat_tables([_spans(4)] * 20)
    parts = split_for_wire(t, max_bytes=20_000)
    assert len(parts) > 1
    assert all(len(p) <= 20_000 for p in parts)
    assert sum(codec.decode(p)[1].num_rows for p in parts) == t.num_rows


def test_layout_from_golden_meta():
    lay = JobLayout.from_meta({"dp_size": 4, "pp_size": 4, "tp_size": 4, "dsp_size": 2, "vpp_size": 1})
    assert (lay.world_size, lay.n_workers, lay.cp_size) == (128, 16, 2)
    with pytest.raises(ValueError, match="pp_size"):
        JobLayout.from_meta({"dp_size": 4})
    with pytest.raises(ValueError, match="dp_size must be a positive integer"):
        JobLayout(dp_size=0, pp_size=1)


# --------------------------------------------------------------------------
# Version 2: checkpoints, downtime, fields added with defaults
# --------------------------------------------------------------------------
def _ckpt_rows():
    return [dict(job_id="job-a", attempt=1, rank=r, step=999, ts_ns=10**18 + r, duration_ns=30 * 10**9, kind=k)
            for r in (0, 1) for k in ("save", "load")]


def test_checkpoint_round_trip_on_its_topic():
    t = codec.from_rows(S.CHECKPOINT, _ckpt_rows())
    kind, back = codec.decode(codec.encode(t))
    assert kind == "checkpoint" and back.equals(t)
    assert topics.TOPIC_OF_KIND["checkpoint"] == topics.TOPIC_CHECKPOINTS
    assert topics.TOPIC_CHECKPOINTS in topics.INPUT_TOPICS
    assert S.unit_of(S.CHECKPOINT, "duration_ns") == "ns" and S.unit_of(S.CHECKPOINT, "ts_ns") == "ns"


def test_validate_checkpoints_splits_bad_rows_with_reason():
    rows = _ckpt_rows()
    rows[1]["kind"] = "copy"
    rows[2]["duration_ns"] = -1
    good, bad, reason = codec.validate_checkpoints(codec.from_rows(S.CHECKPOINT, rows))
    assert (good.num_rows, bad.num_rows) == (2, 2) and "unknown kind" in reason
    assert codec.validate_checkpoints(codec.from_rows(S.CHECKPOINT, _ckpt_rows()))[1] is None


@pytest.mark.parametrize("schema", list(S.ALL_SCHEMAS.values()), ids=list(S.ALL_SCHEMAS))
def test_fields_added_later_come_last_with_a_default(schema):
    since = [int((f.metadata or {}).get(b"since", b"1")) for f in schema]
    assert since == sorted(since), "a field added later goes at the end of its schema"
    for f, v in zip(schema, since):
        assert (v > 1) == S.default_of(f)[0], f.name


def _as_version_1(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """What a version-1 producer sent: without the fields added since, labelled version 1."""
    old = [f.name for f in schema if S.default_of(f)[0]]
    md = dict(table.schema.metadata or {})
    md[b"stragglerscope.version"] = b"1"
    return table.drop_columns(old).replace_schema_metadata(md)


def test_version_1_records_still_decode_with_defaults():
    import math

    from generators.fleetgen import JobSpec

    reg = JobSpec("job-a", JobLayout(dp_size=2, pp_size=2), num_microbatches=4).registration(5, 2)
    kind, back = codec.decode(codec.encode(_as_version_1(reg, S.JOB)))
    assert kind == "job" and back.column("params").to_pylist() == [0]
    assert back.column("seq_len").to_pylist() == [0] and back.column("n_gpus").to_pylist() == [4]

    win = codec.from_rows(S.WINDOW, [dict(
        job_id="j", attempt=0, window_id=0, first_step=0, last_step=1, n_steps=2, start_ns=0, end_ns=1,
        analyzed_ns=2, team="", model="", n_gpus=8, dp_size=8, pp_size=1, slowdown=1.2, launch_slowdown=1.0,
        waste_fraction=0.1, step_time_actual=1.0, step_time_sim=1.0, step_time_ideal=0.8, gpu_hours=1.0,
        wasted_gpu_hours=0.1, m_w=0.5, m_s=0.1, verdict="", verdicts_json="[]", complete=True, note="", n_ops=1)])
    assert math.isnan(win.column("mfu")[0].as_py())  # from_rows fills what a row leaves out
    kind, back = codec.decode(codec.encode(_as_version_1(win, S.WINDOW)))
    assert kind == "window" and math.isnan(back.column("mfu_ideal")[0].as_py())

    hb = codec.from_rows(S.HEARTBEAT, [dict(job_id="j", attempt=0, rank=0, host="h", pid=1, ts_ns=1, step=3,
                                            last_op="", last_op_end_ns=0, inflight_op="", inflight_group="",
                                            inflight_seq=-1, inflight_since_ns=-1, clock_offset_ns=0, stack="")])
    back = codec.conform(_as_version_1(hb, S.HEARTBEAT), S.HEARTBEAT)
    assert back.column("step_done").to_pylist() == [-1] and back.column("step_done_ns").to_pylist() == [-1]


def test_versions_outside_the_readable_range_are_rejected():
    for v in (b"0", str(S.SCHEMA_VERSION + 1).encode(), b"x"):
        t = _spans().replace_schema_metadata({b"stragglerscope.kind": b"op_span", b"stragglerscope.version": v})
        with pytest.raises(codec.DecodeError, match="unsupported schema version"):
            codec.decode(codec.encode(t))


def _ipc(table: pa.Table, kind: bytes, version: bytes) -> bytes:
    """An IPC stream written by hand (not by ``codec.encode``) with the given kind and version metadata."""
    table = table.replace_schema_metadata({b"stragglerscope.kind": kind, b"stragglerscope.version": version})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _window_row() -> pa.Table:
    return codec.from_rows(S.WINDOW, [dict(
        job_id="j", attempt=0, window_id=0, first_step=0, last_step=1, n_steps=2, start_ns=0, end_ns=1,
        analyzed_ns=2, team="", model="", n_gpus=8, dp_size=8, pp_size=1, slowdown=1.2, launch_slowdown=1.0,
        waste_fraction=0.1, step_time_actual=1.0, step_time_sim=1.0, step_time_ideal=0.8, gpu_hours=1.0,
        wasted_gpu_hours=0.1, m_w=0.5, m_s=0.1, verdict="", verdicts_json="[]", complete=True, note="", n_ops=1,
        mfu=0.4, mfu_ideal=0.5)])


def test_the_old_kind_names_decode_as_the_kinds_named_as_their_tables():
    """Producers of versions 1 and 2 (exporters not yet upgraded, spooled and dead-lettered messages)
    stamp job_registration, window_result and step_result; they decode as job, window and step_slowdown."""
    reg = JobSpec("job-a", JobLayout(dp_size=2, pp_size=2), num_microbatches=4).registration(5, 2)
    step = codec.from_rows(S.STEP_SLOWDOWN, [dict(job_id="j", attempt=0, window_id=0, step=3, actual_s=1.1,
                                                  sim_s=1.0, ideal_s=0.8, slowdown=1.25)])
    sent = {"job": reg, "window": _window_row(), "step_slowdown": step}
    assert set(codec.KIND_ALIASES.values()) == set(sent)
    for old, new in codec.KIND_ALIASES.items():
        assert old not in S.ALL_SCHEMAS and new in S.ALL_SCHEMAS
        kind, back = codec.decode(_ipc(sent[new], old.encode(), b"2"))
        assert kind == new and S.kind_of(back.schema) == new and back.equals(sent[new]), old
    # A version-1 registration under its old name: the alias and the defaults of later fields together.
    old_reg = _as_version_1(reg, S.JOB)
    kind, back = codec.decode(_ipc(old_reg, b"job_registration", b"1"))
    assert kind == "job" and back.column("params").to_pylist() == [0]


@pytest.mark.parametrize("kind", [b"job_registrations", b"window_results", b"results", b"JOB", b""])
def test_a_kind_neither_known_nor_an_old_name_is_still_refused(kind):
    with pytest.raises(codec.DecodeError, match="unknown record kind"):
        codec.decode(_ipc(_window_row(), kind, b"2"))


def test_a_new_field_still_needs_a_default():
    with pytest.raises(ValueError, match="needs a default"):
        S._f("x", pa.int64(), "", "doc", since=2)
