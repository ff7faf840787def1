"""One rank of a 2-rank gloo job that hangs: rank 1 arrives 4 s late at the third all-reduce (run by
test_flight_recorder). Heartbeats every 0.3 s, stacks and the Flight Recorder after 1 s in flight; they
are written to ``<out>/rank<r>.hb.arrow``.

    python flight_recorder_worker.py RANK PORT OUT
"""
import sys
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from core import schema as S  # noqa: E402
from ingest.exporter import RankExporter, Sampling  # noqa: E402
from ingest.torch_ccl import instrument_distributed  # noqa: E402


def main(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    sent = []
    exp = RankExporter("fr-job", rank, rank, 0, sent.append, sampling=Sampling(1, 1), heartbeat_s=0.3,
                       hang_dump_s=1.0, use_cuda=False, nvml=False, tcp_flows=False)
    undo = instrument_distributed(exp)
    t = torch.ones(1024)
    for step in range(3):
        with exp.step(step):
            if step == 2 and rank == 1:
                time.sleep(4.0)  # a rank lost in its own work: rank 0 waits inside all-reduce #2
            dist.all_reduce(t)
    exp.close()
    undo()
    rows = [r for tb in sent if tb.schema.equals(S.HEARTBEAT, check_metadata=False) for r in tb.to_pylist()]
    with pa.OSFile(f"{out}/rank{rank}.hb.arrow", "wb") as f, pa.ipc.new_file(f, S.HEARTBEAT) as w:
        w.write_table(pa.Table.from_pylist(rows, schema=S.HEARTBEAT))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
