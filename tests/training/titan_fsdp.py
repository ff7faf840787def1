"""An FSDP2 job with gradient accumulation, written as torchtitan writes one: stragglerscope's test subject,
knowing nothing of it.

    torchrun --nproc-per-node 4 tests/training/titan_fsdp.py --steps 14 --out /tmp/out

What it shares with torchtitan (``torchtitan/train.py``, ``parallelize_llama``),
none of it imported:
- the ranks form a one-dimensional DeviceMesh named ``dp_shard``;
- a small language model laid out as torchtitan's: token embedding,
  transformer-ish blocks in a ``ModuleList``, norm, output projection,
  cross-entropy on the next tokens;
- ``fully_shard`` on every block, then on the whole model (the root), with
  ``reshard_after_forward`` as chosen (``--no-reshard-after-forward``: the
  blocks keep their parameters gathered from the forward to the backward);
- gradient accumulation over ``--microbatches`` micro-batches, each loss
  divided by their number; gradients are synced only in the last one
  (``set_requires_gradient_sync(False)`` before the others);
- the gradients' norm clipped over every shard (``clip_grad_norm_`` on the
  DTensor gradients, its total made whole with ``full_tensor``), AdamW, and a
  linear warm-up then linear decay of the learning rate (``LambdaLR``).

Accelerator time is simulated with sleeps inside each block (an autograd
Function between its two projections): a micro-batch's forward sleeps
``--gpu-ms``, its backward twice that. ``--slow-rank R --delay-ms D`` adds D to
every forward and backward of rank R; ``--control`` spreads it as D / W over
every rank (W the world: each rank is a worker). ``--out DIR``: each rank
writes its losses and step times to DIR/rankN.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn


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


class Block(nn.Module):
    def __init__(self, dim: int, fwd_s: float, bwd_s: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        h = torch.nn.functional.gelu(self.w1(self.norm(x)))
        h = SimulatedKernel.apply(h, self.fwd_s, self.bwd_s)
        return x + self.w2(h)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, dim: int, n_blocks: int, fwd_s: float, bwd_s: float):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, fwd_s / n_blocks, bwd_s / n_blocks) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def warmup_then_decay(warmup: int, total: int):
    """torchtitan's default schedule: linear warm-up to the full rate, then linear decay towards 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, 1.0 - (step - warmup) / max(1, total - warmup + 1))
    return factor


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4, help="gradient accumulation steps")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch and rank")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="fully_shard(..., reshard_after_forward=False) on the blocks")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--gpu-ms", type=float, default=40.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--control", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    rank = dist.get_rank()
    delay = args.delay_ms / world if args.control else (args.delay_ms if rank == args.slow_rank else 0.0)
    fwd_s, delay_s = args.gpu_ms / 1e3, delay / 1e3
    torch.manual_seed(11)
    model = TinyTransformer(args.vocab, args.dim, args.blocks, fwd_s + delay_s, 2 * fwd_s + delay_s)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=not args.no_reshard_after_forward)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay(args.warmup_steps, args.steps))

    n_mb = args.microbatches
    g = torch.Generator().manual_seed(1000 + mesh.get_local_rank())
    data = torch.randint(0, args.vocab, (args.steps, n_mb, args.batch, args.seq_len + 1), generator=g)
    losses, step_times, cpu_times = [], [], []
    for step in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        total = 0.0
        for mb in range(n_mb):
            model.set_requires_gradient_sync(mb == n_mb - 1)  # reduce-scatter once, after the last backward
            tokens, labels = data[step, mb, :, :-1], data[step, mb, :, 1:]
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1)) / n_mb
            loss.backward()
            total += loss.detach().item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm, foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        scheduler.step()
        step_times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        losses.append(total)
    dist.barrier()
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, "step_times": step_times, "cpu_times": cpu_times}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
