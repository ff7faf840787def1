"""The published golden-trace format: a parquet trace (seconds) and its meta YAML, read as op spans.

``load_golden(trace_parquet, meta_yaml)`` returns an ``OP_SPAN`` table (int64
ns) and the ``JobLayout`` of the meta; ``read_meta`` reads the meta alone.
Files that cannot be read in this format raise ``GoldenTraceError`` (a
ValueError) with a one-line reason. Only the format lives here: what the
what-if analyzer makes of the spans is ``analyzers.whatif``'s, and
``ingest.importers`` imports the same spans as records.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import numpy as np
import pyarrow as pa

from core import parallel
from core.arrow_numpy import array, is_null, strings, values
from core.layout import JobLayout
from core.memory import release_memory
from core.schema import OP_SPAN

GOLDEN_REQUIRED = ("dp_rank", "stage", "step", "optype", "start_ts", "duration")
"""Columns a golden trace must have; the others (rank, seq_id, mc, gmc, mb_id) have defaults."""


class GoldenTraceError(ValueError):
    """A trace or meta file that cannot be read as a golden trace; the message is one line for the user."""


def read_meta(meta_yaml: str | os.PathLike) -> tuple[JobLayout, dict[str, Any]]:
    """Layout and raw fields of a golden meta YAML."""
    import yaml

    try:
        with open(meta_yaml) as f:
            meta = yaml.safe_load(f)
    except FileNotFoundError:
        raise GoldenTraceError(f"meta file not found: {meta_yaml}") from None
    except (OSError, yaml.YAMLError) as e:
        raise GoldenTraceError(f"cannot read meta {meta_yaml}: {type(e).__name__}: {e}".splitlines()[0]) from None
    if not isinstance(meta, dict):
        raise GoldenTraceError(f"meta {meta_yaml} is not a mapping")
    try:
        return JobLayout.from_meta(meta), meta
    except (ValueError, TypeError) as e:
        raise GoldenTraceError(f"bad meta {meta_yaml}: {e}") from None


LEAN_COLUMNS = ("dp_rank", "stage", "step", "optype", "start_ts", "duration", "seq_id", "mc", "gmc", "mb_id")
"""What the what-if analyzer reads of a golden trace."""


def load_golden(trace_parquet: str | os.PathLike, meta_yaml: str | os.PathLike, *,
                lean: bool = False) -> tuple[pa.Table, JobLayout]:
    """Golden trace (artifact format, seconds) -> (OP_SPAN table, layout).

    ``job_id`` is the meta's ``trial_name``, ``window_id`` the first step,
    ``attempt`` its ``run_id``. Seconds become int64 ns rounded to the
    nearest ns (float32 seconds carry less than that).

    ``lean=True`` is for analysis only: the columns the what-if analyzer reads
    (the OP_SPAN names), the op type kept dictionary-encoded and ``job_id`` a
    one-value dictionary. At 16,384 GPUs that is less than half the memory and
    time of the OP_SPAN table. Files with integer ids are read a row group at a
    time straight into the columns the analyzer works in (``_read_lean``);
    others as a whole file, in the file's own types.
    """
    layout, meta = read_meta(meta_yaml)
    import pyarrow.parquet as pq

    if lean:
        table = _read_lean(trace_parquet, meta)
        if table is not None:
            return table, layout
    with _reading(trace_parquet):
        if lean:
            names = set(pq.read_schema(trace_parquet).names)
            t = pq.read_table(trace_parquet, columns=[c for c in LEAN_COLUMNS if c in names])
        else:
            t = pq.read_table(trace_parquet)
    missing = [c for c in GOLDEN_REQUIRED if c not in t.column_names]
    if missing:
        raise GoldenTraceError(f"trace {trace_parquet} lacks columns {missing}")
    n = t.num_rows

    def col(name: str, dtype, default: int) -> np.ndarray:
        if name not in t.column_names:
            return np.full(n, default, dtype)
        return np.asarray(values(t.column(name), default), dtype=dtype)

    def ns(name: str) -> pa.Array:
        # NaN and nulls stay null here; the analyzer rejects and reports those rows.
        out, bad = np.empty(n, np.int64), np.zeros(n, bool)
        _to_ns(t.column(name), out, bad)
        return pa.array(out, pa.int64(), mask=bad if bad.any() else None)

    if lean:
        def native(name: str, default: int | None = None) -> pa.Array:
            c = t.column(name)
            return (c.fill_null(default) if default is not None else c).combine_chunks()

        job = str(meta.get("trial_name", ""))
        cols = {
            "job_id": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), pa.array([job])),
            "dp_rank": native("dp_rank", 0), "pp_rank": native("stage", 0), "step": native("step", 0),
            "optype": t.column("optype").unify_dictionaries().combine_chunks()
            if pa.types.is_dictionary(t.schema.field("optype").type) else native("optype"),
            "start_ns": ns("start_ts"), "duration_ns": ns("duration"),
        }
        for name in ("seq_id", "mc", "gmc", "mb_id"):
            if name in t.column_names:
                cols[name] = native(name)
        t = None
        release_memory()
        return pa.table(cols), layout

    steps = col("step", np.int64, 0)
    window = int(steps.min()) if n else 0
    optype = t.column("optype").cast(pa.string()).combine_chunks()
    cols = {
        "job_id": pa.repeat(pa.scalar(str(meta.get("trial_name", "")), pa.string()), n),
        "attempt": pa.repeat(pa.scalar(int(meta.get("run_id", 0) or 0), pa.int32()), n),
        "rank": pa.array(col("rank", np.int32, -1)),
        "dp_rank": pa.array(col("dp_rank", np.int32, 0)),
        "pp_rank": pa.array(col("stage", np.int32, 0)),
        "window_id": pa.repeat(pa.scalar(window, pa.int64()), n),
        "step": pa.array(steps),
        "optype": optype,
        "start_ns": ns("start_ts"),
        "duration_ns": ns("duration"),
        "seq_id": pa.array(col("seq_id", np.int32, 0)),
        "mc": pa.array(col("mc", np.int16, 0)),
        "gmc": pa.array(col("gmc", np.int16, -1)),
        "mb_id": pa.array(col("mb_id", np.int32, -1)),
    }
    schema = pa.schema([f.with_nullable(f.name in ("start_ns", "duration_ns")) for f in OP_SPAN],
                       metadata=OP_SPAN.metadata)
    table = pa.table(cols, schema=schema)
    del cols
    t = optype = steps = None  # (not del: col() and ns() close over t)
    # The parquet columns are garbage now: hand their pages back (about 40% of the table at 4,096 GPUs).
    release_memory()
    return table, layout


@contextlib.contextmanager
def _reading(trace_parquet: str | os.PathLike):
    """A trace file's read errors as ``GoldenTraceError`` with a one-line reason."""
    try:
        yield
    except FileNotFoundError:
        raise GoldenTraceError(f"trace file not found: {trace_parquet}") from None
    except (OSError, pa.ArrowException) as e:
        raise GoldenTraceError(f"cannot read trace {trace_parquet}: {e}".splitlines()[0]) from None


# The lean columns' types: those ``analyzers.whatif.load.prepare_ops`` works in, so that it copies none of them
# (a step past int32 falls back to the whole-file read).
_LEAN_INT = {"dp_rank": ("dp_rank", np.int32, 0), "stage": ("pp_rank", np.int32, 0), "step": ("step", np.int32, 0),
             "seq_id": ("seq_id", np.int32, 0), "mc": ("mc", np.int16, 0), "gmc": ("gmc", np.int16, -1),
             "mb_id": ("mb_id", np.int32, -1)}
"""golden column -> (OP_SPAN name, type, value of a null); a null optional id gets its default there too."""


def _read_lean(trace_parquet: str | os.PathLike, meta: dict) -> pa.Table | None:
    """The lean table read a row group at a time into its final columns, or None where that cannot be done.

    Why: reading the whole file first holds the decoded file, its combined chunks and the converted
    columns at once (about three times the table). Here each row group is decoded, converted into the
    final arrays and dropped, so the only new memory is the table itself. On these VMs the first touch
    of a page is the expensive part (0.3 to 2 s per GB), so that is also most of the time saved.

    None (the caller reads the whole file instead) for ids that are not integers, a value that does not
    fit its column, or an op type that is neither strings nor a dictionary of strings: the whole-file
    path reports what is wrong with them.
    """
    import pyarrow.parquet as pq

    with _reading(trace_parquet):
        pf = pq.ParquetFile(trace_parquet)
    schema = pf.schema_arrow
    names = set(schema.names)
    if any(c not in names for c in GOLDEN_REQUIRED):
        return None  # the whole-file path names the missing columns
    ints = [c for c in _LEAN_INT if c in names]
    if not all(pa.types.is_integer(schema.field(c).type) for c in ints):
        return None
    if not all(pa.types.is_floating(schema.field(c).type) or pa.types.is_integer(schema.field(c).type)
               for c in ("start_ts", "duration")):
        return None
    ot = schema.field("optype").type
    if pa.types.is_dictionary(ot):
        ot = ot.value_type
    if not (pa.types.is_string(ot) or pa.types.is_large_string(ot)):
        return None
    n = pf.metadata.num_rows
    cols = {c: np.empty(n, _LEAN_INT[c][1]) for c in ints}
    times = {c: np.empty(n, np.int64) for c in ("start_ts", "duration")}
    bad_time = {c: np.zeros(n, bool) for c in times}
    type_idx = np.empty(n, np.int16)
    type_null = np.zeros(n, bool)
    type_names: dict[str, int] = {}  # the file's op type names, numbered as first seen (threads share it)
    naming = threading.Lock()
    starts = np.cumsum([0] + [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)])
    wanted = [c for c in LEAN_COLUMNS if c in names]

    def read(groups: list[int]) -> list[bool]:
        """Row groups into their rows of the final columns; False where a value does not fit."""
        f = pq.ParquetFile(trace_parquet)  # a reader per thread
        fits = []
        for rg in groups:
            t = f.read_row_group(rg, columns=wanted)
            a, b = int(starts[rg]), int(starts[rg + 1])
            for c in ints:
                _, dtype, null = _LEAN_INT[c]
                x = values(t.column(c), null)
                if not np.can_cast(x.dtype, dtype) and len(x) and (
                        int(x.min()) < np.iinfo(dtype).min or int(x.max()) > np.iinfo(dtype).max):
                    return [False]
                cols[c][a:b] = x
            for c in times:
                _to_ns(t.column(c), times[c][a:b], bad_time[c][a:b])
            ty = t.column("optype")
            if not pa.types.is_dictionary(ty.type):
                ty = ty.dictionary_encode()
            for chunk in ty.chunks:
                # The file's dictionaries may differ by row group: map each onto one list of names.
                with naming:
                    lut = np.array([type_names.setdefault(s, len(type_names))
                                    for s in chunk.dictionary.to_pylist()] + [0], np.int16)  # [-1]: a null's
                idx = values(chunk.indices, len(lut) - 1)
                type_idx[a:a + len(idx)] = lut[idx]
                if chunk.null_count:
                    type_null[a:a + len(idx)] = is_null(chunk)
                a += len(idx)
            fits.append(True)
        return fits

    with _reading(trace_parquet):
        # Threads, a run of row groups each: most of the time is first touches of the columns' new pages.
        if not all(parallel.map_slices(list(range(pf.num_row_groups)), read, parallel.threads(n))):
            return None
    if len(type_names) > np.iinfo(np.int16).max:
        return None
    release_memory()  # the row groups' buffers
    dictionary = strings(list(type_names))

    out = {
        "job_id": pa.DictionaryArray.from_arrays(array(np.zeros(n, np.int8)),
                                                 strings([str(meta.get("trial_name", ""))])),
        "dp_rank": array(cols.pop("dp_rank")), "pp_rank": array(cols.pop("stage")),
        "step": array(cols.pop("step")),
        "optype": pa.DictionaryArray.from_arrays(array(type_idx, type_null), dictionary),
        "start_ns": array(times["start_ts"], bad_time["start_ts"]),
        "duration_ns": array(times["duration"], bad_time["duration"]),
    }
    for c, x in cols.items():
        out[_LEAN_INT[c][0]] = array(x)
    return pa.table(out)


def _to_ns(col: pa.ChunkedArray, out: np.ndarray, bad: np.ndarray) -> None:
    """Seconds (float or int) into int64 ns in ``out``, rounded to the nearest ns; null or NaN rows in ``bad``.

    A chunk at a time: the float64 temporaries stay in the cache instead of costing [n] arrays.
    """
    a = 0
    for chunk in col.chunks:
        b = a + len(chunk)
        if chunk.null_count:
            bad[a:b] = is_null(chunk)
        x = values(chunk, 0).astype(np.float64)
        nonfinite = ~np.isfinite(x)
        if nonfinite.any():
            x[nonfinite] = 0.0
            bad[a:b] |= nonfinite
        x *= 1e9
        np.rint(x, out=x)
        np.copyto(out[a:b], x, casting="unsafe")
        a = b
