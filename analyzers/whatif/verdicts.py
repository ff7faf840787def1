"""Root-cause verdicts of docs/whatif.md, section 6, each with the numbers behind it.

``verdicts`` reads the metrics of a finished analysis and returns a list of
dicts ``{"kind", "score", "summary", "evidence"}``, most important first
(``score`` is the share of the slowdown the cause explains, 0 to about 1).
No verdict is given when the job is not straggling (S < ``MIN_SLOWDOWN``):
every share is then a ratio of noise.

Rules
- ``worker``: M_W > 0.5, the top 3% workers by S_w explain the slowdown.
- ``last_stage_imbalance``: M_S >= 0.5 (pipelines with more than one stage), and the last stage is slow on
  its DP replicas alike (its lower-median worker at least halfway to its slowest): one slow worker there
  is the worker verdict's.
- ``sequence_imbalance``: forward and backward durations of the same
  microbatch correlate >= 0.9 across microbatches, after dividing each by its
  worker-step median (that removes slow workers and heavy stages, which make
  both passes slow together too), and compute explains part of the slowdown.
- ``gc``: traced ``gc`` ops explain at least 30% of the slowdown.
- ``communication``: the attribution group with the largest S_t is a
  communication type.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import opcodes as T
from .load import PreparedOps

MIN_SLOWDOWN = 1.05
"""Below this S a window is not straggling; shares of (S - 1) are noise."""
WORKER_MW = 0.5
STAGE_MS = 0.5
SEQ_CORR = 0.9
GC_SHARE = 0.3
MAX_PAIRS = 200_000
"""Microbatch pairs sampled for the correlation (bounded cost on huge windows)."""


def _stage_wide(m: dict) -> bool:
    """Whether the last stage is slow on its DP replicas alike (a heavy stage: its layers), not on one of them
    (a slow worker, or a rank late to its collectives: fixing the stage fixes that worker too, so M_S says
    nothing of which). The lower median of the last stage's workers' S_w must be at least halfway to their
    largest: a DP2 x PP2 job with one late rank had S_w 1.00 and 1.22 there and was told to rebalance its
    layers, although both stages compute the same."""
    sw = m.get("worker_slowdown") or []
    if not sw:
        return True
    last = [float(v) for v in sw[max(m["by_pp_rank"])] if v is not None and np.isfinite(v)]
    if len(last) < 2:
        return True
    last.sort()
    return last[(len(last) - 1) // 2] - 1.0 >= 0.5 * (last[-1] - 1.0)


def _r(x: float, nd: int = 4) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), nd)


def microbatch_correlation(p: PreparedOps) -> tuple[float, int, float]:
    """(corr, pairs, cv): correlation of normalised forward and backward durations per microbatch.

    cv is the coefficient of variation of the normalised forward durations.
    """
    f = np.flatnonzero(p.code == T.F)
    b = np.flatnonzero(p.code == T.B)
    if len(f) < 3 or len(b) < 3:
        return float("nan"), 0, float("nan")
    lay = p.layout
    ws = lambda r: (p.step_idx[r].astype(np.int64) * lay.dp_size + p.dp[r]) * lay.pp_size + p.pp[r]
    n_ws = int(ws(f).max()) + 1
    stride = max(1, int(np.ceil(len(f) / MAX_PAIRS)))
    if stride > 1:
        f = f[ws(f) % stride == 0]
        b = b[ws(b) % stride == 0]
    chunk = p.gmc.astype(np.int64)
    m = int(max(p.mb[f].max(initial=0), p.mb[b].max(initial=0))) + 2
    kf = (ws(f) * (int(chunk.max()) + 1) + chunk[f]) * m + p.mb[f] + 1
    kb = (ws(b) * (int(chunk.max()) + 1) + chunk[b]) * m + p.mb[b] + 1
    order = np.argsort(kb, kind="stable")
    pos = np.minimum(np.searchsorted(kb[order], kf), len(kb) - 1)
    hit = kb[order][pos] == kf
    fi, bi = f[hit], b[order][pos[hit]]
    if len(fi) < 3:
        return float("nan"), 0, float("nan")
    fd, bd = p.dur[fi].astype(np.float64), p.dur[bi].astype(np.float64)
    w = ws(fi)
    # Divide by the worker-step mean of each pass.
    cnt = np.bincount(w, minlength=n_ws).astype(np.float64)
    fm = np.bincount(w, fd, minlength=n_ws) / np.maximum(cnt, 1)
    bm = np.bincount(w, bd, minlength=n_ws) / np.maximum(cnt, 1)
    ok = (fm[w] > 0) & (bm[w] > 0) & (cnt[w] > 1)
    x, y = fd[ok] / fm[w][ok], bd[ok] / bm[w][ok]
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return float("nan"), len(x), 0.0
    return float(np.corrcoef(x, y)[0, 1]), len(x), float(x.std())


def gc_evidence(p: PreparedOps) -> dict[str, Any]:
    g = np.flatnonzero(p.code == T.GC)
    if len(g) == 0:
        return {"gc_ops": 0}
    d = p.dur[g].astype(np.float64)
    hit = d > 0
    steps = p.step_idx[g]
    trend = float("nan")
    if hit.sum() > 2 and np.unique(steps).size > 2 and d.std() > 0:
        trend = float(np.corrcoef(steps.astype(np.float64), d)[0, 1])
    return {"gc_ops": len(g), "gc_ops_nonzero": int(hit.sum()),
            "gc_hit_fraction": _r(hit.mean()), "gc_mean_ms": _r(d.mean() / 1e6, 3),
            "gc_max_ms": _r(d.max() / 1e6, 3), "gc_growth_corr": _r(trend, 3)}


def verdicts(p: PreparedOps, m: dict[str, Any]) -> list[dict[str, Any]]:
    """Verdicts from the metrics dict ``m`` (keys of WhatIfResult.to_json_dict)."""
    S = m["slowdown"]
    out: list[dict[str, Any]] = []
    if S is None or not np.isfinite(S) or S < MIN_SLOWDOWN:
        return out
    excess = S - 1.0
    by_t: dict[str, float] = m["by_optype"]

    mw = m["M_W"]
    if mw is not None and np.isfinite(mw) and mw > WORKER_MW:
        top = m["mw"]["top_workers"]
        sw = m["worker_slowdown"]
        cells = [{"dp_rank": d, "pp_rank": x, "S_w": _r(sw[x][d])} for d, x in top]
        where = ", ".join(f"dp{d}/pp{x}" for d, x in top[:4])
        out.append({"kind": "worker", "score": _r(min(mw, 1.5)), "summary": (
            f"{len(top)} worker(s) ({where}) cause {100 * min(mw, 1):.0f}% of the {100 * excess:.1f}% slowdown"),
            "evidence": {"M_W": _r(mw), "S": _r(S), "top_workers": cells, "tori": m["mw"]["tori"],
                      "trem": m["mw"]["trem"], "tideal": m["mw"]["tideal"]}})

    ms = m["M_S"]
    n_pp = len(m["by_pp_rank"])
    if n_pp > 1 and ms is not None and np.isfinite(ms) and ms >= STAGE_MS and _stage_wide(m):
        last = max(m["by_pp_rank"])
        out.append({"kind": "last_stage_imbalance", "score": _r(min(ms, 1.5)), "summary": (
            f"the last pipeline stage causes {100 * min(ms, 1):.0f}% of the {100 * excess:.1f}% slowdown "
            f"(S_pp={m['by_pp_rank'][last]:.3f}); rebalance the layers of the last stage"),
            "evidence": {"M_S": _r(ms), "S": _r(S), "S_pp_last": _r(m["by_pp_rank"][last]),
                      "S_pp": {str(k): _r(v) for k, v in m["by_pp_rank"].items()},
                      "trem": m["ms"]["trem"], "tideal": m["ms"]["tideal"], "tori": m["ms"]["tori"]}})

    corr, n_pairs, cv = microbatch_correlation(p)
    s_comp = max(by_t.get("forward-compute", 1.0), by_t.get("backward-compute", 1.0))
    comp_share = (s_comp - 1.0) / excess
    if np.isfinite(corr) and corr >= SEQ_CORR and comp_share > 0.2:
        out.append({"kind": "sequence_imbalance", "score": _r(min(comp_share, 1.0) * corr), "summary": (
            f"forward and backward times of a microbatch move together (r={corr:.2f}, cv={cv:.2f}): "
            f"uneven sequence lengths; balance tokens per microbatch"),
            "evidence": {"corr_fwd_bwd": _r(corr, 3), "pairs": n_pairs, "cv_fwd": _r(cv, 3),
                      "S_forward": _r(by_t.get("forward-compute")), "S_backward": _r(by_t.get("backward-compute")),
                      "S": _r(S)}})

    s_gc = by_t.get("gc", 1.0)
    gc_share = (s_gc - 1.0) / excess
    if gc_share >= GC_SHARE:
        ev = gc_evidence(p)
        out.append({"kind": "gc", "score": _r(min(gc_share, 1.0)), "summary": (
            f"garbage-collection pauses cause {100 * min(gc_share, 1):.0f}% of the slowdown "
            f"(S_gc={s_gc:.3f}, {ev.get('gc_ops_nonzero', 0)} pauses); synchronise or disable automatic GC"),
            "evidence": dict(ev, S_gc=_r(s_gc), S=_r(S))})

    if by_t:
        top_name, top_v = max(by_t.items(), key=lambda kv: kv[1])
        if top_name in T.COMM_GROUPS and top_v - 1.0 > 0.02:
            share = (top_v - 1.0) / excess
            out.append({"kind": "communication", "score": _r(min(share, 1.0)), "summary": (
                f"{top_name} is the largest slowdown source (S_t={top_v:.3f}, {100 * min(share, 1):.0f}% of "
                f"the slowdown)"),
                "evidence": {"optype": top_name, "S_t": _r(top_v), "S": _r(S),
                          "by_optype": {k: _r(v) for k, v in by_t.items()}}})
    out.sort(key=lambda v: -(v["score"] or 0.0))
    return out
