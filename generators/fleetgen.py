"""Synthetic fleet: Megatron-like hybrid-parallel jobs with injected straggler causes.

Used by the demo, tests and benchmarks. Deterministic by seed. Each job is a
1F1B pipeline (PP) replicated over DP ranks (TP/CP folded into the worker),
or with ``layout.vpp_size`` > 1 Megatron's interleaved 1F1B over that many
model chunks per stage; one window is a profiling session of consecutive steps. Start times come from
an event schedule that follows the same rules a real job obeys (a compute op
waits for its recv and for the previous compute op; a transfer ends when both
peers are in it and the bytes have moved; collectives end when the last member
arrives plus the transfer time), so the what-if simulator can re-simulate it.

Ground truth (`JobSpec.cause`, `cause_dp`, `cause_pp`, `cause_factor`) is kept
beside the trace so tests can score the diagnosis.

Remedy knobs (``analyzers.remedies`` tests apply an advised fix and re-measure):
``stage_layers`` (a layer partition; the heavy last stage is then the loss
layer's extra cost on top of its layers), ``seqs_per_microbatch`` and
``packing`` (microbatches made of sequences whose attention cost is the sum
of squared lengths, as drawn or re-packed), ``gc_interval`` (planned GC on
every worker every N steps instead of automatic pauses), ``nic_worker`` (a
slow NIC stretching its stage's DP collectives) and ``swapped_workers``
(workers moved to healthy spare hosts). Every knob defaults to off, and a
fixed spec draws the same random numbers as the original, so the fixed and
the original job differ only by the fix.
"""
from __future__ import annotations

import collections
import dataclasses
import zlib
from typing import Iterator

import numpy as np
import pyarrow as pa

from core import codec
from core.layout import JobLayout
from core.schema import JOB, OP_SPAN

CAUSES = ("none", "slow_worker", "heavy_last_stage", "seq_imbalance", "gc")
PACKINGS = ("none", "attention")
SEQ_TOKENS = 4096
"""Median sequence length (tokens) of the sequence model; lengths are clipped to [16, SEQ_CONTEXT]."""
SEQ_CONTEXT = 32768
_NS = 1_000_000_000
_GAP_NS = 20_000  # launch gap between dependent ops (CPU work the trace does not see)


SEQ_LEN = 4096
PASSES = ("forward", "backward")
NOMINAL_MFU = 0.45  # MFU of a healthy generated job's nominal step (registration FLOPs are derived from it)


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One synthetic job and its injected cause (the ground truth)."""

    job_id: str
    layout: JobLayout
    num_microbatches: int
    team: str = "demo"
    model: str = "gpt-demo"
    fwd_ms: float = 20.0
    bwd_ms: float = 40.0
    p2p_ms: float = 1.0
    dp_comm_ms: float = 8.0
    optimizer_ms: float = 5.0
    noise: float = 0.02
    cause: str = "none"
    cause_dp: int = -1
    cause_pp: int = -1
    cause_factor: float = 1.0
    attempt: int = 0
    seed: int = 0
    stage_layers: tuple[int, ...] | None = None
    """Transformer layers per stage; None: an even split (the legacy per-stage scale)."""
    seqs_per_microbatch: int = 0
    """0: one cost draw per microbatch (legacy); k: k sequences per microbatch, cost = sum of squared lengths."""
    packing: str = "none"
    """With sequences: ``none`` (as drawn) or ``attention`` (greedy balance of sum of squared lengths)."""
    gc_interval: int = 0
    """With cause ``gc``: 0 = automatic pauses at random workers; N = every worker collects every N steps."""
    nic_worker: tuple[int, int] | None = None
    """(dp, pp) of a worker whose slow NIC stretches its stage's DP collectives by ``nic_factor``."""
    nic_factor: float = 1.0
    swapped_workers: tuple[tuple[int, int], ...] = ()
    """(dp, pp) workers moved to spare hosts: the slow worker or NIC injected there no longer applies."""

    def __post_init__(self) -> None:
        pp = self.layout.pp_size
        if self.layout.vpp_size > 1 and (pp < 2 or self.num_microbatches % pp):
            raise ValueError(f"interleaved 1F1B (vpp_size {self.layout.vpp_size}) needs pp_size >= 2 and "
                             f"num_microbatches a multiple of pp_size, got pp {pp}, m {self.num_microbatches}")
        if self.stage_layers is not None and (len(self.stage_layers) != pp or min(self.stage_layers) < 0
                                              or sum(self.stage_layers) < 1):
            raise ValueError(f"stage_layers needs {pp} non-negative counts, got {self.stage_layers!r}")
        if self.packing not in PACKINGS:
            raise ValueError(f"unknown packing {self.packing!r} (known: {', '.join(PACKINGS)})")
        if self.seqs_per_microbatch < 0 or self.gc_interval < 0:
            raise ValueError("seqs_per_microbatch and gc_interval must be >= 0")

    @property
    def n_gpus(self) -> int:
        return self.layout.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.layout.dp_size * self.num_microbatches * SEQ_LEN  # one sequence per microbatch

    @property
    def params(self) -> int:
        """A model size that makes the healthy job run at NOMINAL_MFU (6 x params FLOPs per token)."""
        lay = self.layout
        bubble = (lay.pp_size - 1) / lay.vpp_size  # interleaving shrinks the pipeline bubble by vpp
        step_s = ((self.num_microbatches + bubble) * (self.fwd_ms + self.bwd_ms) + self.optimizer_ms) / 1e3
        return int(NOMINAL_MFU * step_s * self.n_gpus * 989e12 / (6 * self.tokens_per_step))

    def registration(self, ts_ns: int, profiled_steps: int) -> pa.Table:
        lay = self.layout
        return codec.from_rows(
            JOB,
            [
                dict(
                    job_id=self.job_id, attempt=self.attempt, ts_ns=ts_ns, team=self.team, model=self.model,
                    n_gpus=self.n_gpus, dp_size=lay.dp_size, pp_size=lay.pp_size, tp_size=lay.tp_size,
                    cp_size=lay.cp_size, vpp_size=lay.vpp_size, num_microbatches=self.num_microbatches,
                    profiled_steps=profiled_steps, gpu_type="H100", peak_flops=989e12,
                    flops_per_token=0.0, tokens_per_step=self.tokens_per_step, params=self.params,
                    seq_len=SEQ_LEN, num_layers=sum(self.stage_layers) if self.stage_layers else 8 * lay.pp_size,
                )
            ],
        )


def _stage_order(s: int, pp: int, m: int, vpp: int = 1) -> list[tuple[str, int, int]]:
    """Compute ops of stage s in launch order, as (kind, microbatch, model chunk): warm-up forwards,
    steady 1F1B, cool-down backwards.

    With ``vpp`` > 1 this is Megatron's interleaved schedule: the m x vpp virtual
    microbatches go in groups of ``pp`` microbatches per chunk, forward through
    chunks 0..vpp-1 and backward through vpp-1..0, with a longer warm-up.
    """
    if vpp == 1:
        fwd = bwd = [(i, 0) for i in range(m)]
        warm = min(pp - s - 1, m)
    else:
        def unit(k: int, forward: bool) -> tuple[int, int]:
            group, within = divmod(k, pp * vpp)
            chunk = within // pp
            return group * pp + within % pp, (chunk if forward else vpp - 1 - chunk)

        total = m * vpp
        fwd = [unit(k, True) for k in range(total)]
        bwd = [unit(k, False) for k in range(total)]
        warm = total if m == pp else min((pp - s - 1) * 2 + (vpp - 1) * pp, total)
    n = len(fwd)
    order = [("F", *fwd[i]) for i in range(warm)]
    for i in range(n - warm):
        order += [("F", *fwd[warm + i]), ("B", *bwd[i])]
    order += [("B", *bwd[i]) for i in range(n - warm, n)]
    return order


class _Ops:
    """Accumulates op records, each a vector over DP ranks."""

    def __init__(self, dp: int):
        self.dp = dp
        self.cols: dict[str, list[np.ndarray]] = {k: [] for k in
                                                  ("dp_rank", "pp_rank", "step", "optype", "start", "dur",
                                                   "seq", "mc", "gmc", "mb")}
        self.optypes: list[str] = []
        self._dp_idx = np.arange(dp, dtype=np.int32)

    def add(self, pp_rank: int, step: int, optype: str, start: np.ndarray, end: np.ndarray,
            seq: int, mc: int = -1, gmc: int = -1, mb: int = -1, dp_idx: np.ndarray | None = None) -> None:
        idx = self._dp_idx if dp_idx is None else dp_idx
        n = len(idx)
        c = self.cols
        c["dp_rank"].append(idx)
        c["pp_rank"].append(np.full(n, pp_rank, np.int32))
        c["step"].append(np.full(n, step, np.int64))
        c["optype"].append(np.full(n, len(self.optypes), np.int32))
        self.optypes.append(optype)
        c["start"].append(np.broadcast_to(start, (self.dp,))[idx].astype(np.int64))
        c["dur"].append((np.broadcast_to(end, (self.dp,))[idx] - np.broadcast_to(start, (self.dp,))[idx]).astype(np.int64))
        c["seq"].append(np.full(n, seq, np.int32))
        c["mc"].append(np.full(n, mc, np.int16))
        c["gmc"].append(np.full(n, gmc, np.int16))
        c["mb"].append(np.full(n, mb, np.int32))


def generate_window(spec: JobSpec, window_id: int, n_steps: int, t0_ns: int) -> pa.Table:
    """Op spans (OP_SPAN) of ``n_steps`` steps starting at step ``window_id``."""
    lay = spec.layout
    dp, pp, m, vpp = lay.dp_size, lay.pp_size, spec.num_microbatches, lay.vpp_size
    n_chunks = pp * vpp  # global model chunks; chunk c of stage s is global chunk c * pp + s
    rng = np.random.default_rng([spec.seed, zlib.crc32(spec.job_id.encode()), window_id])
    ops = _Ops(dp)
    has_dp = dp * lay.cp_size > 1
    ms = 1_000_000

    # Per-worker compute scale from the injected cause.
    scale = np.ones((pp, dp))
    swapped = set(spec.swapped_workers)
    if spec.cause == "slow_worker" and (spec.cause_dp, spec.cause_pp) not in swapped:
        scale[spec.cause_pp, spec.cause_dp] *= spec.cause_factor
    elif spec.cause == "heavy_last_stage" and spec.stage_layers is None:
        scale[pp - 1, :] *= spec.cause_factor
    if spec.stage_layers is not None:
        scale *= _stage_scale(spec)[:, None]
    # A slow NIC stretches the transfers of every DP collective its stage runs (the ring waits for it).
    nic = np.ones(pp)
    if spec.nic_worker is not None and tuple(spec.nic_worker) not in swapped:
        nic[spec.nic_worker[1]] = spec.nic_factor

    step_start = t0_ns
    for k in range(n_steps):
        step = window_id + k
        # Sequence lengths: both passes of a microbatch scale with its attention cost.
        if spec.seqs_per_microbatch > 0:
            seqlen = _microbatch_cost(spec, step)
        elif spec.cause == "seq_imbalance":
            seqlen = rng.lognormal(0.0, np.log(spec.cause_factor), size=(dp, m))
            seqlen /= seqlen.mean()
        else:
            seqlen = np.ones((dp, m))
        c_free = np.zeros((pp, dp), np.int64)  # compute stream free at
        # params-all-gather per stage and model chunk: a DP collective, chunk after chunk.
        ag_end = np.full((pp, vpp), step_start, np.int64)
        for s in range(pp):
            if has_dp:
                st = step_start + rng.integers(0, 200_000, dp)
                for c in range(vpp):
                    end = st.max() + int(spec.dp_comm_ms * ms * 0.3 / vpp * rng.uniform(0.9, 1.1) * nic[s])
                    ops.add(s, step, "params-all-gather", st, np.full(dp, end), c, mc=c)
                    ag_end[s, c] = end
                    st = np.full(dp, end + _GAP_NS)
            c_free[s] = ag_end[s, 0]
        pass_end = np.zeros((2, n_chunks, m, dp), np.int64)  # [forward/backward, global chunk, microbatch]
        done = np.zeros((n_chunks, m, 2), bool)
        orders = [_stage_order(s, pp, m, vpp) for s in range(pp)]
        # Each send stream runs one transfer at a time: a send blocked on a busy receiver delays the next
        # one. (With interleaving, stage pp-1's sends to stage 0's next chunk queue up behind its warm-up.)
        # Receivers consume a stage's outputs in the order it produced them, so recording sends when their
        # receiver is scheduled keeps each stream in launch order.
        send_free = np.zeros((pp, 2, dp), np.int64)
        pos = [0] * pp
        seq: dict[tuple[int, str], int] = collections.Counter()  # (stage, optype) -> ops recorded so far
        remaining = sum(len(o) for o in orders)
        while remaining:
            progressed = False
            for s in range(pp):
                while pos[s] < len(orders[s]):
                    kind, i, c = orders[s][pos[s]]
                    d = 0 if kind == "F" else 1
                    name = PASSES[d]
                    g = c * pp + s
                    # The producer of this op's input: the previous global chunk forward, the next backward.
                    src = g - 1 if d == 0 else g + 1
                    has_src = 0 <= src < n_chunks
                    if has_src and not done[src, i, d]:
                        break
                    ready = c_free[s] + _GAP_NS
                    if d == 0 and c > 0:
                        ready = np.maximum(ready, ag_end[s, c] + _GAP_NS)
                    if has_src:
                        sp = src % pp
                        stream = send_free[sp, d]
                        send_st = np.maximum(pass_end[d, src, i], stream) + _GAP_NS
                        xfer = int(spec.p2p_ms * ms * rng.uniform(0.9, 1.1))
                        end = np.maximum(send_st, ready) + xfer
                        stream[:] = end
                        for stage, op, st0 in ((s, f"{name}-recv", ready), (sp, f"{name}-send", send_st)):
                            ops.add(stage, step, op, st0, end, seq[stage, op])
                            seq[stage, op] += 1
                        ready = end + _GAP_NS
                    base = (spec.fwd_ms if d == 0 else spec.bwd_ms) / vpp
                    noise = rng.normal(1.0, spec.noise, dp).clip(0.8, 1.2)
                    dur = (base * ms * scale[s] * seqlen[:, i] * noise).astype(np.int64)
                    end = ready + dur
                    optype = f"{name}-compute"
                    ops.add(s, step, optype, ready, end, seq[s, optype], mc=c, gmc=g, mb=i)
                    seq[s, optype] += 1
                    pass_end[d, g, i] = end
                    done[g, i, d] = True
                    c_free[s] = end
                    pos[s] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:  # cannot happen for a valid 1F1B order
                raise RuntimeError(f"1F1B schedule stuck for {spec.job_id}")
        # The backward-send of stage 0 does not exist; last sends on stage pp-1 for fwd do not either.
        # Post-compute chain.
        gc_dur = np.zeros((pp, dp), np.int64)
        if spec.cause == "gc":
            hit = rng.random((pp, dp)) < 0.15
            pause = rng.uniform(0.5, 1.5, (pp, dp)) * spec.cause_factor * spec.bwd_ms * ms
            if spec.gc_interval > 0:  # planned: every worker collects in the same step, automatic GC off
                hit = np.full((pp, dp), step % spec.gc_interval == spec.gc_interval - 1)
            gc_dur = np.where(hit, pause, 0).astype(np.int64)
        chain = np.zeros((pp, dp), np.int64)
        for s in range(pp):
            st = c_free[s] + _GAP_NS
            ops.add(s, step, "gc", st, st + gc_dur[s], 0, mb=0)
            st = st + gc_dur[s] + _GAP_NS
            ln = int(0.05 * ms)
            ops.add(s, step, "layernorm-grads-all-reduce", st, st + ln, 0)
            chain[s] = st + ln + _GAP_NS
        if pp > 1:
            st = np.maximum(chain[0], chain[pp - 1])
            end = st + int(spec.dp_comm_ms * ms * 0.2)
            ops.add(0, step, "embedding-grads-all-reduce", chain[0], end, 0)
            ops.add(pp - 1, step, "embedding-grads-all-reduce", chain[pp - 1], end, 0)
            chain[0] = end + _GAP_NS
            chain[pp - 1] = end + _GAP_NS
        if has_dp:
            for s in range(pp):
                for c in range(vpp):
                    end = chain[s].max() + int(spec.dp_comm_ms * ms * rng.uniform(0.9, 1.1) / vpp * nic[s])
                    ops.add(s, step, "grads-reduce-scatter", chain[s], np.full(dp, end), c, mc=c)
                    chain[s] = end + _GAP_NS
        clip_end = chain.max() + int(0.3 * ms)
        for s in range(pp):
            ops.add(s, step, "optimizer-clip-main-grad", chain[s], np.full(dp, clip_end), 0)
        opt_end = np.zeros((pp, dp), np.int64)
        for s in range(pp):
            st = np.full(dp, clip_end + _GAP_NS)
            opt_end[s] = st + (spec.optimizer_ms * ms * rng.normal(1, spec.noise, dp)).astype(np.int64)
            ops.add(s, step, "optimizer", st, opt_end[s], 0)
        step_start = int(opt_end.max()) + int(rng.uniform(1, 3) * ms)  # data loading between steps
    return _to_table(spec, window_id, ops)


def _stage_scale(spec: JobSpec) -> np.ndarray:
    """Compute scale per stage of a layer partition: its layers over those of an even stage.

    With cause ``heavy_last_stage`` the last stage also carries the loss layer,
    worth ``cause_factor - 1`` even stages: the even split then reproduces the
    legacy scale exactly.
    """
    n = np.asarray(spec.stage_layers, np.float64)
    scale = n / (n.sum() / len(n))
    if spec.cause == "heavy_last_stage":
        scale[-1] += spec.cause_factor - 1.0
    return scale


def _sequences(spec: JobSpec, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, microbatch) of every sequence of one step; microbatch = dp_rank * m + mb_id.

    Drawn from a generator of its own, keyed by the step, so a fixed spec sees
    the same sequences and every other draw of the job stays the same.
    """
    dp, m, k = spec.layout.dp_size, spec.num_microbatches, spec.seqs_per_microbatch
    rng = np.random.default_rng([spec.seed, zlib.crc32(spec.job_id.encode()), step, 7])
    sigma = np.log(spec.cause_factor) if spec.cause == "seq_imbalance" else 0.0
    lens = np.clip(np.rint(SEQ_TOKENS * rng.lognormal(0.0, sigma, dp * m * k)), 16, SEQ_CONTEXT).astype(np.int64)
    if spec.packing == "attention":
        return lens, _pack_by_attention(lens, dp, m)
    return lens, np.arange(dp * m * k) // k


def _pack_by_attention(lens: np.ndarray, dp: int, m: int) -> np.ndarray:
    """Longest-first greedy by squared length: over DP ranks (least total so far), then within each rank
    over its microbatches (least so far); returns dp_rank * m + mb_id per sequence."""
    cost = lens.astype(np.float64) ** 2
    order = np.argsort(-cost, kind="stable")
    rank_load = np.zeros(dp)
    mb_load = np.zeros((dp, m))
    out = np.empty(len(lens), np.int64)
    for i in order:
        d = int(np.argmin(rank_load))
        rank_load[d] += cost[i]
        out[i] = d
    for i in order:  # heaviest first again, now within the rank
        d = int(out[i])
        b = int(np.argmin(mb_load[d]))
        mb_load[d, b] += cost[i]
        out[i] = d * m + b
    return out


def _microbatch_cost(spec: JobSpec, step: int) -> np.ndarray:
    """[dp, m] compute scale of each microbatch: its sum of squared lengths over the expected one.

    An absolute cost (not normalised per step), as on a real GPU: a step of
    long sequences is slower.
    """
    dp, m, k = spec.layout.dp_size, spec.num_microbatches, spec.seqs_per_microbatch
    lens, mb = _sequences(spec, step)
    sigma = np.log(spec.cause_factor) if spec.cause == "seq_imbalance" else 0.0
    expected = k * SEQ_TOKENS ** 2 * np.exp(2 * sigma ** 2)  # E[sum of k squared lognormal lengths]
    cost = np.bincount(mb, lens.astype(np.float64) ** 2, minlength=dp * m)
    return (cost / expected).reshape(dp, m)


def sequence_table(spec: JobSpec, window_id: int, n_steps: int) -> pa.Table:
    """The data loader's view of a sequence-model window: (step, dp_rank, mb_id, seq_len) per sequence, as run."""
    if spec.seqs_per_microbatch <= 0:
        raise ValueError(f"{spec.job_id} has no sequence model (seqs_per_microbatch = 0)")
    m = spec.num_microbatches
    cols: dict[str, list[np.ndarray]] = {"step": [], "dp_rank": [], "mb_id": [], "seq_len": []}
    for step in range(window_id, window_id + n_steps):
        lens, mb = _sequences(spec, step)
        cols["step"].append(np.full(len(lens), step, np.int64))
        cols["dp_rank"].append((mb // m).astype(np.int32))
        cols["mb_id"].append((mb % m).astype(np.int32))
        cols["seq_len"].append(lens.astype(np.int32))
    return pa.table({k: np.concatenate(v) for k, v in cols.items()})


def _to_table(spec: JobSpec, window_id: int, ops: _Ops) -> pa.Table:
    c = {k: np.concatenate(v) for k, v in ops.cols.items()}
    codes = c["optype"]
    opnames = np.array(ops.optypes, dtype=object)
    lay = spec.layout
    per_worker = lay.tp_size * lay.cp_size
    rank = (c["pp_rank"].astype(np.int64) * lay.dp_size + c["dp_rank"]) * per_worker
    n = len(codes)
    order = np.lexsort((c["start"], c["dp_rank"], c["pp_rank"]))
    cols = {
        "job_id": pa.array(np.full(n, spec.job_id, dtype=object), pa.string()),
        "attempt": pa.array(np.full(n, spec.attempt, np.int32)),
        "rank": pa.array(rank.astype(np.int32)),
        "dp_rank": pa.array(c["dp_rank"].astype(np.int32)),
        "pp_rank": pa.array(c["pp_rank"]),
        "window_id": pa.array(np.full(n, window_id, np.int64)),
        "step": pa.array(c["step"]),
        "optype": pa.array(opnames[codes], pa.string()),
        "start_ns": pa.array(c["start"]),
        "duration_ns": pa.array(np.maximum(c["dur"], 0)),
        "seq_id": pa.array(c["seq"]),
        "mc": pa.array(c["mc"]),
        "gmc": pa.array(c["gmc"]),
        "mb_id": pa.array(c["mb"]),
    }
    return pa.table(cols, schema=OP_SPAN).take(pa.array(order))


def make_fleet(n_jobs: int = 20, seed: int = 0, min_gpus: int = 8, max_gpus: int = 512,
               causes: tuple[str, ...] = CAUSES, vpp_share: float = 0.25) -> list[JobSpec]:
    """A mixed fleet: sizes are powers of two in [min_gpus, max_gpus], causes round-robin; about
    ``vpp_share`` of the pipelined jobs run interleaved 1F1B with two model chunks per stage."""
    rng = np.random.default_rng(seed)
    vpp_rng = np.random.default_rng([seed, 11])  # its own stream: every other draw stays as it was
    sizes = [2 ** k for k in range(int(np.log2(min_gpus)), int(np.log2(max_gpus)) + 1)]
    teams = ("pretrain", "multimodal", "rlhf", "research")
    models = ("gpt-7b", "gpt-13b", "moe-30b", "llama-70b")
    jobs = []
    for j in range(n_jobs):
        n = int(rng.choice(sizes))
        tp = int(min(8, max(1, n // 16)))
        pp = int(rng.choice([p for p in (1, 2, 4, 8) if n // tp // p >= 1 and p <= n // tp]))
        dp = max(1, n // (tp * pp))
        vpp = 2 if pp > 1 and vpp_rng.random() < vpp_share else 1
        lay = JobLayout(dp_size=dp, pp_size=pp, tp_size=tp, vpp_size=vpp)
        cause = causes[j % len(causes)]
        factor = {"none": 1.0, "slow_worker": float(rng.uniform(1.4, 2.0)),
                  "heavy_last_stage": float(rng.uniform(1.3, 1.6)), "seq_imbalance": 1.35,
                  "gc": float(rng.uniform(4, 8))}[cause]
        if cause == "heavy_last_stage" and pp == 1:
            cause, factor = "slow_worker", 1.6
        jobs.append(JobSpec(
            job_id=f"job-{seed:03d}-{j:04d}", layout=lay, num_microbatches=max(4, 2 * pp),
            team=teams[j % len(teams)], model=models[(j // 2) % len(models)],
            fwd_ms=float(rng.uniform(15, 30)), cause=cause,
            cause_dp=int(rng.integers(dp)), cause_pp=int(rng.integers(pp)), cause_factor=factor,
            seed=seed,
        ))
    return jobs


def fleet_windows(jobs: list[JobSpec], windows_per_job: int, steps_per_window: int, t0_ns: int,
                  sample_every: int = 10) -> Iterator[tuple[JobSpec, int, pa.Table]]:
    """Yields (job, window_id, op spans) for each job and profiling session.

    Sessions start every ``sample_every`` windows' worth of steps, NDTimeline-style:
    window w covers steps [w * L * sample_every, + L) where L = steps_per_window.
    """
    for w in range(windows_per_job):
        for spec in jobs:
            first = w * steps_per_window * sample_every
            yield spec, first, generate_window(spec, first, steps_per_window, t0_ns + first * 200_000_000)
