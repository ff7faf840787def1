"""Analysis cost per window by job size: the capacity model's CPU-seconds per window (infra/CAPACITY.md).

    .venv/bin/python benchmarks/analysis_cost.py [--gpus 128,512,2048,8192] [--repeat 5] [--ray-nodes 2]

For each job size, one generated 3-step window (TP 8, PP 4 or 8, 2 x PP
microbatches, one straggler; ``generators.fleetgen``) is analysed the way a
shard's analysis task does it (``analyzers.window.analyze_window``: the
what-if simulator, verdicts, remedies, link diagnosis, the result tables).

- **in process**: CPU seconds per window (``time.process_time``), median of
  ``--repeat`` after one warm-up run; ops per CPU-second.
- **on a Ray cluster** (``--ray-nodes N`` > 0; nodes on 127.0.0.1 via
  ``services.ray_cluster``): the same windows as Ray tasks from a driver, as
  the shards submit them. Latency: one window at a time, submit to result,
  median. Throughput: 4 x the cluster's CPUs windows in flight at once,
  windows per second. The difference to the in-process figures is what Ray
  and moving the op table between processes (and nodes) cost.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray_jobs  # noqa: E402,F401  (Ray's loopback setting, before Ray is imported)


def make_window(n_gpus: int, seed: int = 0):
    """(ops, registration, key) of one straggling 3-step window of an ``n_gpus`` job."""
    from core.layout import JobLayout
    from core.registration import Registration
    from generators.fleetgen import generate_window, make_fleet

    tp = 8
    pp = 4 if n_gpus < 1024 else 8
    dp = max(1, n_gpus // (tp * pp))
    spec = make_fleet(1, seed=seed, min_gpus=8, max_gpus=16)[0]
    spec = dataclasses.replace(spec, job_id=f"cost-{n_gpus}", layout=JobLayout(dp, pp, tp), num_microbatches=2 * pp,
                               cause_dp=dp // 2, cause_pp=pp - 1)
    t0 = time.time_ns()
    ops = generate_window(spec, 0, 3, t0)
    info = Registration.from_row(spec.registration(t0, 3).to_pylist()[0])
    return ops, info, (spec.job_id, 0, 0)


def in_process(ops, info, key, repeat: int) -> float:
    from analyzers.window import analyze_window

    analyze_window(ops, info, key, True, "")  # warm: imports, compiled kernels loaded
    cpu = []
    for _ in range(repeat):
        c0 = time.process_time()
        analyze_window(ops, info, key, True, "")
        cpu.append(time.process_time() - c0)
    return statistics.median(cpu)


def on_cluster(address: str, windows: dict, repeat: int) -> dict:
    import ray

    from analyzers.window import analyze_window

    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    task = ray.remote(num_cpus=1, max_retries=2)(analyze_window)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    out = {}
    try:
        burst = 4 * cpus
        for n, (ops, info, key) in windows.items():
            # Warm: every worker started, its imports done and compiled kernels loaded (a burst reaches all).
            ray.get([task.remote(ops, info, key, True, "") for _ in range(burst)])
            lat = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                ray.get(task.remote(ops, info, key, True, ""))
                lat.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ray.get([task.remote(ops, info, key, True, "") for _ in range(burst)])
            out[n] = (statistics.median(lat), burst / (time.perf_counter() - t0))
    finally:
        ray.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="128,512,2048,8192", help="job sizes, comma-separated")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ray-nodes", type=int, default=2, help="nodes of the local Ray cluster; 0 = skip that part")
    ap.add_argument("--cpus-per-node", type=float, default=1)
    ap.add_argument("--object-store-mb", type=int, default=400,
                    help="per node: room for the burst's op tables (a 16k-GPU window's is about 35 MB)")
    args = ap.parse_args()

    sizes = [int(x) for x in args.gpus.split(",") if x.strip()]
    windows = {n: make_window(n) for n in sizes}
    print(f"{'GPUs':>6} {'ops':>10} {'CPU s/window':>13} {'ops per CPU-s':>14} {'windows per CPU-s':>18}")
    local = {}
    for n, (ops, info, key) in windows.items():
        cpu = in_process(ops, info, key, args.repeat)
        local[n] = cpu
        print(f"{n:>6} {ops.num_rows:>10,} {cpu:>13.3f} {ops.num_rows / cpu:>14,.0f} {1 / cpu:>18.1f}", flush=True)
    if args.ray_nodes > 0:
        from services.ray_cluster import LocalRayCluster

        with LocalRayCluster(nodes=args.ray_nodes, cpus_per_node=args.cpus_per_node,
                             object_store_mb=args.object_store_mb) as cluster:
            remote = on_cluster(cluster.address, windows, args.repeat)
        print(f"\nas Ray tasks on {args.ray_nodes} nodes x {args.cpus_per_node:g} CPUs (127.0.0.1):")
        print(f"{'GPUs':>6} {'latency s':>10} {'vs in-process CPU':>18} {'windows/s, all CPUs busy':>25}")
        for n, (lat, rate) in remote.items():
            print(f"{n:>6} {lat:>10.3f} {lat / local[n]:>17.2f}x {rate:>25.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
