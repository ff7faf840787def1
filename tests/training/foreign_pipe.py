"""A DP x PP pipelining job as another team wrote it: stragglerscope's test subject, knowing nothing of it.

    torchrun --nproc-per-node 4 tests/training/foreign_pipe.py --pp 2 --steps 14 --out /tmp/out

``torch.distributed.pipelining`` with ``Schedule1F1B``, four ranks by default:
two pipelines of two stages. Unlike ``zoo.py`` the ranks are numbered
data-parallel-major (``dp_rank, stage = divmod(rank, pp)``: ranks 0 and 1 are
the first pipeline) unless ``--rank-order pp-major``; the groups are made with
``dist.new_group`` (every rank makes every group, pipelines first), or with
``--mesh`` taken from a DeviceMesh whose dimensions have this team's own names
(``replica``, ``stage``), which say nothing to a reader that only knows
torchtitan's. After the schedule, the gradients are averaged over the stage's
replicas in one flat all-reduce and the optimizer steps; no global gradient
clipping.

``--tp-outer 2`` (with ``--pp 2`` and four ranks) is a job whose tensor
parallelism is declared nowhere a tracer can read: ranks are numbered
``tp_rank, stage = divmod(rank, pp)`` and each stage averages its activations
over its TP pair (a hand-made group) in every forward and backward. It is how
a layout goes wrong when nothing names it.

Accelerator time is simulated with sleeps inside the compute (a layer whose
forward sleeps ``--gpu-ms`` and backward twice that), so the 2 shared cores do
not decide the timings. ``--slow-rank R --delay-ms D`` adds D to every forward
and backward of rank R; ``--control`` spreads it as D / W over every rank.
``--out DIR``: each rank writes its losses and step times to DIR/rankN.json.

A job that gets slower on every rank at once (a throttled rack, a slower
fabric, a library upgrade): from step ``--slower-from N`` every rank's
accelerator time is ``--slower-compute F`` times longer, and/or each step's
gradient all-reduce carries ``--slower-allreduce-mb M`` more data.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class SimulatedKernel(torch.autograd.Function):
    """Stands for the accelerator's time: the host sleeps in forward and backward, values pass through."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class AverageOverGroup(torch.autograd.Function):
    """Tensor parallelism reduced to its communication: activations and their gradients averaged over a group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad / dist.get_world_size(ctx.group), None


class Block(nn.Module):
    def __init__(self, width: int, depth: int, fwd_s: float, bwd_s: float, tp_group=None):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.fwd_s, self.bwd_s, self.tp_group = fwd_s, bwd_s, tp_group

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        x = SimulatedKernel.apply(x, self.fwd_s, self.bwd_s)
        if self.tp_group is not None:
            x = AverageOverGroup.apply(x, self.tp_group)
        return x


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages; data parallel is what the world leaves")
    p.add_argument("--rank-order", choices=("dp-major", "pp-major"), default="dp-major")
    p.add_argument("--mesh", action="store_true", help="take the groups from a DeviceMesh ('replica', 'stage')")
    p.add_argument("--tp-outer", type=int, default=0, help="undeclared tensor parallelism of this size, outermost")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="rows per step and replica")
    p.add_argument("--gpu-ms", type=float, default=10.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--control", action="store_true")
    p.add_argument("--slower-from", type=int, default=-1, help="from this step every rank slows (see below)")
    p.add_argument("--slower-compute", type=float, default=1.0, help="accelerator time x this from --slower-from")
    p.add_argument("--slower-allreduce-mb", type=float, default=0.0,
                   help="MB more in each step's gradient all-reduce from --slower-from")
    p.add_argument("--out")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = args.pp
    tp = args.tp_outer or 1
    dp = world // (pp * tp)
    if dp * pp * tp != world:
        raise SystemExit(f"world {world} is not a multiple of pp {pp} x tp {tp}")

    tp_group = None
    if args.tp_outer:
        # Replica r of the model is split over TP; TP is the outermost index, then the stage.
        tp_rank, stage = divmod(rank, pp)
        dp_rank = 0
        pipes = [[t * pp + s for s in range(pp)] for t in range(tp)]
        pairs = [[t * pp + s for t in range(tp)] for s in range(pp)]
        pipe_groups = [dist.new_group(r) for r in pipes]
        tp_groups = [dist.new_group(r) for r in pairs]
        pipe_group, dp_group, tp_group = pipe_groups[tp_rank], None, tp_groups[stage]
    elif args.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        if args.rank_order == "dp-major":
            dp_rank, stage = divmod(rank, pp)
            mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("replica", "stage"))
        else:
            stage, dp_rank = divmod(rank, dp)
            mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("stage", "replica"))
        pipe_group, dp_group = mesh.get_group("stage"), mesh.get_group("replica")
    else:
        if args.rank_order == "dp-major":
            dp_rank, stage = divmod(rank, pp)
            pipes = [[d * pp + s for s in range(pp)] for d in range(dp)]
            replicas = [[d * pp + s for d in range(dp)] for s in range(pp)]
        else:
            stage, dp_rank = divmod(rank, dp)
            pipes = [[s * dp + d for s in range(pp)] for d in range(dp)]
            replicas = [[s * dp + d for d in range(dp)] for s in range(pp)]
        pipe_groups = [dist.new_group(r) for r in pipes]
        dp_groups = [dist.new_group(r) for r in replicas]
        pipe_group, dp_group = pipe_groups[dp_rank], dp_groups[stage]

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if args.control:
        delay_s = args.delay_ms / world / 1e3
    else:
        delay_s = args.delay_ms / 1e3 if rank == args.slow_rank else 0.0
    fwd_s = args.gpu_ms / 1e3
    torch.manual_seed(2024 + stage)
    block = Block(args.width, args.depth, fwd_s + delay_s, 2 * fwd_s + delay_s, tp_group)
    pipe_stage = PipelineStage(block, stage, pp, torch.device("cpu"), group=pipe_group)
    schedule = Schedule1F1B(pipe_stage, n_microbatches=args.microbatches, loss_fn=nn.MSELoss())
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
    params = list(block.parameters())

    g = torch.Generator().manual_seed(11 + dp_rank)
    inputs = torch.randn(args.steps, args.batch, args.width, generator=g)
    targets = torch.randn(args.steps, args.batch, args.width, generator=g)
    first, last = stage == 0, stage == pp - 1
    losses, step_times, cpu_times = [], [], []
    padding = torch.zeros(int(args.slower_allreduce_mb * 2**20 / 4))
    for step in range(args.steps):
        if step == args.slower_from:
            block.fwd_s, block.bwd_s = block.fwd_s * args.slower_compute, block.bwd_s * args.slower_compute
        t0, c0 = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        mb_losses: list[torch.Tensor] = []
        if first and last:
            schedule.step(inputs[step], target=targets[step], losses=mb_losses)
        elif first:
            schedule.step(inputs[step])
        elif last:
            schedule.step(target=targets[step], losses=mb_losses)
        else:
            schedule.step()
        if dp_group is not None and dp > 1:
            flat = torch.cat([q.grad.flatten() for q in params])
            if 0 <= args.slower_from <= step and padding.numel():
                flat = torch.cat([flat, padding])
            dist.all_reduce(flat, group=dp_group)
            flat /= dp
            offset = 0
            for q in params:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
                offset += q.numel()
        optimizer.step()
        step_times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        losses.append(float(torch.stack(mb_losses).detach().sum()) if mb_losses else 0.0)
    dist.barrier()
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, "step_times": step_times, "cpu_times": cpu_times}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
