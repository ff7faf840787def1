"""The advice's data: ``Remedy`` (one action and its predicted gain) and ``JobFacts`` (what the trace cannot tell).

A remedy is what an on-call engineer acts on: one line (``action``), the
verdict it answers, and the gain the what-if simulator predicts on the job's
own trace with the fix applied (``predicted_gain`` = step time before /
after - 1). ``details`` holds the plan itself (the new partition, the packing,
the hosts) as plain JSON types; ``to_tables`` gives a batch of remedies as
REMEDY rows, as every analyzer's ``to_tables`` does.

``JobFacts`` carries the facts an op trace does not hold: how many layers the
model has and how they are split, the host size and names, the data loader's
sequence lengths, and what is left of the fleet after a node loss. Every
field is optional beyond the layout; a remedy that needs a missing fact is
either not offered or says that its number is a bound.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from core import codec
from core import schema as S
from core.jsonutil import json_safe
from core.layout import JobLayout

KINDS = ("repartition", "repack", "swap_host", "gc_interval", "drain_link", "recovery_plan")


@dataclasses.dataclass(frozen=True)
class Remedy:
    """One concrete fix for one verdict, with the gain the simulator predicts for it."""

    kind: str  # one of KINDS
    verdict: str  # the verdict kind it answers (WhatIfResult.verdicts[i]["kind"], "link_fault", "node_loss")
    action: str  # one line an on-call engineer can act on
    predicted_gain: float  # step time before / after - 1
    step_time_before_s: float  # simulated mean step time of the window as traced
    step_time_after_s: float  # simulated mean step time with the fix applied
    details: dict[str, Any]  # the plan, JSON types only
    priority: int = 0  # 1 = the first to apply (set by ``advise``: ranked by predicted gain)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown remedy kind {self.kind!r} (known: {', '.join(KINDS)})")
        object.__setattr__(self, "details", json_safe(self.details))


def _row(remedy: Remedy, key: tuple[str, int, int], advised_ns: int) -> dict[str, Any]:
    """Flat record for storage: str/int/float fields, the plan as ``details_json``.

    Infinite gains and step times (a recovery plan restores stopped progress;
    nothing can run) become the REMEDY schema's stand-in, +-``STORED_INF``.
    """
    job_id, attempt, window_id = key
    return {
        "job_id": str(job_id), "attempt": int(attempt), "window_id": int(window_id), "advised_ns": int(advised_ns),
        "priority": int(remedy.priority), "kind": remedy.kind, "verdict": remedy.verdict, "action": remedy.action,
        "predicted_gain": _finite(remedy.predicted_gain), "step_time_before_s": _finite(remedy.step_time_before_s),
        "step_time_after_s": _finite(remedy.step_time_after_s),
        "details_json": json.dumps(remedy.details, sort_keys=True, allow_nan=False),
    }


def _finite(x: float) -> float:
    x = float(x)
    return (S.STORED_INF if x > 0 else -S.STORED_INF) if math.isinf(x) else x


def to_tables(remedies: Iterable[Remedy], key: tuple[str, int, int], advised_ns: int) -> dict[str, pa.Table]:
    """{"remedy": REMEDY rows} of one advice batch (one ``advised_ns``) for window ``key`` (job, attempt, window)."""
    return {"remedy": codec.from_rows(S.REMEDY, [_row(r, key, advised_ns) for r in remedies])}


@dataclasses.dataclass(frozen=True)
class JobFacts:
    """Facts about a job that its op trace does not carry. Only ``layout`` is required."""

    layout: JobLayout
    num_layers: int | None = None
    """Transformer layers of the model (needed to propose a new layer partition)."""
    stage_layers: tuple[int, ...] | None = None
    """Layers per stage as run; None: an even split of ``num_layers`` (remainder on the first stages)."""
    gpus_per_node: int = 8
    hosts: tuple[str, ...] | None = None
    """Host name by host index (global rank // gpus_per_node); None: ``node-0000`` style names."""
    spare_hosts: tuple[str, ...] = ()
    sequences: pa.Table | None = None
    """The data loader's sequences of the window: columns step, dp_rank, mb_id, seq_len (tokens)."""
    nodes_alive: int | None = None
    """Nodes left after a node loss; None: derived from workers missing in the trace (if any)."""
    fault_tolerance: int = 1
    """f of the recovery plan: pipelines must survive f more simultaneous failures."""
    global_batch: int | None = None
    """Microbatches per step over all pipelines; None: dp_size x microbatches seen in the trace."""
    min_nodes_per_pipeline: int | None = None
    """Smallest node count that holds the model; None: the job's own pipeline (it was sized to fit)."""

    def __post_init__(self) -> None:
        pp = self.layout.pp_size
        if self.stage_layers is not None:
            if len(self.stage_layers) != pp or min(self.stage_layers) < 0:
                raise ValueError(f"stage_layers needs {pp} non-negative counts, got {self.stage_layers!r}")
            if self.num_layers is None:
                object.__setattr__(self, "num_layers", int(sum(self.stage_layers)))
            elif sum(self.stage_layers) != self.num_layers:
                raise ValueError(f"stage_layers {self.stage_layers} do not add up to num_layers={self.num_layers}")
        if self.gpus_per_node < 1 or self.fault_tolerance < 0:
            raise ValueError("gpus_per_node must be >= 1 and fault_tolerance >= 0")

    @property
    def current_partition(self) -> tuple[int, ...] | None:
        if self.stage_layers is not None:
            return tuple(int(x) for x in self.stage_layers)
        if self.num_layers is None:
            return None
        pp = self.layout.pp_size
        q, r = divmod(self.num_layers, pp)
        return tuple(q + (1 if s < r else 0) for s in range(pp))

    @property
    def ranks_per_worker(self) -> int:
        return self.layout.tp_size * self.layout.cp_size

    def worker_ranks(self, dp: int, pp: int) -> range:
        """Global ranks of worker (dp, pp): Megatron order, TP and CP fastest, then DP, then PP."""
        w = self.ranks_per_worker
        first = (pp * self.layout.dp_size + dp) * w
        return range(first, first + w)

    def worker_of_rank(self, rank: int) -> tuple[int, int]:
        """(dp, pp) of a global rank."""
        w = int(rank) // self.ranks_per_worker
        return w % self.layout.dp_size, w // self.layout.dp_size

    def host_index(self, rank: int) -> int:
        return int(rank) // self.gpus_per_node

    def host_name(self, index: int) -> str:
        if self.hosts is not None and 0 <= index < len(self.hosts):
            return self.hosts[index]
        return f"node-{index:04d}"

    @property
    def n_nodes(self) -> int:
        return -(-self.layout.world_size // self.gpus_per_node)
