"""A job's parallelism (``JobLayout``) and the folded rank lists that name groups of ranks."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class JobLayout:
    """Parallelism of one job. TP and CP are folded into the (dp, pp) worker."""

    dp_size: int
    pp_size: int
    tp_size: int = 1
    cp_size: int = 1
    vpp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_size", "pp_size", "tp_size", "cp_size", "vpp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.dp_size * self.pp_size * self.tp_size * self.cp_size

    @property
    def n_workers(self) -> int:
        return self.dp_size * self.pp_size

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "JobLayout":
        """From a golden-trace meta YAML (``dsp_size`` is context parallel)."""
        try:
            return cls(
                dp_size=int(meta["dp_size"]),
                pp_size=int(meta["pp_size"]),
                tp_size=int(meta.get("tp_size", 1)),
                cp_size=int(meta.get("dsp_size", meta.get("cp_size", 1))),
                vpp_size=int(meta.get("vpp_size", 1)),
            )
        except KeyError as e:
            raise ValueError(f"job meta lacks {e.args[0]!r}") from None


def fold_ranks(ranks) -> str:
    """Folded ranges, e.g. [0, 1, 2, 3, 5] -> '0-3,5'."""
    rs = sorted(set(int(r) for r in ranks))
    out, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)
