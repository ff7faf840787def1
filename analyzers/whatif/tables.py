"""A ``WhatIfResult`` as rows of the result tables (``core.schema``): the one conversion, owned here.

``to_tables(result, key)`` gives the tables of STEP_SLOWDOWN (per step), OPTYPE_SLOWDOWN
(per op type, window and per step: ``step = -1`` for the window) and
WORKER_SLOWDOWN (per worker, window and per step), by kind, as every analyzer's
``to_tables`` does; ``window_fields(result)`` the what-if columns of the
window's WINDOW row. The caller adds what the analysis does not know (the
registration's owner and GPUs, MFU, the window's wall-clock span).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa

from core import codec
from core import schema as S

from .gpu_hours import waste_fraction
from .result import WhatIfResult

MAX_PER_STEP_CELLS = 50_000
"""Per-step S_w cells are kept while a window has at most this many (steps x workers)."""


def _num(x: Any) -> float:
    """A finite float, or NaN (for None, NaN, infinities and what is not a number)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v if math.isfinite(v) else float("nan")


def step_times(result: WhatIfResult) -> dict[str, dict[int, float]]:
    """{"actual" | "simulated" | "ideal": {step: seconds}} of the window's steps."""
    return {kind: {k: float(v) for k, v in result.step_time.get(kind, {}).items()}
            for kind in ("actual", "simulated", "ideal")}


def _mean(times: dict[int, float]) -> float:
    return float(np.mean(list(times.values()))) if times else float("nan")


def window_fields(result: WhatIfResult) -> dict[str, Any]:
    """The what-if columns of a WINDOW row, plus ``verdicts`` and ``warnings`` (lists) for the caller."""
    t = step_times(result)
    slow = _num(result.slowdown)
    waste = _num(result.waste_fraction)
    if waste != waste:  # a result rebuilt from JSON that left it out
        waste = waste_fraction(slow)
    warnings = list(result.warnings)
    if result.unknown_optypes:
        warnings.append(f"unknown op types ignored: {sorted(result.unknown_optypes)}")
    return dict(
        slowdown=slow, launch_slowdown=_num(result.launch_slowdown), waste_fraction=waste,
        step_time_actual=_mean(t["actual"]), step_time_sim=_mean(t["simulated"]), step_time_ideal=_mean(t["ideal"]),
        m_w=_num(result.M_W), m_s=_num(result.M_S), complete=bool(result.complete),
        verdicts=list(result.verdicts), warnings=warnings,
    )


def to_tables(result: WhatIfResult, key: tuple[str, int, int]) -> dict[str, pa.Table]:
    """{"step_slowdown" | "optype_slowdown" | "worker_slowdown": table} of one window ``key`` (job, attempt, window)."""
    base = dict(job_id=key[0], attempt=key[1], window_id=key[2])
    t = step_times(result)
    sim, ideal = t["simulated"], t["ideal"]
    out: dict[str, list[dict[str, Any]]] = {"optype_slowdown": [], "worker_slowdown": [], "step_slowdown": []}
    for step, actual in sorted(t["actual"].items()):
        out["step_slowdown"].append(dict(base, step=step, actual_s=actual, sim_s=sim.get(step, float("nan")),
                                       ideal_s=ideal.get(step, float("nan")),
                                       slowdown=_num(result.step_slowdown.get(step))))
    for optype, v in result.by_optype.items():
        out["optype_slowdown"].append(dict(base, step=-1, optype=optype, slowdown=_num(v)))
    for step, per in result.by_optype_per_step.items():
        for optype, v in per.items():
            out["optype_slowdown"].append(dict(base, step=step, optype=optype, slowdown=_num(v)))
    for pp, cells in enumerate(result.worker_slowdown):
        for dp, v in enumerate(cells):
            out["worker_slowdown"].append(dict(base, step=-1, dp_rank=dp, pp_rank=pp,
                                               s_dp=_num(result.by_dp_rank.get(dp)),
                                               s_pp=_num(result.by_pp_rank.get(pp)), s_w=_num(v)))
    out["worker_slowdown"] += _per_step_workers(result, base)
    return {"optype_slowdown": codec.from_rows(S.OPTYPE_SLOWDOWN, out["optype_slowdown"]),
            "worker_slowdown": codec.from_rows(S.WORKER_SLOWDOWN, out["worker_slowdown"]),
            "step_slowdown": codec.from_rows(S.STEP_SLOWDOWN, out["step_slowdown"])}


def _per_step_workers(result: WhatIfResult, base: dict) -> list[dict[str, Any]]:
    """S_w per step (min of the step's S_dp and S_pp, as for the window) for the per-step heatmaps."""
    grid = result.worker_slowdown
    n_cells = sum(len(r) for r in grid)
    dp_steps, pp_steps = result.by_dp_rank_per_step, result.by_pp_rank_per_step
    if not grid or len(dp_steps) * n_cells > MAX_PER_STEP_CELLS:
        return []
    rows = []
    for step, per_dp in dp_steps.items():
        per_pp = pp_steps.get(step, {})
        for pp, cells in enumerate(grid):
            for dp, whole in enumerate(cells):
                if whole is None or whole != whole:  # worker absent from the window
                    continue
                sdp, spp = _num(per_dp.get(dp)), _num(per_pp.get(pp))
                rows.append(dict(base, step=step, dp_rank=dp, pp_rank=pp, s_dp=sdp, s_pp=spp, s_w=min(sdp, spp)))
    return rows
