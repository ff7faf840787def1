"""One rank of a job on the fake NCCL device (tests/nccl_fake.py), run by test_nccl_fake.

A DP4 job as a GPU job is written: each step queues its compute (forward and backward kernels) and its
gradient all-reduce and goes on; the loop syncs with the GPU once per step (``loss.item()``). The CCL
records the real exporter and instrumentation make of it are written to ``<out>/rank<r>.arrow``.

    python nccl_fake_worker.py RANK WORLD PORT OUT SCENARIO [gpu|host]

SCENARIO: ``late`` (rank 2's compute 40 ms longer than its peers'), ``link`` (a 4-stage chain of isend/irecv,
transfers 1 -> 2 30 ms slower), ``stuck`` (rank 1's GPU stuck in a kernel in step 6; heartbeats are written
to ``rank<r>.hb.arrow`` too), ``control``, or ``clock`` (no job: each rank's clock offset to rank 0's,
measured over a gloo group of its own, to ``rank<r>.offset``; rank 1's clock 5 s ahead). ``host``: the
exporter without the device's events (what host-timed records say of NCCL's calls).
"""
import math
import os
import sys
import threading
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from core import schema as S  # noqa: E402
from ingest.exporter import RankExporter, Sampling, estimate_clock_offset  # noqa: E402
from ingest.torch_ccl import instrument_distributed  # noqa: E402
from tests import nccl_fake  # noqa: E402

STEPS, COMPUTE_MS, LATE_MS, LINK_MS, STUCK_AT = 8, 20.0, 40.0, 30.0, 6


def main(rank: int, world: int, port: int, out: str, scenario: str, timing: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    if scenario == "clock":
        # Under NCCL the clocks are compared over a gloo group of our own: rank 1's clock runs 5 s ahead.
        exp = RankExporter("fake-nccl", rank, rank, 0, lambda t: None, heartbeat_s=3600, use_cuda=False, nvml=False,
                           tcp_flows=False)
        exp._anchor_ns += 5_000_000_000 * (rank == 1)
        # Each rank stands for a host of its own (ranks of one host share its clock: no offset is measured).
        import ingest.exporter as exporter_module

        exporter_module.host_id = lambda: 1000 + rank
        side = dist.new_group(backend="gloo")

        def not_on_default(fn):  # the default group stands for NCCL's: using it is the failure
            def call(*args, group=None, **kwargs):
                if group is None:
                    raise RuntimeError("a collective on the default (NCCL) group before a device was chosen")
                return fn(*args, group=group, **kwargs)
            return call
        dist.barrier, dist.all_gather = not_on_default(dist.barrier), not_on_default(dist.all_gather)
        offset = estimate_clock_offset(exp, group=side)
        with open(f"{out}/rank{rank}.offset", "w") as f:
            f.write(str(offset))
        exp.close()
        dist.destroy_process_group()
        return
    device = nccl_fake.FakeDevice()
    undo_fake = nccl_fake.install(device, rank, {(1, 2): LINK_MS} if scenario == "link" else None)
    if timing == "gpu":
        RankExporter._cuda_module = staticmethod(lambda use_cuda: device.module)
    sent = []
    stuck = scenario == "stuck"
    # stuck: steps 0, 1, 4 and 5 sampled; the GPU hangs in step 6, outside them (heartbeats every 0.2 s)
    exp = RankExporter("fake-nccl", rank, rank, 0, sent.append, sampling=Sampling(2, 4) if stuck else
                       Sampling(STEPS, STEPS), heartbeat_s=0.2 if stuck else 3600, send_every_s=0.05,
                       use_cuda=None if timing == "gpu" else False, nvml=False, tcp_flows=False)
    undo = instrument_distributed(exp)
    if stuck:
        synced = [time.monotonic()]

        def watchdog():
            # Every host blocks at its step's sync once rank 1's GPU hangs: 3 s later, what the exporter
            # sent (records and heartbeats) is written and the process leaves (its threads cannot).
            while time.monotonic() - synced[0] < 3.0:
                time.sleep(0.1)
            nccl_fake.write_sent(f"{out}/rank{rank}.arrow", list(sent), S.CCL_RECORD)
            nccl_fake.write_sent(f"{out}/rank{rank}.hb.arrow", list(sent), S.HEARTBEAT)
            os._exit(0)
        threading.Thread(target=watchdog, daemon=True).start()
    grad = nccl_fake.DeviceTensor(torch.ones(64 * 1024))
    for step in range(STEPS):
        with exp.step(step):
            device.launch(COMPUTE_MS + (LATE_MS if scenario == "late" and rank == 2 else 0.0))
            if stuck and rank == 1 and step == STUCK_AT:
                device.launch(math.inf)  # a kernel that never ends
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
        if stuck:
            synced[0] = time.monotonic()
    exp.close()
    undo()
    undo_fake()
    n = nccl_fake.write_sent(f"{out}/rank{rank}.arrow", sent, S.CCL_RECORD)
    print(f"rank {rank}: {n} records, {exp.stats.errors} errors", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
