"""``WhatIfResult``: the frozen outcome of one analysis and its JSON form; ``WhatIfModel``: what it was computed from.

Step and rank keys are ints in the result; ``to_json_dict`` returns plain
JSON types only: those keys become strings (the golden JSON's form, and
``stragglerscope whatif --json``), NaN becomes None, times are seconds. The golden-result names are
mapped as follows: ``step_t_base`` = step_time.actual, ``step_t_nodelay`` =
step_time.simulated, ``step_t_noblk`` = step_time.ideal,
``blocking_slowdown`` = slowdown, ``blocking_decompose_by_{optype,dp_rank,
stage}`` = by_{optype,dp_rank,pp_rank}.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from core.jsonutil import json_safe
from core.layout import JobLayout


@dataclasses.dataclass(frozen=True)
class WhatIfModel:
    """The prepared ops and the simulator's run of one window (``api.analyze_model``).

    Remedies re-simulate it with changed durations, the timeline replays it:
    both need more than the summary. Held in memory only (never serialised).
    """

    prepared: Any  # load.PreparedOps
    run: Any  # scenarios.Run


@dataclasses.dataclass(frozen=True)
class WhatIfResult:
    """Metrics of one window (docs/whatif.md, section 5), verdicts and data-quality notes."""

    job_id: str
    layout: JobLayout
    steps: tuple[int, ...]
    slowdown: float
    launch_slowdown: float
    waste_fraction: float
    step_time: dict[str, dict[int, float]]  # "actual" | "simulated" | "ideal" | "replay" -> step -> seconds
    step_slowdown: dict[int, float]  # step ->
    by_optype: dict[str, float]  # op type ->
    by_dp_rank: dict[int, float]  # DP rank ->
    by_pp_rank: dict[int, float]  # PP rank ->
    by_optype_per_step: dict[int, dict[str, float]]  # step -> op type ->
    by_dp_rank_per_step: dict[int, dict[int, float]]  # step -> DP rank ->
    by_pp_rank_per_step: dict[int, dict[int, float]]  # step -> PP rank ->
    worker_slowdown: list[list[float]]
    M_W: float
    M_S: float
    mw: dict[str, Any]
    ms: dict[str, Any]
    verdicts: list[dict[str, Any]]
    warnings: list[str]
    unknown_optypes: list[str]
    complete: bool
    missing_workers: list[list[int]]
    n_ops: int
    gpu_hours: float
    wasted_gpu_hours: float
    ideal_durations: dict[str, float]
    replay_error: float
    model: WhatIfModel | None = dataclasses.field(default=None, repr=False, compare=False)
    """What the metrics were computed from; None for a result rebuilt from its JSON."""

    @property
    def verdict(self) -> str:
        """Kind of the main verdict, '' when the window is not straggling."""
        return self.verdicts[0]["kind"] if self.verdicts else ""

    def to_json_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}
        lay = self.layout
        d["layout"] = {"dp_size": lay.dp_size, "pp_size": lay.pp_size, "tp_size": lay.tp_size,
                       "cp_size": lay.cp_size, "vpp_size": lay.vpp_size, "world_size": lay.world_size}
        d["verdict"] = self.verdict
        return json_safe(d)
