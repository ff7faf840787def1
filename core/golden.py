"""The published golden-trace format: a parquet trace (seconds) and its meta YAML, read as op spans.

``load_golden(trace_parquet, meta_yaml)`` returns an ``OP_SPAN`` table (int64
ns) and the ``JobLayout`` of the meta; ``read_meta`` reads the meta alone.
Files that cannot be read in this format raise ``GoldenTraceError`` (a
ValueError) with a one-line reason. Only the format lives here: what the
what-if analyzer makes of the spans is ``analyzers.whatif``'s, and
``ingest.importers`` imports the same spans as records.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa

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
    (the OP_SPAN names) in the file's own narrow types, the op type kept
    dictionary-encoded and ``job_id`` a one-value dictionary. At 16,384 GPUs
    that is less than half the memory and time of the OP_SPAN table.
    """
    layout, meta = read_meta(meta_yaml)
    import pyarrow.parquet as pq

    try:
        if lean:
            names = set(pq.read_schema(trace_parquet).names)
            t = pq.read_table(trace_parquet, columns=[c for c in LEAN_COLUMNS if c in names])
        else:
            t = pq.read_table(trace_parquet)
    except FileNotFoundError:
        raise GoldenTraceError(f"trace file not found: {trace_parquet}") from None
    except (OSError, pa.ArrowException) as e:
        raise GoldenTraceError(f"cannot read trace {trace_parquet}: {e}".splitlines()[0]) from None
    missing = [c for c in GOLDEN_REQUIRED if c not in t.column_names]
    if missing:
        raise GoldenTraceError(f"trace {trace_parquet} lacks columns {missing}")
    n = t.num_rows

    def col(name: str, dtype, default: int) -> np.ndarray:
        if name not in t.column_names:
            return np.full(n, default, dtype)
        return np.asarray(t.column(name).fill_null(default).to_numpy(), dtype=dtype)

    def ns(name: str) -> pa.Array:
        # A chunk at a time: the float64 temporaries stay in the cache instead of costing [n] arrays.
        # NaN and nulls stay null here; the analyzer rejects and reports those rows.
        out = np.empty(n, np.int64)
        bad = np.zeros(n, bool)
        a = 0
        for chunk in t.column(name).chunks:
            x = chunk.to_numpy(zero_copy_only=False).astype(np.float64)
            b = a + len(x)
            nonfinite = ~np.isfinite(x)
            if nonfinite.any():
                x[nonfinite] = 0.0
                bad[a:b] = nonfinite
            x *= 1e9
            np.rint(x, out=x)
            np.copyto(out[a:b], x, casting="unsafe")
            a = b
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
