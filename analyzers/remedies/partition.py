"""Last-stage imbalance -> a new layer partition over the pipeline stages.

Why: the last stage of a Megatron pipeline also runs the output layer and the
loss, which weigh far more than one transformer layer (a large vocabulary);
an even split of the transformer layers then leaves the last stage the
slowest, and in 1F1B every stage waits for the slowest one once per
microbatch. The paper gained 9.9% by moving layers off the last stage by hand.

How:
1. ``estimate_layer_costs``: per stage, the compute time of one microbatch
   (forward + backward, median over DP ranks so one slow GPU does not move
   the estimate). One transformer layer costs the median per-layer time of
   the middle stages (stage 0 when there are only two); whatever the first
   and last stage spend beyond their layers is their extra (embedding; output
   layer and loss), a fixed cost that stays with that stage.
2. ``candidate_partitions``: the smallest slowest stage (greedy: each layer
   goes to the stage that stays cheapest, optimal for equal layer costs) and
   a few partitions that reach it (fewest layers moved, spare layers spread,
   packed to the front or to the back).
3. The gain: stage s's forward and backward durations are scaled by its new
   cost over its old and the trace is re-simulated (``resim``), for every
   candidate; the fastest wins (the fewest moves among those within 0.2%).
"""
from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from analyzers.whatif import opcodes as T

from .model import JobFacts, Remedy
from .resim import TraceCells, gain


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """Compute of one microbatch (forward + backward), seconds."""

    layer_s: float  # one transformer layer
    extra_s: tuple[float, ...]  # per stage, beyond its layers (embedding, output layer and loss)
    stage_s: tuple[float, ...]  # per stage as measured

    def stage_cost(self, partition: tuple[int, ...]) -> np.ndarray:
        return np.asarray(partition, np.float64) * self.layer_s + np.asarray(self.extra_s)


def stage_compute(tc: TraceCells) -> np.ndarray:
    """[pp] seconds of forward + backward compute per microbatch, median over DP ranks."""
    lay = tc.layout
    tot = np.zeros((lay.pp_size, lay.dp_size))
    n_f = np.zeros((lay.pp_size, lay.dp_size))
    for c in tc.cells:
        m = c.compute
        np.add.at(tot, (c.pp[m], c.dp[m]), c.dur[m])
        f = c.code == T.F
        np.add.at(n_f, (c.pp[f], c.dp[f]), 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        per = np.where(n_f > 0, tot / np.maximum(n_f, 1), np.nan)
    return np.nanmedian(per, axis=1) / 1e9


def estimate_layer_costs(stage_s: np.ndarray, partition: tuple[int, ...]) -> LayerCosts | None:
    """Per-layer cost and per-stage extras from the measured stage compute and the partition as run."""
    pp = len(partition)
    n = np.asarray(partition, np.float64)
    body = list(range(1, pp - 1)) if pp >= 3 else [0]
    per_layer = [stage_s[s] / n[s] for s in body if n[s] > 0 and np.isfinite(stage_s[s])]
    if pp < 2 or not per_layer:
        return None
    w = float(np.median(per_layer))
    if not (w > 0):
        return None
    extra = np.zeros(pp)
    for s in (0, pp - 1):
        if s not in body and np.isfinite(stage_s[s]):
            extra[s] = max(0.0, float(stage_s[s] - n[s] * w))
    return LayerCosts(layer_s=w, extra_s=tuple(float(x) for x in extra), stage_s=tuple(float(x) for x in stage_s))


def candidate_partitions(n_layers: int, costs: LayerCosts, current: tuple[int, ...] | None = None,
                         min_layers: int = 1) -> list[tuple[int, ...]]:
    """Distinct partitions that all reach the smallest slowest stage, the fewest-moves one first.

    Equal slowest stages do not give equal step times (where the spare
    layers sit changes the 1F1B warm-up and cool-down), so the caller
    simulates each: the fewest moves, the greedy spread, and the spare layers
    packed towards the first or towards the last stages.
    """
    pp = len(costs.extra_s)
    if n_layers < pp * min_layers:
        raise ValueError(f"{n_layers} layers cannot give {pp} stages {min_layers} layer(s) each")
    w, e = costs.layer_s, np.asarray(costs.extra_s)
    n = np.full(pp, min_layers, np.int64)
    heap = [((min_layers + 1) * w + e[s], s) for s in range(pp)]
    heapq.heapify(heap)
    for _ in range(n_layers - pp * min_layers):
        _, s = heapq.heappop(heap)
        n[s] += 1
        heapq.heappush(heap, ((n[s] + 1) * w + e[s], s))
    best = float(np.max(n * w + e))
    cap = np.floor((best - e) / w + 1e-9).astype(np.int64)
    out: list[tuple[int, ...]] = []
    if current is not None and sum(current) == n_layers:
        out.append(_fewest_moves(n_layers, cap, min_layers, current))
    out.append(tuple(int(x) for x in n))
    for order in (range(pp), range(pp - 1, -1, -1)):
        f = np.full(pp, min_layers, np.int64)
        left = n_layers - f.sum()
        for s in order:
            k = min(left, int(cap[s]) - min_layers)
            f[s] += k
            left -= k
        out.append(tuple(int(x) for x in f))
    return list(dict.fromkeys(out))


def _fewest_moves(n_layers: int, cap: np.ndarray, min_layers: int, current: tuple[int, ...]) -> tuple[int, ...]:
    """Counts within [min_layers, cap] adding up to n_layers whose stage boundaries move the least.

    Layers are contiguous per stage, so the layers that change stage are those
    between an old and a new boundary: minimise the sum of |boundary shifts|
    (a small DP over stages and layers assigned so far).
    """
    pp = len(cap)
    old_b = np.cumsum(current)
    inf = np.iinfo(np.int64).max // 4
    cost = np.full(n_layers + 1, inf, np.int64)
    cost[0] = 0
    choice = np.zeros((pp, n_layers + 1), np.int64)
    for s in range(pp):
        nxt = np.full(n_layers + 1, inf, np.int64)
        for k in range(min_layers, int(cap[s]) + 1):
            cand = np.full(n_layers + 1, inf, np.int64)
            cand[k:] = cost[:n_layers + 1 - k]
            better = cand < nxt
            nxt[better], choice[s][better] = cand[better], k
        if s < pp - 1:  # the boundary after stage s
            ok = nxt < inf
            nxt[ok] += np.abs(np.arange(n_layers + 1) - old_b[s])[ok]
        cost = nxt
    out = np.zeros(pp, np.int64)
    x = n_layers
    for s in range(pp - 1, -1, -1):
        out[s] = choice[s][x]
        x -= out[s]
    return tuple(int(v) for v in out)


def layer_moves(old: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """(first layer, last layer, from stage, to stage) runs of layers whose stage changes (contiguous stages)."""
    so = np.repeat(np.arange(len(old)), old)
    sn = np.repeat(np.arange(len(new)), new)
    out: list[tuple[int, int, int, int]] = []
    for i in np.flatnonzero(so != sn).tolist():
        f, t = int(so[i]), int(sn[i])
        if out and out[-1][1] == i - 1 and out[-1][2:] == (f, t):
            out[-1] = (out[-1][0], i, f, t)
        else:
            out.append((i, i, f, t))
    return out


def _describe(old: tuple[int, ...], new: tuple[int, ...]) -> str:
    parts = []
    for a, b, f, t in layer_moves(old, new):
        what = f"layer {a}" if a == b else f"layers {a}-{b}"
        parts.append(f"{what} from stage {f} to stage {t}")
    counts = "/".join(str(x) for x in new)
    return f"move {', '.join(parts)}: stages get {counts} layers (was {'/'.join(str(x) for x in old)})"


def _megatron_args(new: tuple[int, ...]) -> str | None:
    """The Megatron-core flags for an uneven split, when its middle stages are even."""
    mid = new[1:-1]
    if len(new) < 2 or (mid and len(set(mid)) > 1):
        return None
    return f"--decoder-first-pipeline-num-layers {new[0]} --decoder-last-pipeline-num-layers {new[-1]}"


def advise_repartition(tc: TraceCells, facts: JobFacts, verdict: str = "last_stage_imbalance",
                       min_layers: int = 1) -> Remedy | None:
    """A repartition remedy, or None when the layer count is unknown, VPP is on or nothing improves."""
    lay = tc.layout
    cur = facts.current_partition
    if lay.pp_size < 2 or lay.vpp_size > 1 or cur is None or facts.num_layers is None:
        return None
    if facts.num_layers < lay.pp_size * min_layers:
        return None
    stage_s = stage_compute(tc)
    costs = estimate_layer_costs(stage_s, cur)
    if costs is None:
        return None
    old_cost = costs.stage_cost(cur)
    before = tc.mean_step_time()
    tried = []
    for cand in candidate_partitions(facts.num_layers, costs, cur, min_layers):
        new_cost = costs.stage_cost(cand)
        if cand == cur or new_cost.max() >= old_cost.max() * (1 - 1e-9):
            continue
        ratio = np.where(old_cost > 0, new_cost / np.where(old_cost > 0, old_cost, 1.0), 1.0)
        after = tc.mean_step_time(lambda c, r=ratio: np.where(c.compute, c.dur * r[c.pp], c.dur))
        moved = sum(b - a + 1 for a, b, _, _ in layer_moves(cur, cand))
        tried.append((after, moved, cand, new_cost))
    if not tried:
        return None
    # The fastest; within 0.2% of it, the one that moves the fewest layers.
    fastest = min(t[0] for t in tried)
    after, _, new, new_cost = min((t for t in tried if t[0] <= fastest * 1.002), key=lambda t: (t[1], t[0]))
    first = np.concatenate([[0], np.cumsum(new)[:-1]])
    details = {
        "num_layers": facts.num_layers, "partition_before": list(cur), "partition_after": list(new),
        "layer_ranges_after": [[int(a), int(a + k - 1)] if k else [] for a, k in zip(first, new)],
        "moves": [{"first_layer": a, "last_layer": b, "from_stage": f, "to_stage": t}
                  for a, b, f, t in layer_moves(cur, new)],
        "layer_ms": costs.layer_s * 1e3, "stage_extra_ms": [x * 1e3 for x in costs.extra_s],
        "stage_ms_before": (old_cost * 1e3).tolist(), "stage_ms_after": (new_cost * 1e3).tolist(),
        "slowest_stage_ms_before": float(old_cost.max() * 1e3), "slowest_stage_ms_after": float(new_cost.max() * 1e3),
        "megatron_args": _megatron_args(new),
        "candidates": [{"partition": list(t[2]), "step_time_s": t[0], "layers_moved": t[1]} for t in tried],
        "model": "stage compute per microbatch = layers x layer cost + stage extra; forward and backward "
                 "durations of each stage scaled by new/old cost and re-simulated",
    }
    return Remedy(kind="repartition", verdict=verdict, action=_describe(cur, new), predicted_gain=gain(before, after),
                  step_time_before_s=before, step_time_after_s=after, details=details)
