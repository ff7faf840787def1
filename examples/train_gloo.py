"""A real training client: DP x PP pipeline training on CPU with gloo, instrumented by the exporter.

    python -m examples.train_gloo --bootstrap 127.0.0.1:9092 --job-id j1 --dp 2 --pp 2 --steps 10

Spawns dp * pp processes (rank = pp_rank * dp + dp_rank). Each stage holds a
small MLP; microbatches flow through a 1F1B schedule with real point-to-point
activations and gradients; gradients are all-reduced over the DP group of
each stage, the gradient norm over all ranks (``optimizer-clip-main-grad``),
then SGD. Every op is timed by ``RankExporter`` and every collective recorded
by ``instrument_distributed``; records go to Kafka through the real producer.

Fault injection for tests and demos: ``--slow-rank R --delay-ms D`` sleeps D
inside every forward and backward compute of rank R; ``--control`` spreads the
same total delay evenly (D / W on every worker), which is what the what-if
ideal executes (docs/whatif.md, section 7). ``--stop-rank R --stop-at-step N``
makes rank R SIGSTOP itself (a hung rank, for the hang detector).
``--checkpoint-at-step N --checkpoint-s S`` has every rank save a checkpoint
that takes S seconds before step N (told to the exporter with
``checkpointing``): a long stall that is not a hang.

On 2 cores: each DP replica is pinned to one core, one thread per process,
automatic GC off during measured steps (all as the issue asks for stable timings).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time


def _stage_schedule(stage: int, pp: int, m: int):
    """Megatron's non-interleaved 1F1B as a list of actions for one stage."""
    warm = min(pp - stage - 1, m)
    rest = m - warm
    acts = []
    for i in range(warm):
        acts += [("recv_fwd", i), ("F", i), ("send_fwd", i)]
    if rest:
        acts.append(("recv_fwd", warm))
    for i in range(rest):
        f, b = warm + i, i
        acts += [("F", f), ("send_fwd", f), ("recv_bwd", b), ("B", b), ("send_bwd", b)]
        if i < rest - 1:
            acts.append(("recv_fwd", f + 1))
    for i in range(rest, m):
        acts += [("recv_bwd", i), ("B", i), ("send_bwd", i)]
    return acts


def _order_exchange(acts, stage: int):
    """Deadlock-free blocking p2p: on the link (s, s+1) the lower stage sends first, the upper receives first.

    A send followed by a recv on the same link (send_fwd then recv_bwd on the
    lower stage, send_bwd then recv_fwd on the upper stage) is one exchange;
    the upper stage swaps it to recv-then-send.
    """
    out = list(acts)
    i = 0
    while i < len(out) - 1:
        a, b = out[i][0], out[i + 1][0]
        if (a, b) == ("send_bwd", "recv_fwd"):  # exchange with stage - 1, where we are the upper side
            out[i], out[i + 1] = out[i + 1], out[i]
            i += 2
            continue
        i += 1
    return out


def worker(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from core.layout import JobLayout
    from generators.fleetgen import JobSpec
    from ingest.exporter import RankExporter, Sampling, estimate_clock_offset
    from ingest.producer import TelemetryProducer
    from ingest.torch_ccl import instrument_distributed

    dp, pp, m = args.dp, args.pp, args.microbatches
    pp_rank, dp_rank = divmod(rank, dp)
    torch.set_num_threads(1)
    ncpu = os.cpu_count() or 1
    try:
        os.sched_setaffinity(0, {dp_rank % ncpu})
    except (AttributeError, OSError):
        pass
    torch.manual_seed(1234 + pp_rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=dp * pp, init_method=f"tcp://127.0.0.1:{args.port}",
                            timeout=__import__("datetime").timedelta(seconds=args.dist_timeout))
    dp_groups = [dist.new_group([s * dp + d for d in range(dp)]) for s in range(pp)]
    my_dp_group = dp_groups[pp_rank]
    emb_groups = [dist.new_group([d, (pp - 1) * dp + d]) for d in range(dp)] if pp > 1 else []

    producer = TelemetryProducer(args.bootstrap, client_id=f"train-{args.job_id}-{rank}")
    exp = RankExporter(args.job_id, rank, dp_rank, pp_rank, producer.send, attempt=args.attempt,
                       sampling=Sampling(args.steps, args.steps), heartbeat_s=args.heartbeat_s,
                       hang_dump_s=args.hang_dump_s)
    undo = instrument_distributed(exp)
    estimate_clock_offset(exp)
    if rank == 0:
        spec = JobSpec(args.job_id, JobLayout(dp, pp), num_microbatches=m, team="gloo", model="mlp",
                       attempt=args.attempt)
        producer.send(spec.registration(exp.now_ns(), args.steps))

    hidden, mb_rows = args.hidden, args.mb_rows
    layers = [torch.nn.Linear(hidden, hidden) for _ in range(args.layers)]
    model = torch.nn.Sequential(*[mod for lin in layers for mod in (lin, torch.nn.Tanh())])
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    world = dp * pp
    if args.control:
        delay_s = args.delay_ms / 1000.0 / world
    else:
        delay_s = args.delay_ms / 1000.0 if rank == args.slow_rank else 0.0
    # Simulated accelerator time: the CPU waits (sleeps) as it would for a GPU kernel, so the
    # measured durations do not depend on how the 2 cores are shared.
    gpu_s = args.gpu_ms / 1000.0
    prev_rank = (pp_rank - 1) * dp + dp_rank
    next_rank = (pp_rank + 1) * dp + dp_rank
    acts = _order_exchange(_stage_schedule(pp_rank, pp, m), pp_rank)
    data = torch.randn(m, mb_rows, hidden)
    step_times = []

    def run_step(profiled: bool, step: int):
        inputs, outputs, grads_in = {}, {}, {}
        op = exp.op if profiled else _null_op
        for kind, i in acts:
            if kind == "recv_fwd":
                if pp_rank == 0:
                    inputs[i] = data[i].clone().requires_grad_(False)
                else:
                    buf = torch.empty(mb_rows, hidden)
                    with op("forward-recv"):
                        dist.recv(buf, src=prev_rank)
                    inputs[i] = buf.requires_grad_(True)
            elif kind == "F":
                with op("forward-compute", mb_id=i):
                    outputs[i] = model(inputs[i])
                    if gpu_s:
                        time.sleep(gpu_s)
                    if delay_s:
                        time.sleep(delay_s)
            elif kind == "send_fwd":
                if pp_rank < pp - 1:
                    with op("forward-send"):
                        dist.send(outputs[i].detach(), dst=next_rank)
            elif kind == "recv_bwd":
                if pp_rank < pp - 1:
                    buf = torch.empty(mb_rows, hidden)
                    with op("backward-recv"):
                        dist.recv(buf, src=next_rank)
                    grads_in[i] = buf
            elif kind == "B":
                with op("backward-compute", mb_id=i):
                    if pp_rank == pp - 1:
                        loss = outputs[i].pow(2).mean()
                        loss.backward()
                    else:
                        outputs[i].backward(grads_in.pop(i))
                    if gpu_s:
                        time.sleep(2 * gpu_s)
                    if delay_s:
                        time.sleep(delay_s)
            elif kind == "send_bwd":
                if pp_rank > 0:
                    with op("backward-send"):
                        dist.send(inputs[i].grad, dst=prev_rank)
                inputs.pop(i, None)
                outputs.pop(i, None)
        with op("layernorm-grads-all-reduce"):
            # TP is folded into the worker: no TP group here; the op holds the local gradient
            # flattening so that no CPU work stays outside the traced ops.
            flat = torch.cat([p.grad.reshape(-1) for p in params])
        if pp > 1 and pp_rank in (0, pp - 1):
            with op("embedding-grads-all-reduce"):
                dist.all_reduce(flat[:hidden], group=emb_groups[dp_rank])
        if dp > 1:
            with op("grads-reduce-scatter"):
                dist.all_reduce(flat, group=my_dp_group)
                flat /= dp
        with op("optimizer-clip-main-grad"):
            norm = flat.pow(2).sum().reshape(1)
            dist.all_reduce(norm)
        with op("optimizer"):
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)

    for w in range(args.warmup):
        run_step(False, -1 - w)
    dist.barrier()
    gc.disable()
    for step in range(args.steps):
        if args.stop_rank == rank and step == args.stop_at_step:
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == args.checkpoint_at_step:
            with exp.checkpointing(step - 1):
                time.sleep(args.checkpoint_s)  # a save of a large model to slow storage
        t0 = time.perf_counter()
        with exp.step(step):
            run_step(True, step)
        step_times.append(time.perf_counter() - t0)
    gc.enable()
    dist.barrier()
    undo()
    exp.close()
    producer.close(30)
    if rank == 0 and args.report:
        with open(args.report, "w") as f:
            json.dump({"step_times": step_times, "sent": producer.stats.records_sent,
                       "dropped": producer.stats.records_dropped}, f)
    dist.destroy_process_group()


class _NullOp:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _null_op(*_a, **_k):
    return _NullOp()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.train_gloo", description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", required=True, help="Kafka bootstrap host:port")
    p.add_argument("--job-id", required=True)
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="profiled steps (one window)")
    p.add_argument("--warmup", type=int, default=2, help="unprofiled steps first")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mb-rows", type=int, default=64)
    p.add_argument("--gpu-ms", type=float, default=0.0,
                   help="simulated accelerator time per forward (2x per backward), a sleep on every rank")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--control", action="store_true", help="spread the delay over all workers (delay / W each)")
    p.add_argument("--stop-rank", type=int, default=-1, help="rank that SIGSTOPs itself")
    p.add_argument("--stop-at-step", type=int, default=-1)
    p.add_argument("--checkpoint-at-step", type=int, default=-1, help="every rank saves a checkpoint here")
    p.add_argument("--checkpoint-s", type=float, default=0.0, help="how long the checkpoint save takes")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--hang-dump-s", type=float, default=5.0)
    p.add_argument("--dist-timeout", type=float, default=120.0)
    p.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    p.add_argument("--report", help="rank 0 writes its step times here (JSON)")
    args = p.parse_args(argv)
    if args.port == 0:
        from services.ports import free_fixed_port

        args.port = free_fixed_port()
    return args


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    args = parse_args(argv)
    mp.spawn(worker, args=(args,), nprocs=args.dp * args.pp, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
