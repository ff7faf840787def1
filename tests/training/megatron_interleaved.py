"""A DP x PP job with Megatron-LM's interleaved 1F1B schedule, written by hand: stragglerscope's test subject,
knowing nothing of it.

    torchrun --nproc-per-node 4 tests/training/megatron_interleaved.py --dp 2 --pp 2 --chunks 2 --steps 14

What it shares with Megatron-LM (``forward_backward_pipelining_with_interleaving``
in ``megatron/core/pipeline_parallel/schedules.py``, ``p2p_communication.py``,
``parallel_state.py``), none of it imported:
- ranks in Megatron's order (data parallel fastest, the pipeline slowest; no
  tensor parallelism) and its groups made with ``dist.new_group``, every rank
  making every group: the data-parallel groups, then the pipeline groups;
- virtual pipeline stages: each rank holds ``--chunks`` model chunks, a list
  of modules, chunk c of stage p being global chunk c * pp + p; a chunk that
  is not the first virtual stage takes its input through
  ``set_input_tensor``, not as an argument of its forward;
- the interleaved 1F1B schedule: warm-up forwards ((pp - rank - 1) * 2 +
  (chunks - 1) * pp of them), the steady state of one forward and one backward
  whose transfers go out in one batch, cool-down backwards; the chunk of the
  k-th forward is (k mod pp * chunks) // pp, of the k-th backward the same
  counted from the last chunk, and the last stage's forward output goes to
  stage 0's next chunk, stage 0's input gradient to the last stage's previous
  chunk: transfers go both ways between every pair of neighbours;
- point-to-point transfers as ``P2POp`` lists given to ``batch_isend_irecv``,
  each request waited on at once; with two stages a pair of ranks is each
  other's previous and next stage, so every batch lists its forward transfers
  before its backward ones, on both ends, and a receive gets what was meant
  for it (the sends and receives between two ranks are matched in order);
- ``deallocate_output_tensor`` once an output is sent, the backward run on the
  autograd engine directly (``custom_backward``), the input's gradient kept
  with ``retain_grad`` and sent back;
- after the schedule, the gradients averaged over the data-parallel group in
  one buffer, their norm all-reduced over every rank and clipped, then the
  optimizer (SGD with momentum).

Accelerator time is simulated with sleeps inside each chunk (forward sleeps
``--gpu-ms``, backward twice that). ``--slow-rank R --delay-ms D`` adds D to
every forward and backward of rank R; ``--control`` spreads it as D / W over
every rank. ``--out DIR``: each rank writes its losses and step times to
DIR/rankN.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.variable import Variable


# -- parallel state ------------------------------------------------------------------------------------------------
class ParallelState:
    def __init__(self, dp: int, pp: int, chunks: int):
        rank, world = dist.get_rank(), dist.get_world_size()
        assert dp * pp == world, "this job has no tensor parallelism"
        self.dp, self.pp, self.chunks = dp, pp, chunks
        self.dp_rank, self.pp_rank = rank % dp, rank // dp
        for i in range(pp):
            ranks = list(range(i * dp, (i + 1) * dp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group = group
        for i in range(dp):
            ranks = list(range(i, world, dp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.pp_group, self.pp_ranks = group, ranks

    def first(self, chunk: int) -> bool:
        """The first virtual stage: chunk 0 of stage 0."""
        return self.pp_rank == 0 and chunk == 0

    def last(self, chunk: int) -> bool:
        """The last virtual stage: the last chunk of the last stage."""
        return self.pp_rank == self.pp - 1 and chunk == self.chunks - 1

    @property
    def prev_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.pp]

    @property
    def next_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank + 1) % self.pp]

    def chunk_of(self, k: int, forward: bool) -> int:
        """The model chunk of the k-th forward (or backward) of a step on this rank."""
        c = (k % (self.pp * self.chunks)) // self.pp
        return c if forward else self.chunks - 1 - c


# -- p2p_communication ---------------------------------------------------------------------------------------------
def exchange(ps: ParallelState, shape, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
    """One batch of transfers with the neighbour stages, waited on at once: (from prev, from next)."""
    from_prev = torch.empty(shape, requires_grad=True) if recv_prev else None
    from_next = torch.empty(shape, requires_grad=True) if recv_next else None
    ops = []
    # Forward transfers first, then backward ones, on both ends of a pair (see the module docstring).
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, send_next, ps.next_rank, ps.pp_group))
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, send_prev, ps.prev_rank, ps.pp_group))
    if from_prev is not None:
        ops.append(dist.P2POp(dist.irecv, from_prev, ps.prev_rank, ps.pp_group))
    if from_next is not None:
        ops.append(dist.P2POp(dist.irecv, from_next, ps.next_rank, ps.pp_group))
    for req in (dist.batch_isend_irecv(ops) if ops else []):
        req.wait()
    return from_prev, from_next


# -- the model ------------------------------------------------------------------------------------------------------
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


class ModelChunk(nn.Module):
    """A slice of the layers; the first virtual stage projects the raw input, the others take the previous
    chunk's output through ``set_input_tensor``."""

    def __init__(self, hidden: int, layers: int, pre_process: bool, fwd_s: float, bwd_s: float):
        super().__init__()
        self.pre_process = pre_process
        self.embed = nn.Linear(hidden, hidden) if pre_process else None
        self.layers = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.Tanh())])
        self.fwd_s, self.bwd_s = fwd_s, bwd_s
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, x):
        h = self.embed(x) if self.pre_process else self.input_tensor
        return SimulatedKernel.apply(self.layers(h), self.fwd_s, self.bwd_s)


# -- schedules ------------------------------------------------------------------------------------------------------
def deallocate_output_tensor(out) -> None:
    if out is not None:
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output) -> None:
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=tuple(),
        allow_unreachable=True, accumulate_grad=True)


class Interleaved1F1B:
    """One step of the interleaved schedule over ``model`` (a list of chunks) on ``num_microbatches``."""

    def __init__(self, ps: ParallelState, model: list[ModelChunk], loss_fn, data, num_microbatches: int, shape):
        self.ps, self.model, self.loss_fn, self.shape = ps, model, loss_fn, shape
        self.inputs, self.labels = data
        self.m = num_microbatches
        v = ps.chunks
        self.input_tensors: list[list] = [[] for _ in range(v)]
        self.output_tensors: list[list] = [[] for _ in range(v)]
        self.output_grads: list[list] = [[] for _ in range(v)]
        self.fed = [0] * v  # microbatches each chunk has taken in so far
        self.losses: list[torch.Tensor] = []

    def forward(self, k: int):
        ps = self.ps
        c = ps.chunk_of(k, True)
        if ps.first(c) and len(self.input_tensors[c]) == len(self.output_tensors[c]):
            self.input_tensors[c].append(None)
        inp = self.input_tensors[c][-1]
        mb = self.fed[c]
        self.fed[c] += 1
        chunk = self.model[c]
        chunk.set_input_tensor(inp)
        out = chunk(self.inputs[mb] if ps.first(c) else None)
        if ps.last(c):
            out = self.loss_fn(out, self.labels[mb]) / self.m
            self.losses.append(out.detach())
        self.output_tensors[c].append(out)
        return out

    def backward(self, k: int):
        ps = self.ps
        c = ps.chunk_of(k, False)
        if ps.last(c) and len(self.output_grads[c]) == 0:
            self.output_grads[c].append(None)
        inp = self.input_tensors[c].pop(0)
        out = self.output_tensors[c].pop(0)
        grad = self.output_grads[c].pop(0)
        if inp is not None:
            inp.retain_grad()
        custom_backward(out, grad)
        return None if inp is None else inp.grad

    def run(self) -> list[torch.Tensor]:
        ps, shape = self.ps, self.shape
        total = self.m * ps.chunks
        if self.m == ps.pp:
            warmup = total
        else:
            warmup = min((ps.pp - ps.pp_rank - 1) * 2 + (ps.chunks - 1) * ps.pp, total)
        remaining = total - warmup

        self.input_tensors[0].append(None if ps.pp_rank == 0 else exchange(ps, shape, recv_prev=True)[0])
        for k in range(warmup):
            out = self.forward(k)
            next_c = ps.chunk_of(k + 1, True)
            recv_prev = not (ps.pp_rank == 0 and next_c == 0) and k != total - 1
            send = None if ps.last(ps.chunk_of(k, True)) else out
            if k == warmup - 1 and remaining > 0:
                recv_next = ps.pp_rank != ps.pp - 1
                inp, grad = exchange(ps, shape, send_next=send, recv_prev=recv_prev, recv_next=recv_next)
                self.output_grads[ps.chunks - 1].append(grad)
            else:
                inp, _ = exchange(ps, shape, send_next=send, recv_prev=recv_prev)
            self.input_tensors[next_c].append(inp)
            if send is not None:
                deallocate_output_tensor(out)

        for k in range(remaining):
            fk = k + warmup
            out = self.forward(fk)
            in_grad = self.backward(k)
            send_out = None if ps.last(ps.chunk_of(fk, True)) else out
            send_grad = None if ps.first(ps.chunk_of(k, False)) else in_grad
            # The first stage runs pp - 1 microbatches ahead of the last: the chunks they send to it next.
            recv_prev = True
            if ps.pp_rank == 0:
                next_fc = ps.chunk_of(fk - (ps.pp - 1), True)
                recv_prev = next_fc != ps.chunks - 1
                next_fc += 1
            else:
                next_fc = ps.chunk_of(fk + 1, True)
            recv_next = True
            if ps.pp_rank == ps.pp - 1:
                next_bc = ps.chunk_of(k - (ps.pp - 1), False)
                recv_next = next_bc != 0
                next_bc -= 1
            else:
                next_bc = ps.chunk_of(k + 1, False)
            if k == remaining - 1:
                recv_prev = False
            inp, grad = exchange(ps, shape, send_next=send_out, send_prev=send_grad, recv_prev=recv_prev,
                                 recv_next=recv_next)
            if recv_prev:
                self.input_tensors[next_fc].append(inp)
            if recv_next:
                self.output_grads[next_bc].append(grad)
            if send_out is not None:
                deallocate_output_tensor(out)

        if remaining == 0:
            self.output_grads[ps.chunks - 1].append(
                None if ps.pp_rank == ps.pp - 1 else exchange(ps, shape, recv_next=True)[1])
        for k in range(remaining, total):
            in_grad = self.backward(k)
            next_bc = ps.chunk_of(k + 1, False)
            recv_next = not (ps.pp_rank == ps.pp - 1 and next_bc == ps.chunks - 1) and k != total - 1
            send_grad = None if ps.first(ps.chunk_of(k, False)) else in_grad
            _, grad = exchange(ps, shape, send_prev=send_grad, recv_next=recv_next)
            self.output_grads[next_bc].append(grad)
        return self.losses


def finalize_model_grads(ps: ParallelState, params) -> None:
    buf = torch.cat([q.grad.reshape(-1) for q in params])
    buf /= ps.dp
    dist.all_reduce(buf, group=ps.dp_group)
    offset = 0
    for q in params:
        q.grad.copy_(buf[offset:offset + q.numel()].view_as(q))
        offset += q.numel()


def clip_grad_norm(ps: ParallelState, params, max_norm: float) -> None:
    total = torch.stack([q.grad.pow(2).sum() for q in params]).sum().reshape(1)
    dist.all_reduce(total)
    norm = (total / ps.dp).sqrt()  # every replica counted each stage's share once
    coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for q in params:
        q.grad.mul_(coeff)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--chunks", type=int, default=2, help="model chunks per rank (virtual pipeline stages)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=1, help="layers per model chunk")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--gpu-ms", type=float, default=10.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--control", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ps = ParallelState(args.dp, args.pp, args.chunks)
    delay = args.delay_ms / world if args.control else (args.delay_ms if rank == args.slow_rank else 0.0)
    fwd_s, delay_s = args.gpu_ms / 1e3, delay / 1e3
    model = []
    for c in range(args.chunks):
        torch.manual_seed(500 + c * args.pp + ps.pp_rank)
        model.append(ModelChunk(args.hidden, args.layers, ps.first(c), fwd_s + delay_s, 2 * fwd_s + delay_s))
    params = [q for chunk in model for q in chunk.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    loss_fn = nn.MSELoss()
    m, mbs, h = args.microbatches, args.micro_batch_size, args.hidden
    g = torch.Generator().manual_seed(91 + ps.dp_rank)
    inputs = torch.randn(args.steps, m, mbs, h, generator=g)
    labels = torch.randn(args.steps, m, mbs, h, generator=g)
    losses, step_times, cpu_times = [], [], []
    for step in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for q in params:
            q.grad = torch.zeros_like(q)
        mb_losses = Interleaved1F1B(ps, model, loss_fn, (inputs[step], labels[step]), m, (mbs, h)).run()
        finalize_model_grads(ps, params)
        clip_grad_norm(ps, params, 1.0)
        optimizer.step()
        step_times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        losses.append(float(torch.stack(mb_losses).sum()) if mb_losses else 0.0)
    dist.barrier()
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, "step_times": step_times, "cpu_times": cpu_times}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
