"""A DP x PP job written the way Megatron-LM writes its pipeline: stragglerscope's test subject, knowing nothing of it.

    torchrun --nproc-per-node 4 tests/training/megatron_style.py --dp 2 --pp 2 --steps 14 --out /tmp/out

What it shares with Megatron-LM (``megatron/core/pipeline_parallel/schedules.py``
and ``p2p_communication.py``, ``parallel_state.py``), none of it imported:
- ranks in Megatron's order (tensor parallel fastest, then data parallel,
  pipeline slowest) and the groups made in ``initialize_model_parallel``'s way:
  every rank makes every data-parallel group, then every pipeline group, then
  every model-parallel group, with ``dist.new_group``;
- its own non-interleaved 1F1B schedule: warm-up forwards, the steady state
  of one forward and one backward, cool-down backwards; one ``forward_step``
  per microbatch;
- point-to-point transfers as ``P2POp`` lists given to ``batch_isend_irecv``,
  the combined ``send_forward_recv_backward`` / ``send_backward_recv_forward``
  of the steady state included, each request waited on at once;
- ``deallocate_output_tensor``: an output's storage shrunk to one element once
  it was sent, so the backward must go through the autograd engine directly
  (``Variable._execution_engine.run_backward``, Megatron's ``custom_backward``),
  as ``torch.autograd.backward`` would refuse the shrunk output;
- after the schedule, the gradients averaged over the data-parallel group
  (``finalize_model_grads``), their norm all-reduced over every rank and
  clipped, then the optimizer.

Accelerator time is simulated with sleeps inside the compute (forward sleeps
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


# -- parallel state, as initialize_model_parallel makes it ---------------------------------------------------
class ParallelState:
    def __init__(self, dp: int, pp: int):
        rank, world = dist.get_rank(), dist.get_world_size()
        assert dp * pp == world, "this job has no tensor parallelism"
        self.dp, self.pp = dp, pp
        self.dp_rank = rank % dp
        self.pp_rank = rank // dp
        for i in range(pp):  # data-parallel groups: one per stage
            ranks = list(range(i * dp, (i + 1) * dp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group = group
        for i in range(dp):  # pipeline groups: one per replica
            ranks = list(range(i, world, dp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.pp_group, self.pp_ranks = group, ranks
        self.grad_stats_group = None  # the world: with TP 1 the model-parallel group x data parallel is everyone

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.pp]

    @property
    def next_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank + 1) % self.pp]


# -- p2p_communication ------------------------------------------------------------------------------------------
def _batched_p2p_ops(ps: ParallelState, send_prev, recv_prev, send_next, recv_next) -> list:
    ops = []
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, send_prev, ps.prev_rank, ps.pp_group))
    if recv_prev is not None:
        ops.append(dist.P2POp(dist.irecv, recv_prev, ps.prev_rank, ps.pp_group))
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, send_next, ps.next_rank, ps.pp_group))
    if recv_next is not None:
        ops.append(dist.P2POp(dist.irecv, recv_next, ps.next_rank, ps.pp_group))
    return dist.batch_isend_irecv(ops) if ops else []


def _communicate(ps: ParallelState, shape, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
    """One batch of transfers with the neighbour stages, waited on at once; returns (from prev, from next)."""
    from_prev = torch.empty(shape, requires_grad=True) if recv_prev else None
    from_next = torch.empty(shape, requires_grad=True) if recv_next else None
    for req in _batched_p2p_ops(ps, send_prev, from_prev, send_next, from_next):
        req.wait()
    return from_prev, from_next


def recv_forward(ps, shape):
    return None if ps.first else _communicate(ps, shape, recv_prev=True)[0]


def recv_backward(ps, shape):
    return None if ps.last else _communicate(ps, shape, recv_next=True)[1]


def send_forward(ps, output, shape):
    if not ps.last:
        _communicate(ps, shape, send_next=output)


def send_backward(ps, input_grad, shape):
    if not ps.first:
        _communicate(ps, shape, send_prev=input_grad)


def send_forward_recv_backward(ps, output, shape):
    return None if ps.last else _communicate(ps, shape, send_next=output, recv_next=True)[1]


def send_backward_recv_forward(ps, input_grad, shape):
    return None if ps.first else _communicate(ps, shape, send_prev=input_grad, recv_prev=True)[0]


# -- schedules ----------------------------------------------------------------------------------------------------
def deallocate_output_tensor(out: torch.Tensor) -> None:
    """Only the output's grad_fn is needed for the backward once it was sent: free its storage."""
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Run the backward straight on the autograd engine: ``torch.autograd.backward`` checks the output's
    shape against its gradient's, which ``deallocate_output_tensor`` broke on purpose."""
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=tuple(),
        allow_unreachable=True, accumulate_grad=True)


def forward_step(ps, model, loss_fn, data, input_tensor, microbatch, losses):
    x = data[0][microbatch] if ps.first else input_tensor
    out = model(x)
    if ps.last:
        loss = loss_fn(out, data[1][microbatch]) / data[2]
        losses.append(loss.detach())
        return loss
    return out


def backward_step(input_tensor, output_tensor, output_tensor_grad):
    if input_tensor is not None:
        input_tensor.retain_grad()
    custom_backward(output_tensor, output_tensor_grad)
    return None if input_tensor is None else input_tensor.grad


def forward_backward_pipelining_without_interleaving(ps, model, loss_fn, data, num_microbatches, shape):
    warmup = min(ps.pp - ps.pp_rank - 1, num_microbatches)
    remaining = num_microbatches - warmup
    inputs, outputs, losses = [], [], []
    for i in range(warmup):
        input_tensor = recv_forward(ps, shape)
        output_tensor = forward_step(ps, model, loss_fn, data, input_tensor, i, losses)
        send_forward(ps, output_tensor, shape)
        inputs.append(input_tensor)
        outputs.append(output_tensor)
        deallocate_output_tensor(output_tensor)
    input_tensor = recv_forward(ps, shape) if remaining > 0 else None
    for i in range(remaining):
        last_iteration = i == remaining - 1
        output_tensor = forward_step(ps, model, loss_fn, data, input_tensor, warmup + i, losses)
        output_tensor_grad = send_forward_recv_backward(ps, output_tensor, shape)
        inputs.append(input_tensor)
        outputs.append(output_tensor)
        if not ps.last:
            deallocate_output_tensor(output_tensor)
        input_tensor, output_tensor = inputs.pop(0), outputs.pop(0)
        input_tensor_grad = backward_step(input_tensor, output_tensor, output_tensor_grad)
        if last_iteration:
            input_tensor = None
            send_backward(ps, input_tensor_grad, shape)
        else:
            input_tensor = send_backward_recv_forward(ps, input_tensor_grad, shape)
    for _ in range(warmup):
        input_tensor, output_tensor = inputs.pop(0), outputs.pop(0)
        output_tensor_grad = recv_backward(ps, shape)
        input_tensor_grad = backward_step(input_tensor, output_tensor, output_tensor_grad)
        send_backward(ps, input_tensor_grad, shape)
    return losses


# -- the model ----------------------------------------------------------------------------------------------------
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


class StageModel(nn.Module):
    def __init__(self, hidden: int, layers: int, fwd_s: float, bwd_s: float):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.Tanh())])
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        return SimulatedKernel.apply(self.layers(x), self.fwd_s, self.bwd_s)


def finalize_model_grads(ps: ParallelState, params) -> None:
    """The data-parallel average of every gradient, in one contiguous buffer (Megatron's grad buffer)."""
    buf = torch.cat([q.grad.reshape(-1) for q in params])
    buf /= ps.dp
    dist.all_reduce(buf, group=ps.dp_group)
    offset = 0
    for q in params:
        q.grad.copy_(buf[offset:offset + q.numel()].view_as(q))
        offset += q.numel()


def clip_grad_norm(ps: ParallelState, params, max_norm: float) -> None:
    """The norm over every rank's gradients (each stage holds its own), then one scale for all."""
    total = torch.stack([q.grad.pow(2).sum() for q in params]).sum().reshape(1)
    dist.all_reduce(total, group=ps.grad_stats_group)
    # Every replica counted each stage's norm once per DP rank: divide that out.
    norm = (total / ps.dp).sqrt()
    coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for q in params:
        q.grad.mul_(coeff)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
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
    ps = ParallelState(args.dp, args.pp)
    delay = args.delay_ms / world if args.control else (args.delay_ms if rank == args.slow_rank else 0.0)
    fwd_s, delay_s = args.gpu_ms / 1e3, delay / 1e3
    torch.manual_seed(1000 + ps.pp_rank)
    model = StageModel(args.hidden, args.layers, fwd_s + delay_s, 2 * fwd_s + delay_s)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    loss_fn = nn.MSELoss()
    m, mbs, h = args.microbatches, args.micro_batch_size, args.hidden
    g = torch.Generator().manual_seed(77 + ps.dp_rank)
    tokens = torch.randn(args.steps, m, mbs, h, generator=g)
    labels = torch.randn(args.steps, m, mbs, h, generator=g)
    losses, step_times, cpu_times = [], [], []
    for step in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for q in params:
            q.grad = torch.zeros_like(q)
        mb_losses = forward_backward_pipelining_without_interleaving(
            ps, model, loss_fn, (tokens[step], labels[step], m), m, (mbs, h))
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
