"""Recovery plans after node loss, after Oobleck (Jang et al., SOSP 2023): templates, instantiation, batch split.

Why: when nodes die, restarting the same layout on fewer whole replicas
wastes the nodes that no longer make a full replica, and waiting for
replacements wastes everything. Oobleck instead keeps a set of *pipeline
templates* (one per node count) and re-instantiates the job from whatever
nodes are left, as several pipelines of possibly different sizes that share
the global batch.

How (pure arithmetic on a per-layer cost model):
1. Templates. A pipeline on n nodes has ``n * stages_per_node`` stages; its
   layers are split into contiguous stages minimising the slowest stage
   under the per-GPU memory limit (exact: binary search on the bound, greedy
   check). ``n0`` is the smallest n that fits the model. Templates exist for
   every n from n0 to ``N - f * n0`` (capped where stages would outnumber
   layers): consecutive sizes, so any node count from ``(f + 1) * n0`` on can
   be used by f + 1 or more pipelines, and f more failures still leave a
   whole replica.
2. Instantiation. A pipeline with b microbatches takes
   ``sum(stage) + (b - 1) * max(stage)`` (1F1B). For a candidate step time
   tau each template can take a number of microbatches; a knapsack over nodes
   finds the fewest nodes whose pipelines (at least f + 1) take the whole
   global batch, and a binary search finds the smallest tau for which that is
   possible: the instantiation of highest throughput. Nodes left over are
   spares.
3. Batch distribution. Microbatches go one at a time to the pipeline whose
   step time grows least, which minimises the largest step time: the
   heterogeneous pipelines finish together to within one microbatch.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class PipelineTemplate:
    """A pipeline on ``nodes`` nodes: its stages, their layers and their time per microbatch."""

    nodes: int
    layers: tuple[int, ...]  # layers per stage, contiguous from layer 0
    stage_s: tuple[float, ...]  # forward + backward of one microbatch per stage, seconds
    stage_mem: tuple[float, ...] | None = None  # bytes per stage GPU, when a memory model was given

    @property
    def stages(self) -> int:
        return len(self.layers)

    def step_time(self, microbatches: int) -> float:
        """1F1B: fill and drain once, then one slowest stage per further microbatch."""
        if microbatches <= 0:
            return 0.0
        return float(sum(self.stage_s) + (microbatches - 1) * max(self.stage_s))

    def capacity(self, tau: float) -> int:
        """The most microbatches whose step time stays within ``tau``."""
        fill, slow = sum(self.stage_s), max(self.stage_s)
        if tau < fill * (1 - 1e-12):
            return 0
        return int(math.floor((tau - fill) / slow * (1 + 1e-12) + 1e-9)) + 1 if slow > 0 else 1 << 30


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    template_nodes: int
    nodes: tuple[int, ...]  # indices into the surviving nodes
    microbatches: int
    step_time_s: float


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
    feasible: bool
    reason: str
    n_nodes_alive: int
    f: int
    min_nodes: int  # n0: the smallest pipeline that holds the model
    covers_from: int  # (f + 1) * n0: every node count from here on can be used
    templates: tuple[PipelineTemplate, ...]
    pipelines: tuple[PipelinePlan, ...]
    spare_nodes: tuple[int, ...]
    global_batch: int  # microbatches per step
    step_time_s: float
    throughput: float  # microbatches per second

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("step_time_s", "throughput"):
            if not math.isfinite(d[k]):
                d[k] = None
        return d


def partition_layers(layer_s: Sequence[float], stages: int, *, layer_mem: Sequence[float] | None = None,
                     mem_cap: float | None = None) -> tuple[int, ...] | None:
    """Contiguous split of the layers into ``stages`` non-empty stages minimising the slowest stage.

    None when it cannot be done (fewer layers than stages, or a stage over
    ``mem_cap`` whatever the split). Exact: the bound is binary-searched over
    every contiguous sum, each checked greedily.
    """
    t = np.asarray(layer_s, np.float64)
    L = len(t)
    if stages < 1 or L < stages:
        return None
    mem = np.zeros(L) if layer_mem is None else np.asarray(layer_mem, np.float64)
    cap = math.inf if mem_cap is None else float(mem_cap)
    if mem.max(initial=0.0) > cap:
        return None
    pre = np.concatenate([[0.0], np.cumsum(t)])
    # Every contiguous sum is a candidate bound; none below the heaviest layer (prefix differences round,
    # so that layer itself is added exactly).
    cands = (pre[None, :] - pre[:, None])[np.triu_indices(L + 1, 1)]
    cands = np.unique(np.append(cands[cands > t.max()], t.max()))

    def greedy(tau: float) -> list[int] | None:
        out, cur_t, cur_m, k = [], 0.0, 0.0, 0
        for i in range(L):
            if k and (cur_t + t[i] > tau * (1 + 1e-12) or cur_m + mem[i] > cap):
                out.append(k)
                cur_t, cur_m, k = 0.0, 0.0, 0
            cur_t += t[i]
            cur_m += mem[i]
            k += 1
        out.append(k)
        return out if len(out) <= stages else None

    lo, hi = 0, len(cands) - 1
    if greedy(cands[hi]) is None:
        return None  # memory: even the loosest time bound needs more stages
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(cands[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    parts = greedy(cands[lo])
    # Fewer stages than asked: split the slowest multi-layer stage at its balance point (never worse).
    while len(parts) < stages:
        starts = np.concatenate([[0], np.cumsum(parts)[:-1]])
        times = [pre[a + k] - pre[a] if k > 1 else -1.0 for a, k in zip(starts, parts)]
        j = int(np.argmax(times))
        a, k = int(starts[j]), parts[j]
        cut = min(range(1, k), key=lambda c: max(pre[a + c] - pre[a], pre[a + k] - pre[a + c]))
        parts[j:j + 1] = [cut, k - cut]
    return tuple(int(x) for x in parts)


def make_template(layer_s: Sequence[float], nodes: int, stages_per_node: int, *,
                  layer_mem: Sequence[float] | None = None, mem_cap: float | None = None) -> PipelineTemplate | None:
    parts = partition_layers(layer_s, nodes * stages_per_node, layer_mem=layer_mem, mem_cap=mem_cap)
    if parts is None:
        return None
    t = np.asarray(layer_s, np.float64)
    bounds = np.concatenate([[0], np.cumsum(parts)])
    stage_s = tuple(float(t[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:]))
    stage_mem = None
    if layer_mem is not None:
        m = np.asarray(layer_mem, np.float64)
        stage_mem = tuple(float(m[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:]))
    return PipelineTemplate(nodes=nodes, layers=parts, stage_s=stage_s, stage_mem=stage_mem)


def _min_nodes_for(tpls: dict[int, PipelineTemplate], B: int, f: int, tau: float,
                   n_max_nodes: int) -> tuple[int, list[int]] | None:
    """Fewest nodes (<= n_max_nodes) whose pipelines, at least f + 1, take B microbatches within tau.

    Knapsack over nodes used: best[u, k] = most microbatches with exactly u
    nodes in k pipelines (k capped at f + 1). Returns (nodes, template sizes).
    """
    sizes = np.array(sorted(tpls), np.int64)
    cap = np.array([min(tpls[n].capacity(tau), B) for n in sizes], np.int64)
    use = cap > 0
    sizes, cap = sizes[use], cap[use]
    if len(sizes) == 0:
        return None
    F = f + 1
    neg = -(1 << 40)
    best = np.full((n_max_nodes + 1, F + 1), neg, np.int64)
    best[0, 0] = 0
    came = np.full((n_max_nodes + 1, F + 1, 2), -1, np.int64)  # (template index, previous k)
    ks = np.arange(F + 1)
    nk = np.minimum(ks + 1, F)
    for u in range(1, n_max_nodes + 1):
        ok = sizes <= u
        if not ok.any():
            continue
        prev = best[u - sizes[ok]]  # [K', F + 1] by previous k
        val = np.where(prev > neg, prev + cap[ok][:, None], neg)
        for k_prev in range(F + 1):
            col = val[:, k_prev]
            i = int(np.argmax(col))
            if col[i] > best[u, nk[k_prev]]:
                best[u, nk[k_prev]] = col[i]
                came[u, nk[k_prev]] = (np.flatnonzero(ok)[i], k_prev)
        if best[u, F] >= B:
            chosen, uu, k = [], u, F
            while uu > 0:
                i, kp = came[uu, k]
                chosen.append(int(sizes[i]))
                uu, k = uu - int(sizes[i]), int(kp)
            return u, chosen
    return None


def distribute_batch(templates: Sequence[PipelineTemplate], B: int) -> list[int]:
    """Microbatches per pipeline (each at least 1) minimising the largest step time."""
    n = len(templates)
    if B < n:
        raise ValueError(f"{B} microbatches cannot feed {n} pipelines")
    b = [1] * n
    heap = [(t.step_time(2), i) for i, t in enumerate(templates)]
    heapq.heapify(heap)
    for _ in range(B - n):
        _, i = heapq.heappop(heap)
        b[i] += 1
        heapq.heappush(heap, (templates[i].step_time(b[i] + 1), i))
    return b


def plan_recovery(n_nodes_alive: int, layer_s: Sequence[float], gpus_per_node: int, f: int, global_batch: int, *,
                  gpus_per_stage: int = 1, layer_mem: Sequence[float] | None = None, gpu_mem: float | None = None,
                  min_nodes: int | None = None) -> RecoveryPlan:
    """The highest-throughput way to run the model on the surviving nodes, tolerating f more failures.

    ``layer_s``: forward + backward time of one microbatch per layer (embedding
    and loss folded into the first and last layer, or given as layers of
    their own). ``global_batch``: microbatches per step over all pipelines.
    ``layer_mem`` and ``gpu_mem`` (bytes) decide the smallest pipeline that
    fits; ``min_nodes`` sets it directly (the larger of the two wins).
    """
    if gpus_per_node < 1 or gpus_per_stage < 1 or gpus_per_node % gpus_per_stage:
        raise ValueError(f"a node of {gpus_per_node} GPUs must hold whole stages of {gpus_per_stage} GPUs")
    if f < 0 or global_batch < 1 or n_nodes_alive < 0 or len(layer_s) == 0:
        raise ValueError("need f >= 0, global_batch >= 1, n_nodes_alive >= 0 and at least one layer")
    spn = gpus_per_node // gpus_per_stage
    L = len(layer_s)
    mem_cap = gpu_mem * gpus_per_stage if gpu_mem is not None else None
    lmem = layer_mem if gpu_mem is not None else None

    def infeasible(reason: str, n0: int, templates: tuple = ()) -> RecoveryPlan:
        return RecoveryPlan(False, reason, n_nodes_alive, f, n0, (f + 1) * n0, templates, (),
                            tuple(range(n_nodes_alive)), global_batch, math.inf, 0.0)

    max_by_layers = L // spn
    n0 = None
    for n in range(max(1, min_nodes or 1), max_by_layers + 1):
        if make_template(layer_s, n, spn, layer_mem=lmem, mem_cap=mem_cap) is not None:
            n0 = n
            break
    if n0 is None:
        if max_by_layers < max(1, min_nodes or 1):
            return infeasible(f"{L} layers cannot fill {max(1, min_nodes or 1)} node(s) of {spn} one-layer-or-more "
                              f"stages", 0)
        return infeasible(f"no pipeline of {max(1, min_nodes or 1)} to {max_by_layers} nodes ({spn} stages each) "
                          f"fits the model in memory", 0)
    if n_nodes_alive < (f + 1) * n0:
        return infeasible(f"{n_nodes_alive} nodes cannot hold f + 1 = {f + 1} pipelines of at least {n0} nodes", n0)
    if global_batch < f + 1:
        return infeasible(f"a global batch of {global_batch} microbatches cannot feed f + 1 = {f + 1} pipelines", n0)
    n_max = min(n_nodes_alive - f * n0, max_by_layers)
    tpls = {}
    for n in range(n0, n_max + 1):
        t = make_template(layer_s, n, spn, layer_mem=lmem, mem_cap=mem_cap)
        if t is not None:
            tpls[n] = t
    templates = tuple(tpls[n] for n in sorted(tpls))

    taus = np.unique(np.concatenate([[t.step_time(b) for b in range(1, global_batch + 1)] for t in templates]))
    lo, hi = 0, len(taus) - 1
    if _min_nodes_for(tpls, global_batch, f, float(taus[hi]), n_nodes_alive) is None:
        return infeasible("no instantiation takes the global batch", n0, templates)
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_nodes_for(tpls, global_batch, f, float(taus[mid]), n_nodes_alive) is None:
            lo = mid + 1
        else:
            hi = mid
    _, sizes = _min_nodes_for(tpls, global_batch, f, float(taus[lo]), n_nodes_alive)
    sizes.sort(reverse=True)
    chosen = [tpls[n] for n in sizes]
    b = distribute_batch(chosen, global_batch)
    pipes, nxt = [], 0
    for t, bi in zip(chosen, b):
        pipes.append(PipelinePlan(t.nodes, tuple(range(nxt, nxt + t.nodes)), bi, t.step_time(bi)))
        nxt += t.nodes
    step = max(p.step_time_s for p in pipes)
    return RecoveryPlan(True, "", n_nodes_alive, f, n0, (f + 1) * n0, templates, tuple(pipes),
                        tuple(range(nxt, n_nodes_alive)), global_batch, step, global_batch / step)


def uniform_restart(n_nodes_alive: int, template: PipelineTemplate, global_batch: int) -> float:
    """Step time of the naive restart: as many whole copies of ``template`` as fit, the batch split evenly.

    ``inf`` when not even one copy fits.
    """
    k = min(n_nodes_alive // template.nodes, global_batch)
    if k < 1:
        return math.inf
    return template.step_time(-(-global_batch // k))
