"""A DDP job with gradient accumulation, written the way most PyTorch training scripts are: stragglerscope's
test subject, knowing nothing of it.

    torchrun --nproc-per-node 4 tests/training/ddp_accum.py --steps 14 --out /tmp/out

What it shares with the scripts of the PyTorch examples and tutorials:
- a ``Dataset`` read through a ``DataLoader`` over a ``DistributedSampler``
  (each rank its share of the samples, reshuffled each epoch with
  ``set_epoch``), the model in ``DistributedDataParallel``;
- gradient accumulation: the loss of each of ``--accum`` micro-batches divided
  by their number, ``no_sync()`` around all but the last one, so that DDP
  reduces the gradients once per optimizer step;
- ``clip_grad_norm_``, AdamW, and a learning rate that warms up linearly then
  follows a cosine (``SequentialLR`` of ``LinearLR`` and ``CosineAnnealingLR``),
  stepped after every optimizer step; ``zero_grad(set_to_none=True)``.

Accelerator time is simulated with sleeps inside the model (an autograd
Function after its layers): a micro-batch's forward sleeps ``--gpu-ms``, its
backward twice that. ``--slow-rank R --delay-ms D`` adds D to every forward and
backward of rank R; ``--control`` spreads it as D / W over every rank (W the
world). ``--out DIR``: each rank writes its losses (the mean micro-batch loss of
each optimizer step) and step times to DIR/rankN.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class SimulatedKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class Regressor(nn.Module):
    def __init__(self, features: int, hidden: int, fwd_s: float, bwd_s: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, 1))
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        return SimulatedKernel.apply(self.net(x), self.fwd_s, self.bwd_s).squeeze(-1)


class SyntheticRegression(Dataset):
    """A fixed random linear problem with noise: the same samples on every rank, the sampler splits them."""

    def __init__(self, n: int, features: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g)
        w = torch.randn(features, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch and rank")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--gpu-ms", type=float, default=40.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--control", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    delay = args.delay_ms / world if args.control else (args.delay_ms if rank == args.slow_rank else 0.0)
    fwd_s, delay_s = args.gpu_ms / 1e3, delay / 1e3

    dataset = SyntheticRegression(world * args.batch_size * args.accum * 8, args.features)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=42, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=0, drop_last=True)

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Regressor(args.features, args.hidden, fwd_s + delay_s,
                                                          2 * fwd_s + delay_s))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=args.warmup_steps)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.steps - args.warmup_steps))
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[args.warmup_steps])
    loss_fn = nn.MSELoss()

    losses, step_times, cpu_times = [], [], []
    step, epoch, micro = 0, 0, 0
    running = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            last = (micro + 1) % args.accum == 0
            with contextlib.nullcontext() if last else model.no_sync():
                loss = loss_fn(model(x), y) / args.accum
                loss.backward()
            running += loss.item()
            micro += 1
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            losses.append(running)
            running = 0.0
            step += 1
            t0, c0 = time.perf_counter(), time.process_time()
            if step == args.steps:
                break
        epoch += 1
    dist.barrier()
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, "step_times": step_times, "cpu_times": cpu_times}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
