"""Records on the wire and at the boundary: Arrow IPC encoding, decoding, conforming and validation.

One Arrow IPC stream per Kafka message. ``decode`` is the boundary every
consumer passes records through: it raises ``DecodeError`` and nothing else.
"""
from __future__ import annotations

import io
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from core.schema import (
    ALL_SCHEMAS,
    CCL_RECORD,
    CHECKPOINT,
    CHECKPOINT_KINDS,
    HEARTBEAT,
    INPUT_SCHEMAS,
    JOB,
    MIN_READ_VERSION,
    OP_SPAN,
    RESULT_SCHEMAS,
    SCHEMA_VERSION,
    default_of,
    kind_of,
)


class DecodeError(ValueError):
    """A payload that is not a valid record batch of a known schema."""


KIND_ALIASES = {"job_registration": "job", "window_result": "window", "step_result": "step_slowdown"}
"""Old kind names ``decode`` still reads, and the kind each is now: producers of SCHEMA_VERSION 1 and 2
(exporters not yet upgraded, spooled and dead-lettered messages) stamp these; since version 3 every kind is
named as the singular of its table."""


def wire_schema(schema: pa.Schema) -> pa.Schema:
    """The schema as sent: field docs and units dropped, kind and version kept.

    Every Kafka message carries its schema; the docs would cost a few KB each.
    """
    md = schema.metadata or {}
    keep = {k: v for k, v in md.items() if k.startswith(b"stragglerscope.")}
    return pa.schema([f.remove_metadata() for f in schema], metadata=keep)


_WIRE = {id(s): wire_schema(s) for s in (OP_SPAN, CCL_RECORD, HEARTBEAT, JOB, CHECKPOINT)}


def encode(batch: pa.RecordBatch | pa.Table, compression: str | None = "zstd") -> bytes:
    """Encode one batch (or table) as an Arrow IPC stream, body-compressed.

    Fields added after version 1 that a producer left null get their defaults.
    """
    table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    schema = _WIRE.get(id(table.schema)) or wire_schema(table.schema)
    batch = fill_defaults(table, table.schema).cast(schema)
    sink = io.BytesIO()
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, schema, options=opts) as w:
        w.write_table(batch)
    return sink.getvalue()


def decode(payload: bytes) -> tuple[str, pa.Table]:
    """Decode and validate an IPC payload; returns (kind, table).

    Raises DecodeError, and nothing else, with a reason fit for a dead-letter
    record: the bytes are not Arrow, a buffer is inconsistent, the kind or
    version is unknown, or a column is missing, mistyped or null where it
    must not be.
    """
    try:
        with pa.ipc.open_stream(pa.py_buffer(payload)) as r:
            table = r.read_all()
    except Exception as e:  # pyarrow raises several types for garbage
        raise DecodeError(f"not an Arrow IPC stream: {type(e).__name__}: {e}"[:500]) from None
    try:
        # The IPC reader checks buffer sizes but not their contents: string offsets that
        # point past the data pass it and crash the process later, in hashing or a
        # filter. Full validation (offsets, UTF-8, dictionary indices) costs one pass.
        table.validate(full=True)
    except Exception as e:
        raise DecodeError(f"invalid Arrow buffers: {type(e).__name__}: {e}"[:500]) from None
    md = table.schema.metadata or {}
    try:
        kind = md.get(b"stragglerscope.kind", b"").decode("ascii")
        version = md.get(b"stragglerscope.version", b"").decode("ascii")
    except UnicodeDecodeError:
        raise DecodeError("record kind or version is not ASCII") from None
    kind = KIND_ALIASES.get(kind, kind)
    if kind not in INPUT_SCHEMAS and kind not in RESULT_SCHEMAS:
        raise DecodeError(f"unknown record kind {kind[:80]!r}")
    # Only ASCII digits: str.isdigit() accepts '\u00b2', which int() then refuses.
    if not (version.isascii() and version.isdigit() and len(version) <= 6
            and MIN_READ_VERSION <= int(version) <= SCHEMA_VERSION):
        raise DecodeError(f"unsupported schema version {version[:20]!r} for {kind} "
                          f"(we read {MIN_READ_VERSION} to {SCHEMA_VERSION})")
    try:
        return kind, conform(table, ALL_SCHEMAS[kind])
    except DecodeError:
        raise
    except Exception as e:  # a cast or a default that Arrow refuses: still this message's fault
        raise DecodeError(f"{kind}: {type(e).__name__}: {e}"[:500]) from None


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Check ``table`` against ``schema``: same columns, castable types, no nulls.

    Extra columns are dropped, safe casts applied (int32 -> int64 and the like);
    a field added after version 1 that the table lacks, or holds nulls in, gets
    its default (older producers); anything else raises DecodeError naming the
    column.
    """
    cols = []
    for field in schema:
        has_default, default = default_of(field)
        if field.name not in table.column_names:
            if not has_default:
                raise DecodeError(f"{kind_of(schema)}: missing column {field.name!r}")
            filled = pa.nulls(table.num_rows, field.type).fill_null(pa.scalar(default, field.type))
            cols.append(pa.chunked_array([filled], field.type))
            continue
        col = table.column(field.name)
        if not col.type.equals(field.type):
            try:
                col = col.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise DecodeError(
                    f"{kind_of(schema)}: column {field.name!r} is {col.type}, want {field.type}: {e}"[:500]
                ) from None
        if has_default and col.null_count:
            col = col.fill_null(pa.scalar(default, field.type))
        if not field.nullable and col.null_count:
            raise DecodeError(f"{kind_of(schema)}: column {field.name!r} has {col.null_count} nulls")
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=schema)


def validate_op_spans(table: pa.Table) -> tuple[pa.Table, pa.Table | None, str]:
    """Split op spans into good rows and bad rows (with the reason).

    Bad rows: negative duration, negative ranks or step. Unknown op types are
    kept (the analyzer reports them). Returns (good, bad, reason); ``bad`` is
    None when every row is good.
    """
    bad_mask = pc.or_(
        pc.less(table["duration_ns"], 0),
        pc.or_(pc.less(table["dp_rank"], 0), pc.or_(pc.less(table["pp_rank"], 0), pc.less(table["step"], 0))),
    )
    return _split_bad(table, bad_mask, "op spans with negative duration, rank or step")


def _split_bad(table: pa.Table, bad_mask: pa.ChunkedArray, what: str) -> tuple[pa.Table, pa.Table | None, str]:
    """(good rows, bad rows or None, "<count> <what>") of a validator's mask."""
    n_bad = pc.sum(pc.cast(bad_mask, pa.int64())).as_py() or 0
    if not n_bad:
        return table, None, ""
    return table.filter(pc.invert(bad_mask)), table.filter(bad_mask), f"{n_bad} {what}"


def validate_checkpoints(table: pa.Table) -> tuple[pa.Table, pa.Table | None, str]:
    """Split CHECKPOINT rows into good and bad rows (with the reason), like ``validate_op_spans``.

    Bad rows: a kind other than save or load, a negative step, duration or rank.
    """
    bad_mask = pc.or_(
        pc.invert(pc.is_in(table["kind"], pa.array(CHECKPOINT_KINDS))),
        pc.or_(pc.less(table["step"], 0), pc.or_(pc.less(table["duration_ns"], 0), pc.less(table["rank"], 0))),
    )
    return _split_bad(table, bad_mask, "checkpoint records with an unknown kind or a negative step, duration or rank")


def empty(schema: pa.Schema) -> pa.Table:
    return schema.empty_table()


def from_rows(schema: pa.Schema, rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Build a table of ``schema`` from dict rows (test factories, small results).

    A row may leave out fields added after version 1: they get their defaults.
    """
    rows = list(rows)
    if not rows:
        return schema.empty_table()
    return fill_defaults(pa.Table.from_pylist(rows, schema=schema), schema)


def fill_defaults(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Nulls in the fields of ``schema`` that have a default (added after version 1) become that default.

    ``pa.Table.from_pylist(rows, schema=...)`` leaves nulls where a row lacks a
    key, also in non-nullable fields: producers written before a field existed.
    """
    for field in schema:
        has_default, default = default_of(field)
        if not has_default or field.name not in table.column_names:
            continue
        i = table.column_names.index(field.name)
        if table.column(i).null_count:
            table = table.set_column(i, table.field(i), table.column(i).fill_null(pa.scalar(default, field.type)))
    return table
