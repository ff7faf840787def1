"""The actual and ideal timelines of a stored window: its kept raw op spans, re-simulated.

The store keeps the raw op spans of some windows (``pipeline.keep_op_spans_*``);
the console's job page draws one step of them and offers the whole window as a
Perfetto trace, and `stragglerscope timeline` writes that trace to a file. Both
read the window here.
"""
from __future__ import annotations

import gzip

import pyarrow as pa

from core import codec
from core import schema as S
from core.layout import JobLayout


class TimelineUnavailable(ValueError):
    """The store lacks what the timeline needs: the job's registration or the window's raw op spans."""


def stored_window_ops(store, job_id: str, attempt: int, window_id: int | None) -> tuple[pa.Table, JobLayout, int]:
    """(op spans, layout, window id) of a stored window; ``window_id`` None: the job's latest with raw spans.
    ``attempt`` -1: the latest. ``TimelineUnavailable`` says what is missing."""
    from core.config import SPANS_KEPT_RULE
    from core.registration import Registration

    reg = store.run_named("job_info", {"job_id": job_id, "attempt": attempt}).to_pylist()
    if not reg:
        raise TimelineUnavailable(f"job {job_id!r} is not registered in the store")
    attempt = int(reg[0]["attempt"])
    kept = [int(w) for w in store.run_named("job_span_windows", {"job_id": job_id, "attempt": attempt})
            .column("window_id").to_pylist()]
    if window_id is None:
        if not kept:
            raise TimelineUnavailable(f"no window of {job_id!r} attempt {attempt} kept its raw op spans "
                                      f"({SPANS_KEPT_RULE})")
        window_id = max(kept)
    ops = store.run_named("window_ops", {"job_id": job_id, "attempt": attempt, "window_id": int(window_id)})
    if ops.num_rows == 0:
        which = ", ".join(str(k) for k in kept[-10:]) or "none"
        raise TimelineUnavailable(f"no raw op spans are kept for window {window_id} of {job_id!r}; this job's "
                                  f"windows with spans: {which} ({SPANS_KEPT_RULE})")
    return codec.conform(ops, S.OP_SPAN), Registration.from_row(reg[0]).layout, int(window_id)


def trace_gz(ops: pa.Table, layout: JobLayout) -> bytes:
    """The gzipped Perfetto/Chrome trace of the window's actual and ideal timelines."""
    from analyzers.whatif import analyze
    from analyzers.whatif.timeline import trace_document

    return gzip.compress(trace_document(analyze(ops, layout)), 5)
