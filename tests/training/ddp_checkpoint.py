"""A DDP job that checkpoints the ways teams do: stragglerscope's test subject, knowing nothing of it.

    torchrun --nproc-per-node 4 tests/training/ddp_checkpoint.py --checkpoint rank0 --every 20 --save-s 30 \
        --steps 60 --dir /tmp/ckpt

What it shares with the common DDP training scripts (the PyTorch DDP tutorial, Hugging Face and timm's
loops): a DataLoader over a DistributedSampler with ``set_epoch``, AdamW with a linear warm-up then cosine
schedule, ``clip_grad_norm_``, and every ``--every`` steps a checkpoint, one of:

- ``rank0``: rank 0 alone calls ``torch.save`` (model, optimizer, scheduler, step) while the others wait in
  ``dist.barrier()`` after it (the tutorial's way);
- ``per-rank``: every rank saves its own file with ``torch.save`` (its RNG and data position), then a
  barrier;
- ``dcp``: ``torch.distributed.checkpoint.save`` of the model's and optimizer's state dicts;
- ``dcp-async``: ``torch.distributed.checkpoint.async_save``, waiting for the previous save's future before
  starting the next (as torchtitan's checkpointer does).

``--stall-rank R --stall-at-step N --stall-s S``: rank R's forward of step N takes S seconds longer (a kernel
that hangs, a rank stuck in its compute). ``--save-s S``: each save's writes take S seconds longer, as on a slow network mount (the file object's
``write`` sleeps, or the storage writer's). Accelerator time is simulated with sleeps inside the compute
(forward ``--gpu-ms``, backward twice that), so the 2 shared cores do not decide the timings.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s):
        ctx.fwd_s = fwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.fwd_s)
        return g, None


class Model(nn.Module):
    def __init__(self, hidden: int, fwd_s: float):
        super().__init__()
        self.inp, self.out = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.fwd_s = fwd_s
        self.stall_s = 0.0  # once: the next forward is stuck this long

    def forward(self, x):
        extra, self.stall_s = self.stall_s, 0.0
        return self.out(_Sleep.apply(torch.relu(self.inp(x)), self.fwd_s + extra))


class SlowFile:
    """A file on a slow mount: every write takes ``per_write_s`` longer."""

    def __init__(self, path: str, total_s: float, writes: int = 8):
        self.f = open(path, "wb")
        self.per_write_s = total_s / writes
        self.left = writes

    def write(self, data):
        if self.left > 0:
            self.left -= 1
            time.sleep(self.per_write_s)
        return self.f.write(data)

    def flush(self):
        self.f.flush()

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return factor


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", choices=("none", "rank0", "per-rank", "dcp", "dcp-async"), default="none")
    p.add_argument("--every", type=int, default=20, help="checkpoint every this many steps")
    p.add_argument("--save-s", type=float, default=0.0, help="extra seconds each save's writes take")
    p.add_argument("--dir", default="", help="checkpoint folder (default: a temporary one)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=8, help="rows per rank per step")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--gpu-ms", type=float, default=100.0)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--stall-at-step", type=int, default=-1)
    p.add_argument("--stall-s", type=float, default=0.0)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ckpt_dir = args.dir or f"/tmp/ddp-ckpt-{os.getppid()}"
    os.makedirs(ckpt_dir, exist_ok=True)
    data = TensorDataset(torch.randn(args.steps * args.batch * world, args.hidden),
                         torch.randn(args.steps * args.batch * world, args.hidden))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(Model(args.hidden, args.gpu_ms / 1e3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(5, args.steps))
    pending = None  # the previous async save's future
    step = 0
    epoch = 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if rank == args.stall_rank and step == args.stall_at_step:
                model.module.stall_s = args.stall_s
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if args.checkpoint != "none" and step % args.every == 0:
                pending = save(args, ckpt_dir, step, rank, model, opt, sched, pending)
            if step >= args.steps:
                break
        epoch += 1
    if pending is not None:
        pending.result()
    dist.barrier()
    if rank == 0:
        print(f"done: {step} steps, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    return 0


def save(args, ckpt_dir: str, step: int, rank: int, model, opt, sched, pending):
    state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "step": step}
    if args.checkpoint == "rank0":
        if rank == 0:
            with SlowFile(os.path.join(ckpt_dir, f"step{step}.pt"), args.save_s) as f:
                torch.save(state, f)
        dist.barrier()
    elif args.checkpoint == "per-rank":
        with SlowFile(os.path.join(ckpt_dir, f"step{step}-rank{rank}.pt"), args.save_s) as f:
            torch.save({"rng": torch.get_rng_state(), "step": step, "rank": rank}, f)
        dist.barrier()
    else:
        import torch.distributed.checkpoint as dcp

        writer = slow_writer(os.path.join(ckpt_dir, f"step{step}"), args.save_s)
        dcp_state = {"model": model.module.state_dict(), "optimizer": opt.state_dict()}
        if args.checkpoint == "dcp":
            dcp.save(dcp_state, storage_writer=writer)
        else:
            if pending is not None:
                pending.result()  # one save at a time
            return dcp.async_save(dcp_state, storage_writer=writer)
    return pending


def slow_writer(path: str, extra_s: float):
    from torch.distributed.checkpoint import FileSystemWriter

    class SlowWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            time.sleep(extra_s)  # a slow mount
            return super().write_data(plan, planner)

    return SlowWriter(path)


if __name__ == "__main__":
    raise SystemExit(main())
