"""The actual and ideal timelines of a stored window: its kept raw op spans, re-simulated.

The console's job page draws one step of them and offers the whole window as a
Perfetto trace; `stragglerscope timeline` writes that trace to a file. Both
read the window with ``actions.stored_window``.
"""
from __future__ import annotations

import gzip

import pyarrow as pa

from core.layout import JobLayout


def trace_gz(ops: pa.Table, layout: JobLayout) -> bytes:
    """The gzipped Perfetto/Chrome trace of the window's actual and ideal timelines."""
    from analyzers.whatif import analyze
    from analyzers.whatif.timeline import trace_document

    return gzip.compress(trace_document(analyze(ops, layout)), 5)
