"""What a recovery plan needs of a job's last analysed window, kept by the shard until a node of the job is lost.

Plain numbers, in a module of its own: the shard receives it with every window's result and saves it with its
state, and must not import the what-if analysis to read it (``analyzers.remedies.advise`` makes it and plans
from it).
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RecoveryBasis:
    """What a recovery plan needs of a job's last analysed window, kept until one of its nodes is lost (the shard
    keeps it per job: ``ray_jobs.dispatch``): the job's layout and layer count, the compute seconds per microbatch
    of each unit the planner places (its layers, or its stages without a layer count), each stage's, the step
    time the plan is calibrated on and the microbatches per pipeline. Plain numbers: part of the shard's state."""
    dp: int
    pp: int
    tp: int
    cp: int
    num_layers: int
    layer_s: tuple[float, ...]
    units: str
    stage_s: tuple[float, ...]
    step_s: float
    microbatches: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecoveryBasis:
        return cls(**{**d, "layer_s": tuple(d["layer_s"]), "stage_s": tuple(d["stage_s"])})
