"""What-if straggler analysis (WHATIF.md): how much faster would a job run without stragglers, and why not.

Public API
- ``analyze(ops, layout, *, allow_incomplete=True, gpu_hours=None) -> WhatIfResult``
- ``load_golden(trace_parquet, meta_yaml) -> (ops, layout)``
- ``write_timeline(result_or_inputs, path)``: Perfetto/Chrome trace of actual and ideal timelines
- ``run_cli(trace, meta, json_out, timeline_out=None) -> dict``
- ``WhatIfInputError``: the only exception raised for bad input

Pure: numpy, pyarrow and pyyaml only.
"""
from .api import analyze, run_cli
from .load import WhatIfInputError, load_golden
from .result import WhatIfResult
from .timeline import write_timeline

__all__ = ["WhatIfInputError", "WhatIfResult", "analyze", "load_golden", "run_cli", "write_timeline"]
