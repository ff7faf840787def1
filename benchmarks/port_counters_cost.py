"""What sampling a host's fabric port counters costs on the exporter's heartbeat thread (issue 53, item 3).

    .venv/bin/python benchmarks/port_counters_cost.py [--devices 8] [--ports 1] [--samples 500]

A fake sysfs tree laid out as on a GPU host (``--devices`` mlx5 NICs of ``--ports`` ports, each with the IB
counters and mlx5's hw_counters) on tmpfs when /dev/shm exists, so the figure is the Python side: the files
opened, read and parsed, the differences, and the PORT_COUNTER table built as the exporter builds it. A real
driver's read can cost more (mlx5 asks its firmware for some counters): the sampler's duty cycle caps that
(ingest/port_counters.py, MAX_DUTY). Medians; divide by the heartbeat period for a share of a core.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def tree(root: str, devices: int, ports: int) -> None:
    from ingest.port_counters import COUNTER_FILES, HW_COUNTERS

    for d in range(devices):
        for p in range(1, ports + 1):
            base = os.path.join(root, f"mlx5_{d}", "ports", str(p))
            for sub, names in (("counters", list(COUNTER_FILES) + ["port_xmit_packets", "port_rcv_packets"]),
                               ("hw_counters", HW_COUNTERS)):
                os.makedirs(os.path.join(base, sub), exist_ok=True)
                for i, name in enumerate(names):
                    Path(base, sub, name).write_text(f"{10**9 + i}\n")
            Path(base, "state").write_text("4: ACTIVE\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--ports", type=int, default=1)
    ap.add_argument("--samples", type=int, default=500)
    args = ap.parse_args()

    from core import codec
    from core import schema as S
    from ingest.port_counters import PortCounterSampler

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as root:
        tree(root, args.devices, args.ports)
        s = PortCounterSampler(root, clock=iter(range(0, 1 << 62, 10**10)).__next__)  # never backing off
        s.sample()
        files = sum(len(p.counters) + len(p.hw) + 1 for p in s._ports)
        cpu, table_cpu = [], []
        ident = dict(job_id="j", attempt=0, rank=0, host="h", ts_ns=0)
        for _ in range(args.samples):
            t0 = time.thread_time_ns()
            rows = s.sample()
            t1 = time.thread_time_ns()
            codec.from_rows(S.PORT_COUNTER, [dict(r, **ident) for r in rows])
            t2 = time.thread_time_ns()
            cpu.append(t1 - t0)
            table_cpu.append(t2 - t0)
    read, whole = statistics.median(cpu) / 1e6, statistics.median(table_cpu) / 1e6
    print(f"{len(rows)} ports, {files} files a sample ({'tmpfs' if base else 'tmp'}), {args.samples} samples")
    print(f"reading and differences: {read:.3f} ms of CPU a sample ({1000 * read / files:.1f} us a file)")
    print(f"with the PORT_COUNTER table: {whole:.3f} ms a sample; at one heartbeat every 2 s "
          f"{100 * whole / 2000:.3f}% of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
