"""Payloads small on the wire and huge once decoded: ``codec.decode(payload, max_decoded_bytes)`` refuses them
from their metadata, before decompressing or casting anything (a 14 KB message held a shard's loop for 3.4 s)."""
from __future__ import annotations

import io
import random
import time

import numpy as np
import pyarrow as pa
import pytest

from core import codec
from core import schema as S
from core.config import ValidationConfig
from core.layout import JobLayout
from generators.fleetgen import JobSpec, generate_window

LIMIT = int(ValidationConfig().max_decoded_mb * 2**20)
T0 = 1_700_000_000 * 10**9


def op_spans(job_id="j", rows=None):
    t = generate_window(JobSpec(job_id, JobLayout(dp_size=2, pp_size=2), num_microbatches=4), 0, 2, T0)
    return t if rows is None else t.slice(0, rows)


def stream(tables, schema=None, compression="zstd") -> bytes:
    """One IPC stream of ``tables`` (batches of one schema), as an exporter would write it, but unchecked."""
    sink = io.BytesIO()
    schema = schema or tables[0].schema
    with pa.ipc.new_stream(sink, schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        for t in tables:
            w.write_table(t)
    return sink.getvalue()


def with_kind(t: pa.Table, kind=b"op_span") -> pa.Table:
    md = {b"stragglerscope.kind": kind, b"stragglerscope.version": str(S.SCHEMA_VERSION).encode()}
    return t.replace_schema_metadata(md)


def refused_in(payload: bytes, limit: int = LIMIT) -> tuple[str, float]:
    t0 = time.perf_counter()
    with pytest.raises(codec.DecodeError) as e:
        codec.decode(payload, max_decoded_bytes=limit)
    return str(e.value), time.perf_counter() - t0


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """Valid op spans plus an extra column: 8 batches of 16 MB of zero bytes each, 128 MB in all, a few KB zstd."""
    ops = op_spans(rows=1)
    zeros = pa.array(np.zeros(16 << 20, np.uint8))
    pad = pa.table({"pad": pa.FixedSizeBinaryArray.from_buffers(pa.binary(16 << 20), 1, [None, zeros.buffers()[1]])})
    t = codec.wire_schema(ops.schema)
    batch = pa.Table.from_arrays(ops.cast(t).columns + pad.columns, schema=t.append(pad.schema.field("pad")))
    return stream([batch] * 8)


def test_a_compressed_bomb_is_refused_before_it_is_decompressed(bomb):
    assert len(bomb) < 64_000
    assert codec.decoded_bytes(bomb) >= 128 << 20
    reason, took = refused_in(bomb)
    assert reason == "would decompress to 128 MB, over validation.max_decoded_mb (64 MB)"
    assert took < 1.0  # milliseconds in practice; decompressing it takes a tenth of a second and 128 MB


def test_the_same_bomb_under_a_higher_limit_decodes():
    payload = stream([with_kind(op_spans().cast(codec.wire_schema(op_spans().schema)))])
    kind, t = codec.decode(payload, max_decoded_bytes=1 << 30)
    assert kind == "op_span" and t.num_rows == op_spans().num_rows


@pytest.mark.parametrize("compression", ["zstd", "lz4", None])
def test_normal_batches_decode_and_their_bound_is_their_size(compression):
    t = op_spans()
    payload = codec.encode(t, compression=compression)
    kind, back = codec.decode(payload, max_decoded_bytes=LIMIT)
    assert kind == "op_span" and back.equals(codec.decode(payload)[1])
    # The bound is what the buffers take: the table's size, give or take the padding of each buffer.
    assert back.nbytes <= codec.decoded_bytes(payload) <= back.nbytes * 1.2 + 4096


def test_a_limit_smaller_than_a_normal_batch_refuses_it():
    payload = codec.encode(op_spans())
    reason, _ = refused_in(payload, limit=4096)
    assert reason.startswith("would decompress to ") and "(0.00390625 MB)" in reason


def test_dictionary_batches_count():
    """The dictionary of an encoded column travels in its own message, compressed like the batch."""
    words = pa.array([("w%d" % i) * 1000 for i in range(2000)]).dictionary_encode()  # 8 MB of dictionary values
    payload = stream([pa.table({"op": words})])
    assert codec.decoded_bytes(payload) >= 7 << 20 and len(payload) < 1 << 20
    assert "would decompress to" in refused_in(payload, limit=1 << 20)[0]


def test_a_dictionary_that_its_cast_expands_is_refused():
    """One 1 MB job id behind 500 indices: 2 KB of indices, 500 MB once conform casts the column to strings."""
    ops = op_spans(rows=1).cast(codec.wire_schema(op_spans().schema))
    t = pa.concat_tables([ops] * 500).combine_chunks()
    i = t.column_names.index("job_id")
    job = pa.DictionaryArray.from_arrays(pa.array(np.zeros(500, np.int32)), pa.array(["j" * (1 << 20)]))
    t = with_kind(t.set_column(i, pa.field("job_id", job.type), job))
    payload = stream([t])
    assert codec.decoded_bytes(payload) < 4 << 20
    reason, took = refused_in(payload)
    assert reason == "would take 501 MB once its columns are cast, over validation.max_decoded_mb (64 MB)"
    assert took < 1.0


def test_views_sharing_their_bytes_are_counted_per_view():
    n, size = 200, 1 << 20
    views = np.zeros((n, 4), dtype="<i4")
    views[:, 0] = size  # each view: its length, a 4-byte prefix, the data buffer's index and an offset in it
    views[:, 1] = int.from_bytes(b"jjjj", "little")
    job = pa.Array.from_buffers(pa.string_view(), n, [None, pa.py_buffer(views.tobytes()), pa.py_buffer(b"j" * size)])
    ops = pa.concat_tables([op_spans(rows=1).cast(codec.wire_schema(op_spans().schema))] * n).combine_chunks()
    i = ops.column_names.index("job_id")
    payload = stream([with_kind(ops.set_column(i, pa.field("job_id", job.type), job))])
    assert "would take 201 MB once its columns are cast" in refused_in(payload)[0]  # 1 MB on the wire, 200 cast


def test_a_billion_rows_of_type_null_are_refused():
    """Columns of type null have no buffers: 2^30 rows cost nothing on the wire and ~100 GB once cast."""
    n = 1 << 30
    t = with_kind(pa.table({f.name: pa.nulls(n) for f in S.OP_SPAN}))
    payload = stream([t])
    assert len(payload) < 10_000 and codec.decoded_bytes(payload) == 0
    reason, took = refused_in(payload)
    assert reason.startswith("would take ") and "once its columns are cast" in reason and took < 1.0


def test_a_lying_length_prefix_is_a_decode_error():
    payload = bytearray(codec.encode(op_spans()))
    ops = pa.ipc.MessageReader.open_stream(pa.py_buffer(bytes(payload)))
    next(ops)  # the schema
    batch = next(ops)
    at = bytes(payload).index(bytes(batch.body)[:64])  # where the body starts: its first buffer's length prefix
    payload[at:at + 8] = (-7).to_bytes(8, "little", signed=True)
    reason, _ = refused_in(bytes(payload))
    assert reason.startswith("not an Arrow IPC stream: a compressed buffer declares -7 bytes")
    payload[at:at + 8] = (1 << 40).to_bytes(8, "little", signed=True)
    assert refused_in(bytes(payload))[0].startswith("would decompress to 1,048,576 MB")
    # Two buffers of 2^62 bytes each: summed in int64, they would wrap around to a negative size and pass.
    fb = codec._Flatbuffer(batch.metadata)
    buffers = [(o, n) for o, n in fb.structs(fb.ref(fb.root(), 2), 2, 2) if n]
    for offset, _ in buffers[:2]:
        payload[at + offset:at + offset + 8] = (1 << 62).to_bytes(8, "little", signed=True)
    assert refused_in(bytes(payload))[0].startswith("would decompress to 8,796,093,022,208 MB")


def test_malformed_metadata_is_a_decode_error_and_never_anything_else():
    """Random bytes changed in a real payload, metadata and body alike: decode raises DecodeError or decodes."""
    good = codec.encode(op_spans(rows=40))
    rng = random.Random(7)
    outcomes = set()
    for _ in range(1500):
        payload = bytearray(good)
        for _ in range(rng.choice([1, 2, 8])):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        if rng.random() < 0.1:
            payload = payload[:rng.randrange(len(payload))]
        try:
            codec.decode(bytes(payload), max_decoded_bytes=LIMIT)
            outcomes.add("decoded")
        except codec.DecodeError as e:
            outcomes.add(str(e).split(":")[0])
    assert "not an Arrow IPC stream" in outcomes
