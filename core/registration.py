"""A job's registration, typed: what the JOB record told us, or defaults when it never came."""
from __future__ import annotations

import dataclasses

from core.layout import JobLayout


@dataclasses.dataclass
class Registration:
    """What the registration told us; defaults when a job never registered."""

    job_id: str
    attempt: int
    layout: JobLayout
    profiled_steps: int
    team: str = ""
    model: str = ""
    n_gpus: int = 0
    registered: bool = True
    registration: dict | None = None
    """The whole JOB row (FLOPs facts for MFU, layers for remedies)."""

    @classmethod
    def from_row(cls, row: dict) -> "Registration":
        lay = JobLayout(dp_size=row["dp_size"], pp_size=row["pp_size"], tp_size=row["tp_size"],
                        cp_size=row["cp_size"], vpp_size=row["vpp_size"])
        return cls(job_id=row["job_id"], attempt=row["attempt"], layout=lay,
                   profiled_steps=max(1, row["profiled_steps"]), team=row["team"], model=row["model"],
                   n_gpus=row["n_gpus"] or lay.world_size, registration=dict(row))
