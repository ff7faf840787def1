"""What-if straggler analysis (docs/whatif.md): how much faster would a job run without stragglers, and why not.

Public API
- ``analyze(ops, layout, *, allow_incomplete=True, n_gpus=None) -> WhatIfResult``
- ``analyze_model(ops, layout) -> WhatIfModel`` (prepared ops and the simulator's run), and
  ``summarise(model) -> WhatIfResult``: for what re-simulates (remedies, the timeline)
- ``to_tables(result, key) -> {kind: table}``: the window's per-step, per-op-type and per-worker rows
- golden traces (parquet + meta YAML) are read by ``core.golden.load_golden(trace, meta) -> (ops, layout)``
- ``analyze_taking([table], layout)``: ``analyze`` that frees the input's columns as it goes
- ``timeline_table`` and ``trace_document`` (``.timeline``): actual and ideal timelines, as a table and as
  a Perfetto/Chrome trace; reading trace files and writing results is ``actions.whatif_files``' work
- ``WhatIfInputError``: the only exception raised for bad input

Pure: numpy, pyarrow and pyyaml only.
"""
from .api import analyze, analyze_model, analyze_taking, summarise
from .load import WhatIfInputError
from .result import WhatIfModel, WhatIfResult

__all__ = ["WhatIfInputError", "WhatIfModel", "WhatIfResult", "analyze", "analyze_model", "analyze_taking",
           "summarise"]
