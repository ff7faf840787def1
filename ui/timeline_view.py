"""Actual vs simulated ideal timeline of one step, for the job page.

The store keeps the raw op spans of some windows (``pipeline.keep_op_spans_max_rows`` and
``keep_op_spans_every_s``);
this re-runs the what-if simulator on them (the analyzers stay pure; the
console only shapes their output into a frame for a Gantt chart) and keeps a
few workers of one step, so the chart stays readable and fast.
"""
from __future__ import annotations

import pandas as pd
import pyarrow as pa

from core import codec
from core import schema as S
from core.layout import JobLayout

MAX_OPS = 200_000


def timeline_frame(ops: pa.Table, layout: JobLayout, step: int | None = None,
                   workers: int = 8) -> tuple[pd.DataFrame, list[dict]]:
    """(frame, trace events): one row per op of ``step`` on the first ``workers`` workers, both scenarios.

    Frame columns: scenario ("actual"/"ideal"), worker ("dp0/pp1"), stream,
    optype, start_ms and end_ms relative to the step's start. The trace events
    are the whole window's (Chrome/Perfetto format) for download.
    """
    from analyzers.whatif import analyze
    from analyzers.whatif.timeline import events_of, timeline_table

    ops = codec.conform(ops, S.OP_SPAN)
    table = timeline_table(analyze(ops, layout), max_ops=MAX_OPS)
    events = events_of(table, layout)
    df = table.to_pandas()
    if step is not None:
        df = df[df["step"] == step]
    columns = ["scenario", "worker", "stream", "optype", "step", "start_ms", "end_ms"]
    if df.empty:
        return pd.DataFrame(columns=columns), events
    df = df.astype({"scenario": str, "stream": str, "optype": str})
    kept = sorted(set(zip(df["dp_rank"].tolist(), df["pp_rank"].tolist())))[:workers]
    df = df[pd.Series(list(zip(df["dp_rank"], df["pp_rank"])), index=df.index).isin(kept)].copy()
    df["worker"] = "dp" + df["dp_rank"].astype(str) + "/pp" + df["pp_rank"].astype(str)
    t0 = df.groupby("step")["start_us"].transform("min")
    df["start_ms"] = (df["start_us"] - t0) / 1e3
    df["end_ms"] = (df["end_us"] - t0) / 1e3
    return df[columns].reset_index(drop=True), events
