"""One rank of a data-parallel job on the fake NCCL device, under the tracer ``stragglerscope trace`` installs.

Where ``nccl_fake_worker.py`` drives the exporter and the collective wrappers by hand, this one leaves
everything to the real trace session (``ingest.autotrace.session.arm``, as ``trace``'s sitecustomize does):
the module, autograd and optimizer hooks, the wrapped collectives, the layout claims and the registration.
The job is written as a GPU job is: each step queues its forward and backward kernels (``Launch``: the host
returns at once, the device runs them), copies the gradients into one flat buffer, all-reduces it (NCCL's
call returns at once too) and steps the optimizer; the host waits for the GPU once a step (``loss.item()``).

Stand-ins, and why: the fake device (``tests/nccl_fake.py``) for the GPU, and a producer that keeps what the
session sends in memory instead of writing to Kafka (the transport is tested for real elsewhere; here the
subject is what the tracer records on a GPU). The tables are written to ``<out>/rank<r>.<schema>.arrow``.

    python nccl_fake_trace_worker.py RANK WORLD PORT OUT SCENARIO

SCENARIO: ``late`` (rank 2's backward kernels take LATE_MS longer than its peers') or ``control``: the DP
job; ``pipe-link`` (transfers 1 -> 2 LINK_MS slower) or ``pipe``: the same layers as a 4-stage pipeline of
MICROBATCHES microbatches (GPipe order), its transfers isend/irecv over the pipeline group the job made, as
a hand-written or Megatron-style pipeline does, and the gradients' norm all-reduced over every stage before
the optimizer (clipping).
"""
import os
import sys
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import ingest.producer  # noqa: E402
from core import schema as S  # noqa: E402
from ingest.autotrace import session as trace_session  # noqa: E402
from ingest.exporter import RankExporter, Sampling  # noqa: E402
from tests import nccl_fake  # noqa: E402

STEPS, PROFILED, EVERY = 16, 6, 8   # windows at steps 0 and 8: the second is judged (the first warms up)
FWD_MS, BWD_MS, LATE_MS, LINK_MS, MICROBATCHES = 30.0, 60.0, 90.0, 40.0, 2


SENT: list[pa.Table] = []
"""Every table the session sent, in order."""


class KeptProducer:
    """The producer's place in the session: what is sent is kept in ``SENT``."""

    def __init__(self, *_args, **_kwargs) -> None:
        self.stats = ingest.producer.ProducerStats()
        self.spooled = 0

    def send(self, table: pa.Table, key: str | None = None) -> int:
        SENT.append(table)
        self.stats.records_sent += table.num_rows
        return table.num_rows

    def close(self, timeout_s: float = 60.0) -> None:
        pass


def pipeline_step(model, x, rank: int, world: int, group) -> None:
    """One GPipe step of stage ``rank``: every microbatch forward, then every one backward. The data of a
    transfer arrives on the device stream; the host, which never waits for it, computes on its own copy."""
    outs = []
    for _ in range(MICROBATCHES):
        if rank > 0:
            dist.irecv(nccl_fake.DeviceTensor(torch.empty_like(x)), rank - 1, group=group).wait()
        out = model(x)
        if rank < world - 1:
            dist.isend(nccl_fake.DeviceTensor(out.detach()), rank + 1, group=group).wait()
        outs.append(out)
    for out in outs:
        if rank < world - 1:
            dist.irecv(nccl_fake.DeviceTensor(torch.empty_like(out)), rank + 1, group=group).wait()
            out.backward(torch.ones_like(out))
        else:
            out.pow(2).mean().backward()
        if rank > 0:
            dist.isend(nccl_fake.DeviceTensor(torch.ones_like(x)), rank - 1, group=group).wait()


def main(rank: int, world: int, port: int, out: str, scenario: str) -> None:
    device = nccl_fake.FakeDevice()
    # Before init_process_group: the session wraps whatever torch.distributed holds when it starts, as it
    # wraps NCCL's calls on a GPU.
    undo_fake = nccl_fake.install(device, rank, {(1, 2): LINK_MS} if scenario == "pipe-link" else None)
    RankExporter._cuda_module = staticmethod(lambda use_cuda: device.module)
    ingest.producer.TelemetryProducer = KeptProducer
    trace_session.arm(trace_session.TraceSettings(job_id=f"fake-nccl-{scenario}", bootstrap="127.0.0.1:9",
                                                  sampling=Sampling(PROFILED, EVERY), run_dir=out, probe_kb=0))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    session = trace_session._session
    if session is None:
        raise SystemExit("the trace session did not start")

    backward_ms = BWD_MS + (LATE_MS if scenario == "late" and rank == 2 else 0.0)

    class Launch(torch.autograd.Function):
        """The layer's kernels: queued on the device stream, the host goes on at once."""

        @staticmethod
        def forward(ctx, x):
            device.launch(FWD_MS)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            device.launch(backward_ms)
            return grad

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x):
            return Launch.apply(self.proj(x))

    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    x = torch.randn(16, 32)
    pipeline = dist.new_group(list(range(world))) if scenario.startswith("pipe") else None
    for _ in range(STEPS):
        if pipeline is None:
            loss = model(x).pow(2).mean()
            loss.backward()
            flat = nccl_fake.DeviceTensor(torch.cat([p.grad.reshape(-1) for p in params]))
            dist.all_reduce(flat)
        else:
            pipeline_step(model, x, rank, world, pipeline)
            # gradient clipping: the norm over every stage's gradients, as Megatron's optimizer takes it
            dist.all_reduce(nccl_fake.DeviceTensor(torch.stack([p.grad.norm() for p in params]).norm()))
        opt.step()
        opt.zero_grad()
        device.synchronize()  # loss.item(): the host waits for the step's GPU work
    session.close()
    undo_fake()
    for name, schema in (("op", S.OP_SPAN), ("ccl", S.CCL_RECORD), ("job", S.JOB)):
        nccl_fake.write_sent(os.path.join(out, f"rank{rank}.{name}.arrow"), SENT, schema)
    print(f"rank {rank}: {sum(t.num_rows for t in SENT)} records, {session.exporter.stats.errors} errors",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
