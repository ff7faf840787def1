"""The schema module: units, versions, IPC round trips, and bad input as errors with reasons."""
import pyarrow as pa
import pytest

from ingest import schema as S
from ingest.fleetgen import JobSpec, generate_window
from ingest.producer import split_for_wire


def _spans(n_steps=2):
    spec = JobSpec("job-a", S.JobLayout(dp_size=2, pp_size=2), num_microbatches=4)
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
    kind, back = S.decode(S.encode(t))
    assert kind == "op_span"
    assert back.equals(t)


def test_wire_payload_is_compact():
    t = _spans(4)
    assert len(S.encode(t)) / t.num_rows < 40  # bytes per op record after zstd


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "not an Arrow IPC stream"),
        (b"\x00garbage" * 10, "not an Arrow IPC stream"),
    ],
)
def test_garbage_is_a_decode_error_with_reason(payload, reason):
    with pytest.raises(S.DecodeError, match=reason):
        S.decode(payload)


def test_unknown_kind_and_version_are_rejected():
    t = pa.table({"x": [1]})
    with pytest.raises(S.DecodeError, match="unknown record kind"):
        S.decode(S.encode(t))
    future = _spans().replace_schema_metadata({b"stragglerscope.kind": b"op_span", b"stragglerscope.version": b"99"})
    with pytest.raises(S.DecodeError, match="unsupported schema version '99'"):
        S.decode(S.encode(future))


def test_missing_and_mistyped_columns_name_the_column():
    t = _spans()
    with pytest.raises(S.DecodeError, match="missing column 'seq_id'"):
        S.conform(t.drop_columns(["seq_id"]), S.OP_SPAN)
    bad = t.set_column(t.schema.get_field_index("step"), "step", pa.array(["x"] * t.num_rows))
    with pytest.raises(S.DecodeError, match="column 'step'"):
        S.conform(bad, S.OP_SPAN)


def test_nulls_in_required_columns_are_rejected():
    t = _spans()
    col = pa.array([None] + t["duration_ns"].to_pylist()[1:], pa.int64())
    with pytest.raises(S.DecodeError, match="'duration_ns' has 1 nulls"):
        S.conform(t.set_column(t.schema.get_field_index("duration_ns"), "duration_ns", col), S.OP_SPAN)


def test_safe_casts_are_applied():
    t = _spans()
    i = t.schema.get_field_index("dp_rank")
    widened = t.set_column(i, "dp_rank", t["dp_rank"].cast(pa.int64()))
    assert S.conform(widened, S.OP_SPAN).schema.field("dp_rank").type == pa.int32()


def test_validate_op_spans_splits_bad_rows_with_reason():
    t = _spans()
    d = t["duration_ns"].to_pylist()
    d[3] = -5
    t = t.set_column(t.schema.get_field_index("duration_ns"), "duration_ns", pa.array(d, pa.int64()))
    good, bad, reason = S.validate_op_spans(t)
    assert bad.num_rows == 1 and good.num_rows == t.num_rows - 1
    assert "negative" in reason


def test_split_for_wire_respects_the_message_limit():
    t = pa.concat_tables([_spans(4)] * 20)
    parts = split_for_wire(t, max_bytes=20_000)
    assert len(parts) > 1
    assert all(len(p) <= 20_000 for p in parts)
    assert sum(S.decode(p)[1].num_rows for p in parts) == t.num_rows


def test_layout_from_golden_meta():
    lay = S.JobLayout.from_meta({"dp_size": 4, "pp_size": 4, "tp_size": 4, "dsp_size": 2, "vpp_size": 1})
    assert (lay.world_size, lay.n_workers, lay.cp_size) == (128, 16, 2)
    with pytest.raises(ValueError, match="pp_size"):
        S.JobLayout.from_meta({"dp_size": 4})
    with pytest.raises(ValueError, match="dp_size must be a positive integer"):
        S.JobLayout(dp_size=0, pp_size=1)
