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


def layout_of(registration: dict) -> JobLayout:
    from core.registration import Registration

    return Registration.from_row(registration).layout


def timeline_frame(ops: pa.Table, layout: JobLayout, step: int | None = None,
                   workers: int = 8) -> tuple[pd.DataFrame, list[dict]]:
    """(frame, trace events): one row per op of ``step`` on the first ``workers`` workers, both scenarios.

    Frame columns: scenario ("actual"/"ideal"), worker ("dp0/pp1"), stream,
    optype, start_ms and end_ms relative to the step's start. The trace events
    are the whole window's (Chrome/Perfetto format) for download.
    """
    from analyzers.whatif import analyze
    from analyzers.whatif.opcodes import STREAM_NAMES
    from analyzers.whatif.timeline import timeline_events

    ops = codec.conform(ops, S.OP_SPAN)
    events = timeline_events(analyze(ops, layout), max_ops=MAX_OPS)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    rows = []
    for e in events:
        if e.get("ph") != "X" or (step is not None and e["args"]["step"] != step):
            continue
        scenario, worker = names.get(e["pid"], "? ?").split(" ", 1)
        rows.append((scenario, worker, STREAM_NAMES[e["tid"]], e["name"], e["args"]["step"], e["ts"], e["ts"] + e["dur"]))
    df = pd.DataFrame(rows, columns=["scenario", "worker", "stream", "optype", "step", "start_us", "end_us"])
    if df.empty:
        return df.assign(start_ms=[], end_ms=[]), events
    keep = sorted(df["worker"].unique(), key=_worker_order)[:workers]
    df = df[df["worker"].isin(keep)].copy()
    t0 = df.groupby("step")["start_us"].transform("min")
    df["start_ms"] = (df["start_us"] - t0) / 1e3
    df["end_ms"] = (df["end_us"] - t0) / 1e3
    return df.drop(columns=["start_us", "end_us"]), events


def _worker_order(name: str) -> tuple[int, int]:
    dp, pp = name.split("/")
    return int(dp[2:]), int(pp[2:])
