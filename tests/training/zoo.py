"""Ordinary PyTorch training jobs that know nothing of stragglerscope (the automatic tracer's test subjects).

    torchrun --nproc-per-node 4 tests/training/zoo.py --framework pipelining --dp 2 --steps 12

Frameworks: ``pipelining`` (torch.distributed.pipelining, Schedule1F1B, DP x PP
with a hand-written gradient all-reduce over the DP group), ``interleaved``
(ScheduleInterleaved1F1B, 2 stages per rank), ``gpipe`` (ScheduleGPipe),
``ddp`` (DistributedDataParallel), ``fsdp`` (FSDP2 ``fully_shard``) and
``plain`` (a loop with a manual all_reduce of the flattened gradients) and
``hier`` (data parallel with a two-level all-reduce: inside each "node" of
``--node-size`` ranks, then across nodes between the ranks of the same
local index, as hierarchical all-reduces do; its groups overlap, which the
link diagnosis needs to place a fault).

Accelerator time is simulated with sleeps inside the compute (a layer whose
forward sleeps ``--gpu-ms`` and backward twice that), so the shared 2 cores do
not decide the timings. ``--slow-rank R --delay-ms D`` adds D to every forward
and backward of rank R; ``--control`` spreads it as D / W over every rank.
``--gc-storm-rank R`` makes rank R call ``gc.collect()`` ``--gc-storm`` times
between backward and the optimizer; ``--gc-between-chunks-rank R`` after each of
its backward chunks (pipelining). ``--out DIR``: each rank writes its losses
and step times to DIR/rankN.json. ``--crash-at-step N``: rank 0 raises there.
``--stall-rank R --stall-at-step N --stall-s S``: rank R's compute in step N
takes S seconds longer (a rank stuck in a kernel). ``--mesh-tp N`` (plain): the ranks form a DeviceMesh ('dp', 'tp'), as
torchtitan lays them out, and only the mesh says that N of them are TP.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        if fwd_s:
            time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.bwd_s:
            time.sleep(ctx.bwd_s)
        return g, None, None


class _TPMean(torch.autograd.Function):
    """A tensor-parallel layer's reduction, reduced to its communication: the mean over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g / dist.get_world_size(ctx.group), None


class TPMean(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return _TPMean.apply(x, self.group)


class Busy(nn.Module):
    """Simulated accelerator time: forward sleeps fwd_s, backward sleeps 2 * fwd_s (plus the injected delay)."""

    stall_s = 0.0  # set for one step by --stall-at-step: the next forward is stuck this long

    def __init__(self, fwd_s: float, delay_s: float):
        super().__init__()
        self.fwd_s, self.bwd_s = fwd_s + delay_s, 2 * fwd_s + delay_s

    def forward(self, x):
        extra, Busy.stall_s = Busy.stall_s, 0.0
        return _Sleep.apply(x, self.fwd_s + extra, self.bwd_s)


def mlp(hidden: int, layers: int, busy: Busy) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.Tanh()]
    return nn.Sequential(*mods, busy)


def set_grads(params, flat) -> None:
    """Copy a flat gradient buffer back into each parameter's .grad."""
    off = 0
    for prm in params:
        prm.grad.copy_(flat[off:off + prm.numel()].view_as(prm))
        off += prm.numel()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", required=True,
                   choices=("pipelining", "interleaved", "gpipe", "ddp", "fsdp", "plain", "hier"))
    p.add_argument("--dp", type=int, default=2, help="data-parallel size of pipelined jobs (pp = world / dp)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=16, help="rows per microbatch")
    p.add_argument("--gpu-ms", type=float, default=10.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--control", action="store_true")
    p.add_argument("--gc-storm-rank", type=int, default=-1)
    p.add_argument("--gc-storm", type=int, default=20)
    p.add_argument("--gc-between-chunks-rank", type=int, default=-1,
                   help="pipelining: this rank collects garbage after each backward chunk (between chunks)")
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--stall-at-step", type=int, default=-1)
    p.add_argument("--stall-s", type=float, default=0.0)
    p.add_argument("--node-size", type=int, default=4, help="ranks per node of --framework hier")
    p.add_argument("--mesh-tp", type=int, default=0,
                   help="plain: lay the ranks out in a DeviceMesh ('dp', 'tp') with this TP size; activations are "
                        "averaged over 'tp' in every forward and backward, gradients over 'dp'")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (not the pipelined frameworks): inductor, as users run it")
    p.add_argument("--out", help="folder for rankN.json (losses, step times)")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    delay_ms = args.delay_ms / world if args.control else (args.delay_ms if rank == args.slow_rank else 0.0)
    fwd_s, delay_s = args.gpu_ms / 1e3, delay_ms / 1e3
    losses: list[float] = []
    step_times: list[float] = []
    cpu_times: list[float] = []  # CPU seconds of the whole process (every thread) per step: steadier than wall
    m, rows, hidden = args.microbatches, args.rows, args.hidden
    data = torch.randn(args.steps, m * rows, hidden, generator=torch.Generator().manual_seed(7))
    target = torch.randn(args.steps, m * rows, hidden, generator=torch.Generator().manual_seed(8))

    def after_backward(params) -> None:
        if rank == args.gc_storm_rank:
            for _ in range(args.gc_storm):
                gc.collect()

    if args.framework in ("pipelining", "interleaved", "gpipe"):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        dp = args.dp
        pp = world // dp
        pp_rank, dp_rank = divmod(rank, dp)
        pp_groups = [dist.new_group([d + k * dp for k in range(pp)]) for d in range(dp)]
        dp_groups = [dist.new_group([s * dp + d for d in range(dp)]) for s in range(pp)]
        pp_group, dp_group = pp_groups[dp_rank], dp_groups[pp_rank]
        chunks = 2 if args.framework == "interleaved" else 1
        if rank == args.gc_between_chunks_rank:
            # After the chunk returns, outside any span the tracer keeps open: a collection that the
            # schedule's own allocations could trigger there at any time.
            plain_backward = PipelineStage.backward_one_chunk

            def backward_then_collect(self, *a, **kw):
                try:
                    return plain_backward(self, *a, **kw)
                finally:
                    gc.collect()
            PipelineStage.backward_one_chunk = backward_then_collect
        stages, params = [], []
        for k in range(chunks):
            idx = pp_rank + k * pp
            torch.manual_seed(100 + idx)
            mod = mlp(hidden, args.layers, Busy(fwd_s, delay_s))
            params += list(mod.parameters())
            stages.append(PipelineStage(mod, idx, pp * chunks, torch.device("cpu"), group=pp_group))
        loss_fn = nn.MSELoss()
        if args.framework == "interleaved":
            sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
        elif args.framework == "gpipe":
            sched = ScheduleGPipe(stages[0], n_microbatches=m, loss_fn=loss_fn)
        else:
            sched = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=loss_fn)
        is_first, is_last = pp_rank == 0, pp_rank == pp - 1
        opt = torch.optim.SGD(params, lr=0.05)
        for step in range(args.steps):
            if step == args.crash_at_step and rank == 0:
                raise RuntimeError("crash requested by --crash-at-step")
            if step == args.stall_at_step and rank == args.stall_rank:
                Busy.stall_s = args.stall_s
            t0, c0 = time.perf_counter(), time.process_time()
            mb_losses: list = []
            x, y = data[step], target[step]
            if is_first and is_last:
                sched.step(x, target=y, losses=mb_losses)
            elif is_first:
                sched.step(x)
            elif is_last:
                sched.step(target=y, losses=mb_losses)
            else:
                sched.step()
            after_backward(params)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            if dp > 1:
                dist.all_reduce(flat, group=dp_group)
                flat /= dp
            # Global gradient-norm clipping over every stage (as Megatron and torchtitan do).
            sq = flat.pow(2).sum().reshape(1)
            dist.all_reduce(sq)
            flat *= torch.clamp(1.0 / (sq.sqrt() + 1e-6), max=1.0)
            set_grads(params, flat)
            opt.step()
            opt.zero_grad(set_to_none=False)
            step_times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            losses.append(float(sum(v.item() for v in mb_losses)) if mb_losses else 0.0)
    else:
        torch.manual_seed(99)
        model: nn.Module = mlp(hidden, args.layers, Busy(fwd_s, delay_s))
        grad_group, grad_size = None, world
        if args.mesh_tp:
            if args.framework != "plain" or world % args.mesh_tp:
                raise SystemExit("--mesh-tp is for --framework plain, with a TP size that divides the world")
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world // args.mesh_tp, args.mesh_tp), mesh_dim_names=("dp", "tp"))
            grad_group, grad_size = mesh.get_group("dp"), world // args.mesh_tp
            model = nn.Sequential(*model, TPMean(mesh.get_group("tp")))
        if args.framework == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        elif args.framework == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        params = list(model.parameters())
        if args.compile:
            model = torch.compile(model)
        if args.framework == "hier":
            k = args.node_size
            if world % k:
                raise SystemExit(f"--node-size {k} does not divide the world size {world}")
            node_groups = [dist.new_group(list(range(n * k, (n + 1) * k))) for n in range(world // k)]
            cross_groups = [dist.new_group(list(range(i, world, k))) for i in range(k)]
            node_group, cross_group = node_groups[rank // k], cross_groups[rank % k]
        opt = torch.optim.SGD(params, lr=0.05)
        loss_fn = nn.MSELoss()
        shard = slice(rank * rows * m // world, (rank + 1) * rows * m // world) if args.framework != "plain" else \
            slice(None)
        for step in range(args.steps):
            if step == args.crash_at_step and rank == 0:
                raise RuntimeError("crash requested by --crash-at-step")
            if step == args.stall_at_step and rank == args.stall_rank:
                Busy.stall_s = args.stall_s
            t0, c0 = time.perf_counter(), time.process_time()
            x, y = data[step][shard], target[step][shard]
            loss = loss_fn(model(x), y)
            loss.backward()
            after_backward(params)
            if args.framework in ("plain", "hier"):
                # One bucket, as hand-written loops (and DDP) do: a flat copy of every gradient.
                flat = torch.cat([prm.grad.reshape(-1) for prm in params])
                if args.framework == "hier":  # the sum inside each node, then the sum of the node sums
                    dist.all_reduce(flat, group=node_group)
                    if world > args.node_size:
                        dist.all_reduce(flat, group=cross_group)
                else:
                    dist.all_reduce(flat, group=grad_group)
                flat /= grad_size  # the world, or the DP dimension of --mesh-tp
                set_grads(params, flat)
            opt.step()
            opt.zero_grad(set_to_none=False)
            step_times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            losses.append(loss.item())
    dist.barrier()
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, "step_times": step_times, "cpu_times": cpu_times}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
