"""Records on the wire and at the boundary: Arrow IPC encoding, decoding, conforming and validation.

One Arrow IPC stream per Kafka message. ``decode`` is the boundary every
consumer passes records through: it raises ``DecodeError`` and nothing else.
"""
from __future__ import annotations

import io
import struct
from typing import Any, Iterable, Mapping

import numpy as np
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


def decode(payload: bytes, max_decoded_bytes: int | None = None) -> tuple[str, pa.Table]:
    """Decode and validate an IPC payload; returns (kind, table).

    Raises DecodeError, and nothing else, with a reason fit for a dead-letter
    record: the bytes are not Arrow, a buffer is inconsistent, the kind or
    version is unknown, or a column is missing, mistyped or null where it
    must not be. With ``max_decoded_bytes``, also when the records would take
    more than that many bytes once decompressed and cast: that is known from
    the payload's metadata, before any of it is decompressed or cast (see
    ``decoded_bytes`` and ``conform_bytes``).
    """
    decoded = 0
    if max_decoded_bytes is not None:
        decoded = decoded_bytes(payload)
        if decoded > max_decoded_bytes:
            raise _too_large("decompress to", decoded, max_decoded_bytes)
    try:
        with pa.ipc.open_stream(pa.py_buffer(payload)) as r:
            table = r.read_all()
    except Exception as e:  # pyarrow raises several types for garbage
        raise DecodeError(f"not an Arrow IPC stream: {type(e).__name__}: {e}"[:500]) from None
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
    if max_decoded_bytes is not None:
        # Before validation too: validating a view column reads each view's bytes, shared or not.
        try:
            total = decoded + conform_bytes(table, ALL_SCHEMAS[kind])
        except Exception as e:  # buffers too short for what the arrays claim: garbage
            raise DecodeError(f"invalid Arrow buffers: {type(e).__name__}: {e}"[:500]) from None
        if total > max_decoded_bytes:
            raise _too_large("take", total, max_decoded_bytes, " once its columns are cast")
    try:
        # The IPC reader checks buffer sizes but not their contents: string offsets that
        # point past the data pass it and crash the process later, in hashing or a
        # filter. Full validation (offsets, UTF-8, dictionary indices) costs one pass.
        table.validate(full=True)
    except Exception as e:
        raise DecodeError(f"invalid Arrow buffers: {type(e).__name__}: {e}"[:500]) from None
    try:
        return kind, conform(table, ALL_SCHEMAS[kind])
    except DecodeError:
        raise
    except Exception as e:  # a cast or a default that Arrow refuses: still this message's fault
        raise DecodeError(f"{kind}: {type(e).__name__}: {e}"[:500]) from None


# -- the decoded size, bounded before decoding ------------------------------------------------------------------
# A message is a few KB on the wire but says how large its buffers are once decompressed: a zstd stream of one
# repeated byte grows 30,000-fold, and pyarrow allocates and fills what the message declares before anything
# can look at it (a 14 KB message held a shard's loop for 3.4 s). So ``decode`` adds up what a payload declares,
# from its IPC metadata alone, and refuses it over the limit; then, before ``conform`` casts or fills a column,
# what that will allocate (a dictionary or view column expands on its cast, and a column of type null or a
# missing column costs its row count times its width, with no buffer behind it on the wire).

_MB = 2**20
_LIMIT_NAME = "validation.max_decoded_mb"


class _Malformed(ValueError):
    """IPC metadata that does not parse: the payload is not an Arrow IPC stream we read."""


class _Flatbuffer:
    """Just enough of the flatbuffers wire format to read an IPC message's header, bounds-checked throughout.

    A table starts with a signed offset back to its vtable; the vtable lists, per field, the field's offset
    inside the table (0: absent, the default applies). Tables and vectors are reached through unsigned
    offsets relative to where the offset is stored; a vector starts with its length.
    """

    def __init__(self, data: pa.Buffer):
        self.data = memoryview(data)

    def _read(self, fmt: str, pos: int) -> int:
        if pos < 0 or pos + struct.calcsize(fmt) > len(self.data):
            raise _Malformed(f"a flatbuffer offset ({pos}) points outside the message metadata")
        return struct.unpack_from(fmt, self.data, pos)[0]

    def root(self) -> int:
        return self._read("<I", 0)

    def field(self, table: int, index: int) -> int | None:
        """Where field ``index`` of the table at ``table`` is stored, or None when it is absent."""
        vtable = table - self._read("<i", table)
        size = self._read("<H", vtable)
        if 4 + 2 * index + 2 > size:
            return None
        at = self._read("<H", vtable + 4 + 2 * index)
        return table + at if at else None

    def scalar(self, table: int, index: int, fmt: str, default: int) -> int:
        at = self.field(table, index)
        return default if at is None else self._read(fmt, at)

    def ref(self, table: int, index: int) -> int | None:
        """The position of the table or vector field ``index`` refers to, or None when it is absent."""
        at = self.field(table, index)
        return None if at is None else at + self._read("<I", at)

    def structs(self, table: int, index: int, n_longs: int) -> list[tuple[int, ...]]:
        """A vector of structs of ``n_longs`` int64 each (FieldNode, Buffer), or [] when absent.

        Python ints, not numpy's: a sum of lengths an attacker chose must not wrap around to a small number.
        """
        at = self.ref(table, index)
        if at is None:
            return []
        n = self._read("<I", at)
        if at + 4 + n * 8 * n_longs > len(self.data):
            raise _Malformed(f"a vector of {n} structs runs past the message metadata")
        flat = struct.unpack_from(f"<{n * n_longs}q", self.data, at + 4)
        return list(zip(*[iter(flat)] * n_longs))


_RECORD_BATCH, _DICTIONARY_BATCH = 3, 2  # MessageHeader union tags (Arrow's Message.fbs)


def _batch_bytes(metadata: pa.Buffer, body: pa.Buffer | None) -> int:
    """The bytes the buffers of one record or dictionary batch message take once decompressed, read from its
    metadata and the length prefixes of its compressed buffers: nothing is decompressed.

    Message.fbs: Message {version: short, header_type: ubyte, header: table, bodyLength: long, ...};
    RecordBatch {length: long, nodes: [FieldNode], buffers: [Buffer], compression: BodyCompression, ...};
    DictionaryBatch {id: long, data: RecordBatch, isDelta: bool}. Each buffer is (offset, length) in the body;
    with body compression each non-empty one starts with its decompressed length, an int64 (-1: stored as is).
    """
    fb = _Flatbuffer(metadata)
    message = fb.root()
    kind = fb.scalar(message, 1, "<B", 0)
    header = fb.ref(message, 2)
    if header is None:
        raise _Malformed("a batch message without a header")
    if kind == _DICTIONARY_BATCH:
        header = fb.ref(header, 1)
        if header is None:
            raise _Malformed("a dictionary batch without its data")
    elif kind != _RECORD_BATCH:
        raise _Malformed(f"a batch message with header type {kind}")
    compressed = fb.ref(header, 3) is not None
    size = body.size if body is not None else 0
    total = 0
    for offset, length in fb.structs(header, 2, 2):
        if offset < 0 or length < 0 or offset + length > size:
            raise _Malformed(f"a buffer ({offset}, {length}) outside the message body ({size} bytes)")
        if not compressed or length == 0:
            total += length
            continue
        if length < 8:
            raise _Malformed(f"a compressed buffer of {length} bytes, shorter than its length prefix")
        declared = _INT64.unpack_from(body, offset)[0]
        if declared < -1:
            raise _Malformed(f"a compressed buffer declares {declared} bytes")
        total += length - 8 if declared == -1 else declared
    return total


_INT64 = struct.Struct("<q")


def decoded_bytes(payload: bytes) -> int:
    """What the record and dictionary batches of an IPC stream take once decompressed, from their metadata.

    Raises DecodeError when the metadata does not parse. Costs a few microseconds per batch, whatever its size.
    """
    total = 0
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(payload))
        for message in reader:
            if message.type in ("record batch", "dictionary"):
                total += _batch_bytes(message.metadata, message.body)
    except _Malformed as e:
        raise DecodeError(f"not an Arrow IPC stream: {e}"[:500]) from None
    except Exception as e:  # pyarrow raises several types for garbage
        raise DecodeError(f"not an Arrow IPC stream: {type(e).__name__}: {e}"[:500]) from None
    return total


def _ints(buf: pa.Buffer | None, dtype: str, start: int, n: int) -> np.ndarray:
    if buf is None or n <= 0:
        return np.zeros(0, np.int64)
    return np.frombuffer(buf, dtype=dtype)[start:start + n].astype(np.int64)


def _sizes(arr: pa.Array, per_value: int) -> np.ndarray | int:
    """The bytes each element of ``arr`` takes in a plain variable-width column (a string; a list of
    ``per_value`` bytes per item): an array read from the raw buffers for the types whose buffers hold the
    lengths, else one size for every element (never an array of ``len(arr)``: a column of type null has no
    buffers, however many rows it claims).

    This runs before validation, so lengths are clipped to 0..the largest data buffer: a bound that is exact
    on valid data and finite on garbage (which validation then refuses).
    """
    t, n, bufs = arr.type, len(arr), arr.buffers()
    largest = max((b.size for b in bufs[2:] if b is not None), default=0)
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        large = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
        lengths = np.diff(_ints(bufs[1], "<i8" if large else "<i4", arr.offset, n + 1))
    elif pa.types.is_string_view(t) or pa.types.is_binary_view(t):
        lengths = _ints(bufs[1], "<i4", 4 * arr.offset, 4 * n)[::4]  # 16-byte views, each starting with its length
        largest = max(largest, 12)  # up to 12 bytes sit inside the view
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = np.diff(_ints(bufs[1], "<i8" if pa.types.is_large_list(t) else "<i4", arr.offset, n + 1))
        largest = len(arr.values)
    elif pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        lengths = _ints(bufs[2], "<i8" if pa.types.is_large_list_view(t) else "<i4", arr.offset, n)
        largest = len(arr.values)
    elif pa.types.is_fixed_size_list(t):
        return t.list_size * per_value
    elif pa.types.is_null(t):
        return 0
    else:  # a number or a date cast to text: a 256-bit decimal takes 78 characters
        return 80
    return np.clip(lengths, 0, largest) * (per_value if pa.types.is_nested(t) else 1)


def _column_bytes(col: pa.ChunkedArray, target: pa.DataType) -> int:
    """An upper bound of what ``conform`` allocates for ``col``, cast to ``target`` or its nulls filled.

    A new column: n values of a fixed width, or n offsets and the values laid out one after the other, which
    a dictionary (its values repeated per index), a view (views may share their bytes) or a null column (no
    buffers at all) does not show.
    """
    n = len(col)
    validity = (n + 7) // 8
    if pa.types.is_primitive(target):
        return validity + n * max(1, target.bit_width // 8)
    per_value = max(1, target.value_type.bit_width // 8) if pa.types.is_list(target) else 1
    data = 0
    for chunk in col.chunks:
        if pa.types.is_dictionary(chunk.type):
            sizes = _sizes(chunk.dictionary, per_value)
            if isinstance(sizes, int):
                data += sizes * len(chunk)
            elif len(sizes):
                index = np.dtype(chunk.type.index_type.to_pandas_dtype()).newbyteorder("<")
                indices = _ints(chunk.buffers()[1], index.str, chunk.offset, len(chunk))
                data += int(np.take(sizes, indices, mode="clip").sum(dtype=np.float64))
        else:
            sizes = _sizes(chunk, per_value)
            data += sizes * len(chunk) if isinstance(sizes, int) else int(sizes.sum(dtype=np.float64))
    return validity + 8 * (n + 1) + data


def conform_bytes(table: pa.Table, schema: pa.Schema) -> int:
    """An upper bound of the bytes ``conform(table, schema)`` allocates (casts, defaults), without allocating."""
    total = 0
    n = table.num_rows
    have = dict(zip(table.schema.names, table.schema.types))
    for name, target, has_default, fill in _targets(schema):
        got = have.get(name)
        if got is None:
            total += (n + 7) // 8 + n * fill if has_default else 0  # filled with its default (n times)
        elif not got.equals(target) or (has_default and table.column(name).null_count):
            total += _column_bytes(table.column(name), target)
    return total


_TARGETS: dict[int, list[tuple[str, pa.DataType, bool, int]]] = {}


def _targets(schema: pa.Schema) -> list[tuple[str, pa.DataType, bool, int]]:
    """(name, type, has a default, bytes per value of the default) of each field; per schema, once."""
    cached = _TARGETS.get(id(schema))
    if cached is None or cached[0] is not schema:
        out = []
        for field in schema:
            has_default, default = default_of(field)
            fill = max(1, field.type.bit_width // 8) if pa.types.is_primitive(field.type) else \
                8 + len(default if isinstance(default, bytes) else str(default).encode())
            out.append((field.name, field.type, has_default, fill))
        cached = _TARGETS[id(schema)] = (schema, out)
    return cached[1]


def _too_large(what: str, n: int, limit: int, how: str = "") -> DecodeError:
    return DecodeError(f"would {what} {n / _MB:,.0f} MB{how}, over {_LIMIT_NAME} ({limit / _MB:g} MB)")


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
    index = {name: i for i, name in enumerate(table.column_names)}
    for name, default in _defaults_of(schema):
        i = index.get(name)
        if i is not None and table.column(i).null_count:
            table = table.set_column(i, table.field(i), table.column(i).fill_null(default))
    return table


_DEFAULTS: dict[int, tuple[pa.Schema, list[tuple[str, pa.Scalar]]]] = {}


def _defaults_of(schema: pa.Schema) -> list[tuple[str, pa.Scalar]]:
    """The fields of ``schema`` that have a default, with it as a scalar: parsed once per schema object (a
    heartbeat of 29 fields spent 2 ms parsing its defaults again at every encoding). Keyed by identity:
    schemas that differ only in their fields' metadata (where the defaults are) compare equal."""
    hit = _DEFAULTS.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    out = []
    for field in schema:
        has_default, default = default_of(field)
        if has_default:
            out.append((field.name, pa.scalar(default, field.type)))
    if len(_DEFAULTS) >= 256:  # decoded tables bring schema objects of their own: keep this bounded
        _DEFAULTS.clear()
    _DEFAULTS[id(schema)] = (schema, out)
    return out
