"""What-if straggler analysis (docs/whatif.md): how much faster would a job run without stragglers, and why not.

Public API
- ``analyze(ops, layout, *, allow_incomplete=True, n_gpus=None) -> WhatIfResult``
- ``analyze_model(ops, layout) -> WhatIfModel`` (prepared ops and the simulator's run), and
  ``summarise(model) -> WhatIfResult``: for what re-simulates (remedies, the timeline)
- ``to_tables(result, key) -> {kind: table}``: the window's per-step, per-op-type and per-worker rows
- golden traces (parquet + meta YAML) are read by ``core.golden.load_golden(trace, meta) -> (ops, layout)``
- ``write_timeline(result_or_inputs, path)``: Perfetto/Chrome trace of actual and ideal timelines
- ``run_cli(trace, meta, json_out, timeline_out=None) -> dict``
- ``WhatIfInputError``: the only exception raised for bad input

Pure: numpy, pyarrow and pyyaml only.
"""
from .api import analyze, analyze_model, run_cli, summarise
from .load import WhatIfInputError
from .result import WhatIfModel, WhatIfResult
from .timeline import write_timeline

__all__ = ["WhatIfInputError", "WhatIfModel", "WhatIfResult", "analyze", "analyze_model", "run_cli", "summarise",
           "write_timeline"]
