"""``advise``: from the verdicts of one analysed window to ranked remedies with simulated gains.

Contract: pure (Arrow and numpy in, frozen ``Remedy`` objects out); never
raises for a trace ``analyze`` accepted. One remedy per verdict it can act
on (``worker`` -> swap_host, ``last_stage_imbalance`` -> repartition,
``sequence_imbalance`` -> repack, ``gc`` -> gc_interval), one per link fault
handed in (drain_link, or swap_host for a late sender), and a recovery plan
after node loss. Remedies whose predicted gain is below ``min_gain`` are
dropped (a healthy window gets none), except drains and recovery plans,
which are safety actions whatever they buy. The rest is ranked by predicted
gain, best first (``priority`` 1).

A remedy needing facts the trace lacks (the layer count for a partition,
sequence lengths for an exact packing) is skipped or marked as a bound in
its details; see ``JobFacts``. A remedy whose computation trips on odd input
(a malformed sequence table, say) is skipped; the others still come.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from analyzers.whatif import analyze
from analyzers.whatif.result import WhatIfResult
from core.layout import JobLayout

from analyzers.recovery_basis import RecoveryBasis

from .gc_interval import advise_gc
from .hosts import advise_link, advise_swap
from .model import JobFacts, Remedy
from .packing import advise_repack
from .partition import advise_repartition, estimate_layer_costs, stage_compute
from .recovery import PipelineTemplate, plan_recovery
from .resim import TraceCells, gain

MIN_GAIN = 0.01
_ALWAYS = ("drain_link", "recovery_plan")


def advise(ops: pa.Table | None, layout: JobLayout | JobFacts, result: WhatIfResult | None = None,
           link_faults: Sequence[dict[str, Any] | Any] | None = None, *, min_gain: float = MIN_GAIN) -> list[Remedy]:
    """Ranked remedies for one window. ``result`` must come from ``analyze`` in this process (it carries the
    simulation state); without it the ops are analysed here. ``link_faults``: ``analyzers.links`` faults
    (``LinkFault`` or their dicts)."""
    facts = layout if isinstance(layout, JobFacts) else JobFacts(layout=layout)
    if result is None or result.model is None:
        if ops is None:
            raise ValueError("advise needs the op spans or a WhatIfResult from analyze")
        result = analyze(ops, facts.layout)
    tc = TraceCells(result)
    out: list[Remedy] = []
    kinds = [v["kind"] for v in result.verdicts]

    def add(fn, *args, **kw) -> None:
        # Odd data (a partial sequence table, a fault naming ranks outside the job) costs that remedy only.
        try:
            r = fn(*args, **kw)
        except (ValueError, KeyError, IndexError, TypeError, ZeroDivisionError, FloatingPointError):
            return
        if r is not None:
            out.append(r)

    for v in result.verdicts:
        k = v["kind"]
        if k == "worker":
            top = [(int(c["dp_rank"]), int(c["pp_rank"])) for c in v["evidence"].get("top_workers", [])]
            add(advise_swap, tc, facts, top)
        elif k == "last_stage_imbalance":
            add(advise_repartition, tc, facts)
        elif k == "sequence_imbalance":
            add(advise_repack, tc, facts)
        elif k == "gc":
            add(advise_gc, tc, facts)
    for fault in link_faults or ():
        fd = dataclasses.asdict(fault) if dataclasses.is_dataclass(fault) else dict(fault)
        add(advise_link, tc, facts, fd, verdict="communication" if "communication" in kinds else "link_fault")
    add(advise_recovery, tc, facts, result)
    return rank(_dedupe(out), min_gain)


def _dedupe(rs: list[Remedy]) -> list[Remedy]:
    """One swap per set of hosts (a worker verdict and a late-sender fault can name the same host)."""
    best: dict[Any, Remedy] = {}
    out = []
    for r in rs:
        if r.kind != "swap_host":
            out.append(r)
            continue
        key = tuple(sorted(h["host"] for h in r.details.get("hosts", [])))
        if key not in best or r.predicted_gain > best[key].predicted_gain:
            best[key] = r
    return out + list(best.values())


def rank(rs: list[Remedy], min_gain: float = MIN_GAIN) -> list[Remedy]:
    """Drop small gains (not drains or recovery plans), sort by predicted gain, number from 1."""
    keep = [r for r in rs if r.kind in _ALWAYS or (math.isfinite(r.predicted_gain) and r.predicted_gain >= min_gain)]
    keep.sort(key=lambda r: -r.predicted_gain if not math.isnan(r.predicted_gain) else math.inf)
    return [dataclasses.replace(r, priority=i + 1) for i, r in enumerate(keep)]


def _layer_costs(tc: TraceCells, facts: JobFacts) -> tuple[list[float], str]:
    """Per-layer forward + backward seconds per microbatch for the recovery planner, from the trace."""
    stage_s = stage_compute(tc)
    cur = facts.current_partition
    if cur is not None and tc.layout.pp_size > 1:
        lc = estimate_layer_costs(stage_s, cur)
        if lc is not None:
            t = [lc.layer_s] * int(facts.num_layers)
            t[0] += lc.extra_s[0]
            t[-1] += lc.extra_s[-1]
            return t, "layers"
    if cur is not None:
        w = float(np.nansum(stage_s)) / max(1, int(facts.num_layers))
        return [w] * int(facts.num_layers), "layers"
    # No layer count: the job's own stages are the units (templates then have at most pp stages).
    return [float(x) for x in np.nan_to_num(stage_s)], "stages"


def recovery_basis(tc: TraceCells, facts: JobFacts, step_s: float) -> RecoveryBasis:
    """The basis of a recovery plan from an analysed window (``step_s``: its simulated step time)."""
    layer_s, units = _layer_costs(tc, facts)
    lay = facts.layout
    return RecoveryBasis(dp=lay.dp_size, pp=lay.pp_size, tp=lay.tp_size, cp=lay.cp_size,
                         num_layers=int(facts.num_layers or 0), layer_s=tuple(float(x) for x in layer_s), units=units,
                         stage_s=tuple(float(x) for x in np.nan_to_num(stage_compute(tc))), step_s=float(step_s),
                         microbatches=max(1, tc.n_microbatches()))


def advise_recovery(tc: TraceCells, facts: JobFacts, result: WhatIfResult) -> Remedy | None:
    """A recovery plan when nodes were lost (``JobFacts.nodes_alive`` or workers missing from the trace)."""
    lost_hosts = sorted({facts.host_index(r) for d, x in result.missing_workers for r in facts.worker_ranks(d, x)})
    alive = facts.nodes_alive if facts.nodes_alive is not None else facts.n_nodes - len(lost_hosts)
    if alive >= facts.n_nodes or facts.gpus_per_node % (facts.layout.tp_size * facts.layout.cp_size):
        return None
    return plan_after_loss(recovery_basis(tc, facts, tc.mean_step_time()), facts, alive,
                           [facts.host_name(h) for h in lost_hosts])


def basis_facts(basis: RecoveryBasis, gpus_per_node: int) -> JobFacts:
    """The facts of the job a basis was taken from, on nodes of ``gpus_per_node``."""
    layout = JobLayout(dp_size=basis.dp, pp_size=basis.pp, tp_size=basis.tp, cp_size=basis.cp)
    return JobFacts(layout=layout, num_layers=basis.num_layers or None, gpus_per_node=gpus_per_node)


def plan_after_loss(basis: RecoveryBasis, facts: JobFacts, alive: int, lost_hosts: list[str]) -> Remedy | None:
    """The restart plan on ``alive`` nodes (pipeline templates, stages to nodes, microbatches per pipeline) and
    its step time, against restarting whole copies of today's pipeline; None where the job lost no node or its
    stages span nodes (node-granular templates do not apply)."""
    lay = facts.layout
    n_nodes = facts.n_nodes
    if alive >= n_nodes:
        return None
    gps = lay.tp_size * lay.cp_size
    if facts.gpus_per_node % gps:
        return None  # stages span nodes: node-granular templates do not apply
    spn = facts.gpus_per_node // gps
    layer_s, units = list(basis.layer_s), basis.units
    m = basis.microbatches
    B = facts.global_batch or lay.dp_size * m
    orig_nodes = -(-lay.pp_size // spn)
    n0 = facts.min_nodes_per_pipeline or orig_nodes
    plan = plan_recovery(alive, layer_s, facts.gpus_per_node, facts.fault_tolerance, B, gpus_per_stage=gps,
                         min_nodes=n0)
    # The planner's 1F1B model ignores communication and the optimizer: calibrate it on the trace.
    orig = PipelineTemplate(nodes=orig_nodes, layers=(1,) * lay.pp_size, stage_s=basis.stage_s)
    calib = basis.step_s / orig.step_time(m) if orig.step_time(m) > 0 else 1.0
    replicas = (alive * spn) // lay.pp_size  # the naive restart: whole copies of today's pipeline
    naive = orig.step_time(-(-B // min(replicas, B))) * calib if replicas >= 1 else math.inf
    after = plan.step_time_s * calib
    details = {"plan": plan.to_dict(), "n_nodes": n_nodes, "nodes_alive": alive,
               "lost_hosts": list(lost_hosts), "cost_units": units, "calibration": calib,
               "naive_restart": {"replicas": min(replicas, B), "step_time_s": naive},
               "model": "1F1B step = sum(stage) + (b - 1) max(stage) per pipeline, scaled to the traced step time; "
                        "gain against restarting whole copies of today's pipeline (as partitioned today) on the "
                        "survivors; the plan's templates also balance their layers"}
    if not plan.feasible or naive <= after:
        if math.isfinite(naive):  # whole copies of today's pipeline fit and do at least as well
            why = f"no re-plan: {plan.reason}" if not plan.feasible else "node-sized templates would not be faster"
            k = min(replicas, B)
            action = (f"restart {k} whole {'copy' if k == 1 else 'copies'} of today's pipeline on the {alive} "
                      f"surviving nodes (DP {k}, was {lay.dp_size}); {why}")
            return Remedy(kind="recovery_plan", verdict="node_loss", action=action, predicted_gain=0.0,
                          step_time_before_s=naive, step_time_after_s=naive, details=details)
        return Remedy(kind="recovery_plan", verdict="node_loss", action=f"cannot re-plan: {plan.reason}; wait "
                      f"for replacement nodes", predicted_gain=0.0, step_time_before_s=naive,
                      step_time_after_s=math.inf, details=details)
    groups: dict[int, list[int]] = {}
    for p in plan.pipelines:
        groups.setdefault(p.template_nodes, []).append(p.microbatches)
    shape = " + ".join(f"{len(b)} x {n} node{'s' if n > 1 else ''} ({n * spn} stages, "
                       f"{'/'.join(str(x) for x in b)} microbatches)" for n, b in sorted(groups.items(), reverse=True))
    spare = f"; {len(plan.spare_nodes)} node(s) kept as spares" if plan.spare_nodes else ""
    n_p = len(plan.pipelines)
    action = (f"restart on the {alive} surviving nodes as {n_p} pipeline{'s' if n_p > 1 else ''}: {shape}{spare}; "
              f"tolerates {facts.fault_tolerance} more failure(s)")
    return Remedy(kind="recovery_plan", verdict="node_loss", action=action,
                  predicted_gain=gain(naive, after) if math.isfinite(naive) else math.inf,
                  step_time_before_s=naive, step_time_after_s=after, details=details)


def plan_for_node_loss(basis: RecoveryBasis, rank_hosts: dict[int, str], lost_hosts: list[str]) -> dict | None:
    """The restart plan a node loss is paged with: ``rank_hosts`` is where each rank of the job ran (its
    heartbeats), ``lost_hosts`` the hosts that fell silent; the plan is made from ``basis``, the job's last window
    analysed whole. Plain data for the hang's evidence, the alert and the console; None where no plan applies
    (no node lost, stages that span nodes, ranks on hosts of unequal size)."""
    per_host: dict[str, int] = {}
    for host in rank_hosts.values():
        per_host[host] = per_host.get(host, 0) + 1
    lost = [h for h in lost_hosts if h in per_host]
    if not lost or len(set(per_host.values())) != 1:
        return None
    gpus_per_node = next(iter(per_host.values()))
    facts = basis_facts(basis, gpus_per_node)
    if facts.n_nodes != len(per_host):
        return None  # the ranks heard of are not the job's whole layout: a plan would count nodes wrong
    remedy = plan_after_loss(basis, facts, len(per_host) - len(lost), lost)
    if remedy is None:
        return None
    after = remedy.step_time_after_s
    return {"action": remedy.action, "nodes_alive": len(per_host) - len(lost), "n_nodes": len(per_host),
            "lost_hosts": lost, "step_time_before_loss_s": basis.step_s,
            "step_time_after_s": after if math.isfinite(after) else None,
            "throughput_vs_before": basis.step_s / after if math.isfinite(after) and after > 0 else 0.0,
            "naive_step_time_s": remedy.step_time_before_s if math.isfinite(remedy.step_time_before_s) else None,
            "plan": remedy.details.get("plan")}
