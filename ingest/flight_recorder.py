"""PyTorch's Flight Recorder, read when a rank looks stuck: what the collective library itself saw.

With ``TORCH_FR_BUFFER_SIZE`` set (``TORCH_NCCL_TRACE_BUFFER_SIZE`` in torch before 2.7), the process groups
keep a ring of their last collectives, and per group the last collective enqueued, started and completed.
It is the library's account, independent of ours: on a GPU it is what NCCL's watchdog saw of each
collective, where our records are the calling stream's events. ``stragglerscope trace`` sets the buffer for
the job (``ENV``); the exporter reads it with a stack dump (``summary``: the library's dump, no collective, so
safe while the job is hung) and the hang stores it in its evidence.
"""
from __future__ import annotations

import json
from typing import Any

ENV = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
"""The variables that set the buffer, new and old: ``trace`` sets the one the job's torch reads (``env_for``),
where the user has set neither: 2,000 entries (torch's own suggestion; a few MB)."""


def env_for(torch_version: str | None) -> dict[str, str]:
    """The Flight Recorder's buffer for a job running ``torch_version`` (None: not installed here, so the job's
    is newer than the launcher knows): the new name from torch 2.7, the old before it. Both at once made every
    rank of a torch 2.7+ job print that the old one is deprecated."""
    try:
        major, minor = (int(x) for x in (torch_version or "").split("+")[0].split(".")[:2])
    except ValueError:
        return {"TORCH_FR_BUFFER_SIZE": ENV["TORCH_FR_BUFFER_SIZE"]}
    name = "TORCH_FR_BUFFER_SIZE" if (major, minor) >= (2, 7) else "TORCH_NCCL_TRACE_BUFFER_SIZE"
    return {name: ENV[name]}

MAX_PENDING = 4
"""Collectives not completed, kept per rank (the oldest first): the one a hang is in, and a few after it."""


def _dump() -> dict | None:
    try:
        import torch._C._distributed_c10d as c10d
    except Exception:
        return None
    fn = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if fn is None:
        return None
    return json.loads(fn(includeCollectives=True, onlyActive=False))


def summary(raw: dict | None = None) -> str:
    """This process's Flight Recorder in a few hundred bytes (JSON), or "" where it records nothing: per
    group the last collective enqueued, started and completed, and the oldest entries not completed."""
    try:
        raw = _dump() if raw is None else raw
    except Exception:  # no process group, a torch without it: nothing to add to the stacks
        return ""
    if not raw:
        return ""
    names = {pid: (cfg.get("name") or cfg.get("desc") or pid) for pid, cfg in (raw.get("pg_config") or {}).items()}
    groups: dict[str, Any] = {}
    for pid, st in (raw.get("pg_status") or {}).items():
        groups[str(names.get(pid) or pid)] = {k: int(st.get(f"last_{k}_collective", -1)) for k in
                                              ("enqueued", "started", "completed")}
    pending = []
    for e in raw.get("entries") or []:
        if e.get("state") == "completed" or e.get("retired"):
            continue
        pg = e.get("process_group") or ["", ""]
        pending.append({"group": pg[1] if len(pg) > 1 else str(pg[0]), "seq": int(e.get("collective_seq_id", -1)),
                        "p2p_seq": int(e.get("p2p_seq_id", -1)), "op": str(e.get("profiling_name", "")),
                        "state": str(e.get("state", "")), "sizes": e.get("input_sizes") or []})
    if not groups and not pending:
        return ""
    return json.dumps({"version": str(raw.get("version", "")), "groups": groups, "pending": pending[:MAX_PENDING]},
                      separators=(",", ":"))
