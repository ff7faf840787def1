"""A DP x TP job written as torchtitan lays one out: stragglerscope's test subject, knowing nothing of it.

    torchrun --nproc-per-node 4 tests/training/titan_tp.py --steps 14 --out /tmp/out

The ranks form a DeviceMesh ``("dp_shard", "tp")`` of 2 x 2 (torchtitan's
names). The model is a small language model laid out as torchtitan's: token
embedding, feed-forward blocks, norm, output projection, cross-entropy on
next tokens. Each block is split over ``tp`` with DTensor
(``parallelize_module``: the up projection ``ColwiseParallel``, the down
projection ``RowwiseParallel``), so every forward all-reduces the block's
output over the TP pair and every backward its input gradient; the embedding
and the output projection are replicated. The gradients are averaged over the
``dp_shard`` sub-mesh in one flat all-reduce of the local shards, then the
optimizer steps.

Accelerator time is simulated with sleeps inside each block, between its two
projections, so a slow rank holds up its TP peer inside both the forward and
the backward: the forward sleeps ``--gpu-ms`` per step, the backward twice
that. ``--slow-rank R --delay-ms D`` adds D to every forward and backward of
rank R; ``--control`` spreads it as D / W over every rank, W the number of
workers (DP ranks here): the TP ranks of a worker run in lockstep, so one slow
rank makes its whole worker D slower, and a run without that straggler is one
where each worker carries D / W of it, which D / W on each of its ranks gives
(D / world would leave the control half the work). ``--out DIR``: each rank
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


class FeedForward(nn.Module):
    def __init__(self, dim: int, fwd_s: float, bwd_s: float):
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        h = torch.relu(self.w1(x))
        h = SimulatedKernel.apply(h, self.fwd_s, self.bwd_s)
        return x + self.w2(h)


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, n_blocks: int, fwd_s: float, bwd_s: float):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(FeedForward(dim, fwd_s / n_blocks, bwd_s / n_blocks) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per step and DP rank")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--gpu-ms", type=float, default=40.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--control", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp_shard", "tp"))
    rank = dist.get_rank()
    dp_mesh, tp_mesh = mesh["dp_shard"], mesh["tp"]
    workers = world // args.tp
    delay = args.delay_ms / workers if args.control else (args.delay_ms if rank == args.slow_rank else 0.0)
    fwd_s, delay_s = args.gpu_ms / 1e3, delay / 1e3
    torch.manual_seed(31)
    model = Model(args.vocab, args.dim, args.blocks, fwd_s + delay_s, 2 * fwd_s + delay_s)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_group, dp_size = dp_mesh.get_group(), dp_mesh.size()

    g = torch.Generator().manual_seed(5 + dp_mesh.get_local_rank())
    data = torch.randint(0, args.vocab, (args.steps, args.batch, args.seq_len + 1), generator=g)
    inputs, targets = data[..., :-1], data[..., 1:]
    losses, step_times, cpu_times = [], [], []
    for step in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        logits = model(inputs[step])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets[step].reshape(-1))
        loss.backward()
        grads = [q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad for q in model.parameters()]
        flat = torch.cat([gr.reshape(-1) for gr in grads])
        dist.all_reduce(flat, group=dp_group)
        flat /= dp_size
        offset = 0
        for gr in grads:
            gr.copy_(flat[offset:offset + gr.numel()].view_as(gr))
            offset += gr.numel()
        optimizer.step()
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
