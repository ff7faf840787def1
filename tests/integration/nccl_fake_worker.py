"""One rank of a job on the fake NCCL device (tests/nccl_fake.py), run by test_nccl_fake.

A DP4 job as a GPU job is written: each step queues its compute (forward and backward kernels) and its
gradient all-reduce and goes on; the loop syncs with the GPU once per step (``loss.item()``). The CCL
records the real exporter and instrumentation make of it are written to ``<out>/rank<r>.arrow``.

    python nccl_fake_worker.py RANK WORLD PORT OUT SCENARIO [gpu|host]

SCENARIO: ``late`` (rank 2's compute 40 ms longer than its peers'), ``link`` (a 4-stage chain of isend/irecv,
transfers 1 -> 2 30 ms slower) or ``control``. ``host``: the exporter without the device's events (what
host-timed records say of NCCL's calls).
"""
import sys
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from core import schema as S  # noqa: E402
from ingest.exporter import RankExporter, Sampling  # noqa: E402
from ingest.torch_ccl import instrument_distributed  # noqa: E402
from tests import nccl_fake  # noqa: E402

STEPS, COMPUTE_MS, LATE_MS, LINK_MS = 8, 20.0, 40.0, 30.0


def main(rank: int, world: int, port: int, out: str, scenario: str, timing: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    device = nccl_fake.FakeDevice()
    undo_fake = nccl_fake.install(device, rank, {(1, 2): LINK_MS} if scenario == "link" else None)
    if timing == "gpu":
        RankExporter._cuda_module = staticmethod(lambda use_cuda: device.module)
    sent = []
    exp = RankExporter("fake-nccl", rank, rank, 0, sent.append, sampling=Sampling(STEPS, STEPS), heartbeat_s=3600,
                       send_every_s=0.05, use_cuda=None if timing == "gpu" else False, nvml=False, tcp_flows=False)
    undo = instrument_distributed(exp)
    grad = nccl_fake.DeviceTensor(torch.ones(64 * 1024))
    for step in range(STEPS):
        with exp.step(step):
            device.launch(COMPUTE_MS + (LATE_MS if scenario == "late" and rank == 2 else 0.0))
            if scenario == "link":
                # a pipeline's forward as a hand-written one does it: receive from the stage before, compute,
                # send to the next (each transfer its own call)
                if rank > 0:
                    dist.irecv(nccl_fake.DeviceTensor(torch.empty(16 * 1024)), rank - 1).wait()
                    device.launch(5.0)
                if rank < world - 1:
                    dist.isend(nccl_fake.DeviceTensor(torch.ones(16 * 1024)), rank + 1).wait()
            dist.all_reduce(grad)
            device.launch(2.0)  # the optimizer
        device.synchronize()  # loss.item(): the host waits for the step's GPU work
    exp.close()
    undo()
    undo_fake()
    rows = [r for t in sent if S.kind_of(t.schema) == "ccl_record" for r in t.to_pylist()]
    table = pa.Table.from_pylist(rows, schema=S.CCL_RECORD) if rows else S.CCL_RECORD.empty_table()
    with pa.OSFile(f"{out}/rank{rank}.arrow", "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    print(f"rank {rank}: {table.num_rows} records, {exp.stats.errors} errors", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
