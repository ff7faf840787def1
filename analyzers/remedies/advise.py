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


def plan_after_loss(basis: RecoveryBasis, facts: JobFacts, alive: int, lost_hosts: list[str],
                    alive_hosts: Sequence[str] | None = None) -> Remedy | None:
    """The restart plan on ``alive`` nodes (pipeline templates, stages to nodes, microbatches per pipeline) and
    its step time, against restarting whole copies of today's pipeline; None where the job lost no node or its
    stages span nodes (node-granular templates do not apply). ``alive_hosts``: the surviving nodes' names, in
    the order the plan fills them (default ``node i``); ``details["assignment"]`` places every stage of every
    pipeline on one of them, whether the plan re-plans or restarts whole copies."""
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
    names = list(alive_hosts) if alive_hosts is not None else [f"node {i}" for i in range(alive)]
    nodes = f"{alive} surviving node{'s' if alive != 1 else ''}"
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
            split = [B // k + (1 if i < B % k else 0) for i in range(k)]
            today = facts.current_partition if units == "layers" and facts.current_partition else (1,) * lay.pp_size
            details["assignment"] = _assignment([(i * lay.pp_size, today, b) for i, b in enumerate(split)], spn, gps,
                                                names)
            action = (f"restart {k} whole {'copy' if k == 1 else 'copies'} of today's pipeline on the {nodes} "
                      f"(DP {k}, was {lay.dp_size}): {_placed(details['assignment'], units)}; {why}")
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
    by_nodes = {t.nodes: t for t in plan.templates}
    details["assignment"] = _assignment([(p.nodes[0] * spn, by_nodes[p.template_nodes].layers, p.microbatches)
                                         for p in plan.pipelines], spn, gps, names)
    action = (f"restart on the {nodes} as {n_p} pipeline{'s' if n_p > 1 else ''}: {shape}{spare}; "
              f"tolerates {facts.fault_tolerance} more failure(s); {_placed(details['assignment'], units)}")
    return Remedy(kind="recovery_plan", verdict="node_loss", action=action,
                  predicted_gain=gain(naive, after) if math.isfinite(naive) else math.inf,
                  step_time_before_s=naive, step_time_after_s=after, details=details)


def _assignment(pipelines: Sequence[tuple[int, Sequence[int], int]], spn: int, gps: int,
                names: Sequence[str]) -> list[dict[str, Any]]:
    """Where each stage of each pipeline runs: ``pipelines`` are (first stage slot, units per stage, microbatches),
    a node holding ``spn`` stage slots of ``gps`` GPUs each, filled in the order of ``names``. Per pipeline its
    microbatches and per stage its node, the node's first GPU (local index) and the units it holds."""
    out = []
    for i, (slot, units, b) in enumerate(pipelines):
        stages, first = [], 0
        for j, n in enumerate(units):
            node = (slot + j) // spn
            stages.append({"stage": j, "host": names[node] if node < len(names) else f"node {node}",
                           "gpu": ((slot + j) % spn) * gps, "units": [first, first + int(n) - 1]})
            first += int(n)
        out.append({"pipeline": i, "microbatches": int(b), "stages": stages})
    return out


def _placed(assignment: list[dict[str, Any]], units: str, most: int = 2) -> str:
    """'stages 0-1 on h0 (8 microbatches)' per pipeline, the first ``most`` of them; the rest counted."""
    def one(p: dict[str, Any]) -> str:
        hosts = list(dict.fromkeys(s["host"] for s in p["stages"]))
        n = len(p["stages"])
        where = hosts[0] if len(hosts) == 1 else (f"{hosts[0]}..{hosts[-1]}" if len(hosts) > 2 else " and ".join(hosts))
        layers = ""
        if units == "layers":
            layers = ", layers " + "/".join(str(s["units"][1] - s["units"][0] + 1) for s in p["stages"])
        return f"{'stage 0' if n == 1 else f'stages 0-{n - 1}'} on {where} ({p['microbatches']} microbatches{layers})"
    shown = "; ".join(f"pipeline {p['pipeline']}: {one(p)}" for p in assignment[:most])
    rest = len(assignment) - most
    return shown + (f"; {rest} more pipeline{'s' if rest > 1 else ''} alike" if rest > 0 else "")


def node_loss_plan(basis: RecoveryBasis, rank_hosts: dict[int, str],
                   lost_hosts: list[str]) -> tuple[dict[str, Any] | None, str]:
    """The restart plan a node loss is paged with, and '' ; or None and why there is none. ``rank_hosts`` is
    where each rank of the job ran (its heartbeats), ``lost_hosts`` the hosts that fell silent; the plan is made
    from ``basis``, the job's last window analysed whole. Plain data for the hang's evidence, the alert and the
    console: the action in words, the stage-to-host assignment and microbatches of each pipeline on the
    surviving hosts (in the order of the lowest rank each held, as torchrun numbers nodes), the predicted step
    time and the share of the throughput before."""
    per_host: dict[str, int] = {}
    first_rank: dict[str, int] = {}
    for rank, host in sorted(rank_hosts.items()):
        per_host[host] = per_host.get(host, 0) + 1
        first_rank.setdefault(host, rank)
    lost = [h for h in lost_hosts if h in per_host]
    if not lost:
        return None, "no host of the job was lost"
    if len(set(per_host.values())) != 1:
        sizes = ", ".join(f"{h}: {n}" for h, n in sorted(per_host.items()))
        return None, f"the job's hosts ran unequal numbers of ranks ({sizes}): node-sized templates do not apply"
    gpus_per_node = next(iter(per_host.values()))
    facts = basis_facts(basis, gpus_per_node)
    if facts.n_nodes != len(per_host):
        # The ranks heard of are not the job's whole layout: a plan would count nodes wrong.
        return None, (f"{len(rank_hosts)} ranks were heard of on {len(per_host)} host(s), the layout has "
                      f"{basis.dp * basis.pp * basis.tp * basis.cp}")
    alive = [h for h in sorted(per_host, key=first_rank.get) if h not in lost]
    remedy = plan_after_loss(basis, facts, len(alive), lost, alive)
    if remedy is None:
        return None, (f"a stage of {basis.tp * basis.cp} GPUs does not fit hosts of {gpus_per_node}: node-sized "
                      f"templates do not apply")
    after = remedy.step_time_after_s
    return {"action": remedy.action, "nodes_alive": len(alive), "n_nodes": len(per_host),
            "lost_hosts": lost, "step_time_before_loss_s": basis.step_s,
            "step_time_after_s": after if math.isfinite(after) else None,
            "throughput_vs_before": basis.step_s / after if math.isfinite(after) and after > 0 else 0.0,
            "naive_step_time_s": remedy.step_time_before_s if math.isfinite(remedy.step_time_before_s) else None,
            "assignment": remedy.details.get("assignment", []), "units": basis.units,
            "plan": remedy.details.get("plan")}, ""


def plan_for_node_loss(basis: RecoveryBasis, rank_hosts: dict[int, str], lost_hosts: list[str]) -> dict | None:
    """``node_loss_plan``'s plan, or None."""
    return node_loss_plan(basis, rank_hosts, lost_hosts)[0]


def plan_for_process_loss(basis: RecoveryBasis, rank_hosts: dict[int, str], lost_ranks: list[int],
                          hosts: list[str]) -> dict[str, Any]:
    """The plan a process loss is paged with (ranks gone while their hosts still run others): no node was lost,
    so the job restarts in place on all its nodes at the step time it had; should a host of the lost ranks have
    to be drained (a GPU that failed, an Xid), ``if_drained`` is the node-loss plan without it, or
    ``if_drained_missing`` says why there is none."""
    from core.layout import fold_ranks

    n = len(set(rank_hosts.values()))
    drained, why = node_loss_plan(basis, rank_hosts, hosts)
    some = "s" if len(lost_ranks) > 1 else ""
    on = ", ".join(hosts)
    out = {"action": (f"restart in place on the {n} node{'s' if n != 1 else ''} (rank{some} {fold_ranks(lost_ranks)} "
                      f"lost {'their processes' if some else 'its process'}, {on} still "
                      f"report{'' if len(hosts) > 1 else 's'})"),
           "in_place": True, "nodes_alive": n, "n_nodes": n, "lost_hosts": [], "drain_hosts": list(hosts),
           "step_time_before_loss_s": basis.step_s, "step_time_after_s": basis.step_s, "throughput_vs_before": 1.0}
    if drained is not None:
        out["if_drained"] = drained
    else:
        out["if_drained_missing"] = why
    return out
