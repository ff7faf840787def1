"""Entry points: ``analyze_model`` (table in, ``WhatIfModel`` out), ``analyze`` (its summary, a
``WhatIfResult``); ``actions.whatif_files`` reads and writes the files around it.

``analyze`` raises only ``WhatIfInputError`` for input it cannot use (missing
columns, nothing usable, missing workers with ``allow_incomplete=False``, a
dependency cycle); bad rows, unknown op types and duplicates are dropped and
reported in ``warnings``. Arithmetic trouble caused by odd data is turned into
a ``WhatIfInputError`` as well, so a caller never dies of a trace.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa

from core.layout import JobLayout
from core.memory import release_memory

from . import opcodes as T
from .gpu_hours import waste_fraction, wasted_gpu_hours, window_gpu_hours
from .load import PreparedOps, WhatIfInputError, prepare_ops, prepare_ops_taking
from .result import WhatIfModel, WhatIfResult
from .scenarios import Run, run_scenarios
from .verdicts import verdicts as make_verdicts


def _share(t: float, t_fix: float, t_ideal: float) -> float:
    den = t - t_ideal
    return (t - t_fix) / den if den != 0 else float("nan")


def _metrics(p: PreparedOps, r: Run, n_gpus: int | None) -> dict[str, Any]:
    steps = [int(s) for s in r.steps]
    mean_ideal = float(np.mean(r.ideal))
    S = Run.ratio(r.sim, r.ideal)
    lay = p.layout

    def total(v: np.ndarray) -> float:
        return float(np.mean(v)) / mean_ideal if mean_ideal > 0 else float("nan")

    def per_step(src: dict, key=int) -> dict[int, dict[Any, float]]:
        return {s: {key(k): float(v[i] / r.ideal[i]) for k, v in src.items()} for i, s in enumerate(steps)}

    by_dp = {int(k): total(v) for k, v in r.by_dp.items()}
    by_pp = {int(k): total(v) for k, v in r.by_pp.items()}
    present = p.workers_present()
    sw = [[min(by_dp.get(d, math.nan), by_pp.get(x, math.nan)) if present[d, x] else math.nan
           for d in range(lay.dp_size)] for x in range(lay.pp_size)]
    tori, tid = float(np.mean(r.sim)), mean_ideal
    trem_w, tadd_w = float(np.mean(r.mw_rem)), float(np.mean(r.mw_add))
    trem_s, tadd_s = float(np.mean(r.ms_rem)), float(np.mean(r.ms_add))
    M_W = _share(tori, trem_w, tid)
    M_S = _share(tori, trem_s, tid)
    gpu_hours = window_gpu_hours(lay.world_size if n_gpus is None else n_gpus, r.actual)
    return {
        "slowdown": S, "launch_slowdown": Run.ratio(r.actual, r.sim), "waste_fraction": waste_fraction(S),
        "step_time": {"actual": dict(zip(steps, r.actual.tolist())), "simulated": dict(zip(steps, r.sim.tolist())),
                   "ideal": dict(zip(steps, r.ideal.tolist())), "replay": dict(zip(steps, r.replay.tolist()))},
        "step_slowdown": {s: float(r.sim[i] / r.ideal[i]) for i, s in enumerate(steps)},
        "by_optype": {k: total(v) for k, v in r.by_group.items()}, "by_dp_rank": by_dp, "by_pp_rank": by_pp,
        "by_optype_per_step": per_step(r.by_group, str), "by_dp_rank_per_step": per_step(r.by_dp),
        "by_pp_rank_per_step": per_step(r.by_pp), "worker_slowdown": sw, "M_W": M_W, "M_S": M_S,
        "mw": {"tori": tori, "tideal": tid, "trem": trem_w, "tadd": tadd_w, "rem": M_W,
            "add": (tadd_w - tid) / (tori - tid) if tori != tid else math.nan,
            "top_workers": [[d, x] for d, x in r.top_workers]},
        "ms": {"tori": tori, "tideal": tid, "trem": trem_s, "tadd": tadd_s, "rem": M_S,
            "add": (tadd_s - tid) / (tori - tid) if tori != tid else math.nan, "stage": lay.pp_size - 1},
        "gpu_hours": gpu_hours, "wasted_gpu_hours": wasted_gpu_hours(gpu_hours, S),
    }


def _warnings(p: PreparedOps, r: Run) -> list[str]:
    w = list(p.warnings)
    c = r.counts
    if c.get("p2p_noop"):
        w.append(f"{c['p2p_noop']} sends/recvs without a peer chunk or compute treated as no-ops")
    if c.get("p2p_unpaired"):
        w.append(f"{c['p2p_unpaired']} sends/recvs without their peer op simulated as local ops")
    if c.get("negative_transfer"):
        w.append(f"{c['negative_transfer']} communication ops ended before their group's last start: "
                 f"transfer set to 0")
    if c.get("delay_clamped"):
        w.append(f"{c['delay_clamped']} launch delays below -10 ms clamped to 0 (clock skew?)")
    la = Run.ratio(r.actual, r.sim)
    if math.isfinite(la) and abs(la - 1.0) >= 0.05:
        w.append(f"simulation fidelity: actual/simulated step time = {la:.3f} (the paper drops windows "
                 f"off by 5% or more)")
    return w


def analyze_model(ops: pa.Table, layout: JobLayout, *, allow_incomplete: bool = True,
                  chunk_ops: int | None = None) -> WhatIfModel:
    """The prepared ops of one window (``core.schema.OP_SPAN``) and every scenario simulated on them."""
    release_memory()  # pages freed since the last call (a previous analysis) would add to this one's peak
    return _model(prepare_ops(ops, layout, allow_incomplete=allow_incomplete), chunk_ops)


def _model(p: PreparedOps, chunk_ops: int | None = None) -> WhatIfModel:
    try:
        overlapped = bool(np.any(p.code == T.SAR))
        kw = {"chunk_ops": chunk_ops} if chunk_ops else {}
        return WhatIfModel(p, run_scenarios(p, overlapped_dp=overlapped, **kw))
    except WhatIfInputError:
        raise
    except (ValueError, IndexError, ZeroDivisionError, FloatingPointError, OverflowError) as e:
        raise WhatIfInputError(f"cannot analyse these op spans: {type(e).__name__}: {e}".splitlines()[0]) from e


def analyze(ops: pa.Table, layout: JobLayout, *, allow_incomplete: bool = True,
            n_gpus: int | None = None, chunk_ops: int | None = None) -> WhatIfResult:
    """What-if analysis of one window of op spans (``core.schema.OP_SPAN``): ``summarise(analyze_model(...))``.
    ``n_gpus``: the job's GPUs, for its GPU-hours (default: the layout's world size)."""
    return summarise(analyze_model(ops, layout, allow_incomplete=allow_incomplete, chunk_ops=chunk_ops), n_gpus)


def summarise(model: WhatIfModel, n_gpus: int | None = None) -> WhatIfResult:
    """The metrics, verdicts and data-quality notes of an analysed window (docs/whatif.md, section 5)."""
    p, r = model.prepared, model.run
    try:
        m = _metrics(p, r, n_gpus)
        m["verdicts"] = make_verdicts(p, m)
    except WhatIfInputError:
        raise
    except (ValueError, IndexError, ZeroDivisionError, FloatingPointError, OverflowError) as e:
        raise WhatIfInputError(f"cannot analyse these op spans: {type(e).__name__}: {e}".splitlines()[0]) from e
    release_memory()  # the passes' scratch memory
    return WhatIfResult(
        job_id=p.job_id,
        layout=p.layout,
        steps=tuple(int(s) for s in r.steps), warnings=_warnings(p, r), unknown_optypes=list(p.unknown_optypes),
        complete=not p.missing_workers, missing_workers=[[d, x] for d, x in p.missing_workers], n_ops=p.n,
        ideal_durations={k: v / 1e9 for k, v in r.ideal_ns.items()}, replay_error=r.replay_error,
        model=model, **m,
    )


def analyze_taking(box: list[pa.Table], layout: JobLayout) -> WhatIfResult:
    """``analyze`` of the one table in ``box``, which it takes out and frees column by column as they are
    used: the caller keeps no reference, and a 16k-GPU window's peak memory stays that of its columns."""
    return summarise(_model(prepare_ops_taking(box, layout)))
