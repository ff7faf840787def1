"""A data-parallel job that averages its gradients over a hand-written bidirectional ring, as some teams write it.

    torchrun --nproc-per-node 8 tests/netfaults/ring_job.py --steps 12

Each step: a forward and backward of a small MLP (with ``--gpu-ms`` of simulated accelerator time, so the
shared cores do not decide the timings), then the flat gradient is exchanged with both ring neighbours at
once (``P2POp`` isend/irecv to rank+1 and rank-1, ``batch_isend_irecv``) ``--rounds`` times, averaged,
and the optimizer steps. Every rank sends to two peers and receives from two: the traffic a link
diagnosis can tell a rank's NIC from one of its links with. ``--slow-rank R --delay-ms D`` delays rank R's
forward and backward (a late sender, not a network fault).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="ring exchanges per step")
    p.add_argument("--gpu-ms", type=float, default=10.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay-ms", type=float, default=0.0)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.Tanh(), nn.Linear(args.hidden, args.hidden))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    extra = args.delay_ms / 1e3 if rank == args.slow_rank else 0.0
    x = torch.randn(32, args.hidden, generator=torch.Generator().manual_seed(rank))
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for _ in range(args.steps):
        time.sleep(args.gpu_ms / 1e3 + extra)  # the forward's accelerator time
        loss = model(x).pow(2).mean()
        loss.backward()
        time.sleep(2 * args.gpu_ms / 1e3 + extra)
        flat = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
        for _ in range(args.rounds):
            left, right = torch.empty_like(flat), torch.empty_like(flat)
            ops = [dist.P2POp(dist.isend, flat, nxt), dist.P2POp(dist.irecv, left, prv),
                   dist.P2POp(dist.isend, flat, prv), dist.P2POp(dist.irecv, right, nxt)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            flat = (flat + left + right) / 3
        off = 0
        for q in model.parameters():
            q.grad.copy_(flat[off:off + q.numel()].view_as(q))
            off += q.numel()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
