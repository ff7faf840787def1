"""`stragglerscope whatif`: a golden-format trace from files, its what-if result and timeline to files.

The analysis is ``analyzers.whatif``'s (pure, in memory); reading the trace and
writing the JSON and the Perfetto timeline are here. The trace is read lean and
handed over with no reference left, so the what-if frees its columns as it uses
them (the peak of a 16k-GPU window, ``benchmarks/whatif.py``).
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Any

from analyzers.whatif import WhatIfInputError, analyze_taking
from analyzers.whatif.timeline import trace_document
from core.golden import GoldenTraceError, load_golden


def whatif_files(trace: str | os.PathLike, meta: str | os.PathLike, json_out: str | os.PathLike,
                 timeline_out: str | os.PathLike | None = None) -> dict[str, Any]:
    """Analyse the trace, write the result as JSON (and the timeline: gzip when its name ends in .gz);
    returns the JSON's dict. ``WhatIfInputError`` for a trace that cannot be read or a file not written."""
    try:
        table, layout = load_golden(trace, meta, lean=True)
    except GoldenTraceError as e:  # the what-if's one error for bad input, as it always was here
        raise WhatIfInputError(str(e)) from None
    box = [table]
    del table
    res = analyze_taking(box, layout)
    d = res.to_json_dict()
    _write(json_out, lambda f: f.write(json.dumps(d, indent=1, allow_nan=False).encode()))
    if timeline_out:
        doc = trace_document(res)
        _write(timeline_out, lambda f: f.write(gzip.compress(doc, 5) if str(timeline_out).endswith(".gz") else doc))
    return d


def _write(path: str | os.PathLike, write) -> None:
    try:
        with open(path, "wb") as f:
            write(f)
    except OSError as e:
        raise WhatIfInputError(f"cannot write {path}: {e.strerror or e}") from None
