"""One prepared GPU validation run (issue 53, item 4): five checks of the telemetry path on one real GPU, one table.

Each check runs in a child process of its own under its own time limit, so a check that fails, hangs in
NCCL or runs out of time becomes a FAILED row with its reason and the other checks still run:

  plugin    our NCCL profiler plugin (ingest/nccl_profiler) loaded by a real NCCL through
            NCCL_PROFILER_PLUGIN, in a one-rank NCCL process group, and its file read back with
            ingest/nccl_peers.py. World size 1 because NCCL refuses two ranks on one GPU ("Duplicate GPU
            detected"). A one-rank communicator has no peer, so NCCL runs no proxy operation and the
            plugin writes its communicator record only: the row says so. Per-peer times on real links
            are NOT checked by this run (that needs two GPUs and a network).
  timing    the exporter's CUDA-event timing (RankExporter + instrument_distributed, as `stragglerscope
            trace` arms them) of a collective (an out-of-place all-gather: a 2 GiB copy in a one-rank
            group) and of an op span (a chain of bf16 matmuls), against hand-placed torch.cuda.Event
            pairs around the same calls: relative error per step.
  overhead  step time of a small training loop (8 bf16 Linear layers, AdamW, the loss and a flattened
            gradient bucket all-reduced every step, the loss read with .item()), bare and under the
            exporter at 10% sampling (10 of every 100 steps) with its collective wrappers, NVML
            heartbeats and TCP flow reads on; rounds alternate the order. Target: mean step time
            +0.3% at most (the mean, not the median: the sampled steps are the slow tenth).
  nvml      NVML samples (SM and memory clocks, power and its limit, temperature) read directly under
            load and in the exporter's heartbeats, each checked to be in a sane range.
  mfu       MFU of a Linear stack from analyzers/mfu.py (the 6 x params rule, core.gpus' peak for the
            device's name) against the FLOPs torch's FlopCounterMode counts, over the same measured
            step times.

--dry-run (no GPU: CI, a developer's machine) runs every check's code on CPU and says that the device
checks were skipped: the plugin built and loaded with ctypes, ncclProfiler_v1..v5 present and each driven
by tests/nccl_plugin/driver.py, its file read back with ingest/nccl_peers.py; the exporter on CPU at 10%
sampling in a gloo group; NVML absent (the row says why); the MFU arithmetic; the table; and the
BENCHMARKS.md section writer, into a temporary copy (the real BENCHMARKS.md is never touched). Its rows
are DRY or SKIPPED: nothing is measured.

The device command (one call of the device tool; the whole run stays under 8 minutes, --total-s 420):

    run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_validation.py --out $OUT", carry=["ingest/nccl_profiler/_build"], timeout_s=480)

then here, on the gpu_validation.json it brings back (the device's own copy of BENCHMARKS.md does not
come back, so --write-benchmarks is run here):

    .venv/bin/python benchmarks/gpu_validation.py --from-results FILES_AT/gpu_validation.json --write-benchmarks

Why not `make setup` there: the device machine reaches no package index, so infra/local/setup.sh cannot
pip-install the project, and .venv (CPU torch, hundreds of MB, Python 3.11) is neither carriable (64 MiB)
nor the right build. The image's own python3 (3.12, with CUDA torch, numpy, pyarrow and nvidia-ml-py) runs
the script from the source tree: the checks import nothing else of outside the project. The plugin is
built there with gcc where the image has one; otherwise the library built here by `make setup` is used,
which travels only because `carry` names it (ingest/nccl_profiler/_build is git-ignored; it needs glibc
2.34 or later). None of this has been tried on a device yet.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import hashlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file by the device image's python3, with no install of the project
    sys.path.insert(0, str(ROOT))

BENCHMARKS = ROOT / "BENCHMARKS.md"
BEGIN = "<!-- gpu-validation:begin -->"
END = "<!-- gpu-validation:end -->"
RESULTS_NAME = "gpu_validation.json"

# (name, seconds on a GPU, seconds in the dry run). The GPU budgets add up to 390 s, so with the parent's
# own start and the children's torch imports the run ends inside --total-s (420) and the device call's
# 8 minutes. Each includes its child's start (torch import, CUDA and NCCL initialisation).
CHECKS = (("plugin", 60, 40), ("timing", 60, 40), ("overhead", 180, 40), ("nvml", 30, 30), ("mfu", 60, 40))

OVERHEAD_TARGET = 0.003      # the exporter's cost at 10% sampling, mean step time (issue 53)
TIMING_TARGET = 0.005        # |median relative error| of recorded vs hand-placed event pairs
MFU_TARGET = 0.01            # analyzers/mfu.py against counted FLOPs over the same times


def _log(check: str, msg: str) -> None:
    print(f"    {check}: {msg}", file=sys.stderr, flush=True)


# -- the checks (each runs in its own child process) ---------------------------------------------------

class _HostEvent:
    """A CPU stand-in for torch.cuda.Event in the dry run: the same record() / elapsed pairing."""

    __slots__ = ("t",)

    def record(self) -> None:
        self.t = time.perf_counter_ns()


def _elapsed_ns(a, b) -> int:
    if isinstance(a, _HostEvent):
        return b.t - a.t
    return int(a.elapsed_time(b) * 1e6)


class _Sink:
    """The exporter's sink: keeps every table by kind. With ``encode`` a thread encodes each table as the
    producer's sender thread does (Arrow IPC + zstd, core.codec), so the overhead measured includes that
    CPU work; nothing is sent anywhere (no broker in this run)."""

    def __init__(self, encode: bool = False):
        from core import schema as S

        self._kind_of = S.kind_of
        self.tables: dict[str, list] = collections.defaultdict(list)
        self.encoded_bytes = 0
        self._q = None
        if encode:
            import queue

            self._q = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._encode_loop, name="gpuval-encode", daemon=True)
            self._thread.start()

    def __call__(self, table) -> None:
        self.tables[self._kind_of(table.schema)].append(table)
        if self._q is not None:
            self._q.put(table)

    def _encode_loop(self) -> None:
        from core import codec

        while (t := self._q.get()) is not None:
            self.encoded_bytes += len(codec.encode(t))

    def close(self) -> None:
        if self._q is not None:
            self._q.put(None)
            self._thread.join(30)

    def rows(self, kind: str) -> list[dict]:
        import pyarrow as pa

        got = self.tables.get(kind)
        return pa.concat_tables(got).to_pylist() if got else []


def _torch(dry: bool):
    import torch

    cuda = not dry
    if dry:
        # One thread: torch's default of one per core only fights the other processes of a small shared
        # machine (CI's two cores), and the dry run's figures mean nothing anyway.
        torch.set_num_threads(1)
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch (run with --dry-run where there is none)")
    return torch, cuda, torch.device("cuda", 0) if cuda else torch.device("cpu")


def _env_info(torch, cuda: bool) -> dict:
    if not cuda:
        return dict(device="cpu (dry run)", torch=torch.__version__)
    nccl = ""
    with contextlib.suppress(Exception):
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda or "",
                nccl=nccl)


def _init_group(torch, cuda: bool) -> None:
    """A one-rank process group on an in-memory store (no port, no network): NCCL on the GPU, gloo on CPU.
    On the GPU, ``device_id`` makes torch create the NCCL communicator now rather than at the first call."""
    import torch.distributed as dist

    store = dist.HashStore()
    if not cuda:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        return
    try:
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    except TypeError:  # a torch without device_id: the communicator is then made at the first collective
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)


def _plugin_library() -> tuple[Path, str]:
    """The plugin's library, built here if it can be; else one built elsewhere and carried (the device image
    may have no gcc), whatever its age. Raises when there is neither."""
    from ingest import nccl_profiler as npf

    try:
        return npf.build(), "built here, or already built from the current source"
    except (npf.BuildError, OSError, subprocess.SubprocessError) as e:
        found = [p for p in npf._candidates() if p.exists()]
        if not found:
            raise RuntimeError(f"plugin not built and none carried: {e}") from e
        return found[0], f"not rebuilt here ({str(e).splitlines()[0][:120]}); using the carried {found[0].name}"


def _plugin_symbols(lib: Path) -> list[int]:
    """Load the library as NCCL does (dlopen) and find each ncclProfiler_vN struct by name, as NCCL's loader
    does with dlsym; each must carry our plugin's name. Returns the versions found (all five, or raises)."""
    import ctypes

    from tests.nccl_plugin.driver import PROFILER, VERSIONS

    handle = ctypes.CDLL(str(lib))
    for v in VERSIONS:
        try:
            name = PROFILER[v].in_dll(handle, f"ncclProfiler_v{v}").name
        except ValueError as e:
            raise RuntimeError(f"ncclProfiler_v{v} is not exported by {lib.name}: {e}") from e
        if name != b"stragglerscope":
            raise RuntimeError(f"ncclProfiler_v{v}.name is {name!r}")
    return sorted(VERSIONS)


def _read_plugin_file(path: Path) -> dict:
    """Count the records of one plugin file by kind, and read it once more through PeerTimingFeed (the path
    the exporter takes), which must find every record and none bad."""
    import numpy as np

    from ingest.nccl_peers import KIND_COMM, KIND_DROPS, KIND_P2P_OP, KIND_PROXY_OP, RECORD, PeerTimingFeed

    recs = np.frombuffer(path.read_bytes(), RECORD)
    feed = PeerTimingFeed(str(path))
    feed.poll()
    comm = recs[recs["kind"] == KIND_COMM]
    return dict(records=len(recs), comm=len(comm), proxy=int((recs["kind"] == KIND_PROXY_OP).sum()),
                p2p=int((recs["kind"] == KIND_P2P_OP).sum()), drops=int((recs["kind"] == KIND_DROPS).sum()),
                comms=[dict(hash=hex(int(r["comm_hash"])), rank=int(r["rank"]), nranks=int(r["nranks"]),
                            name=r["name"].split(b"\0")[0].decode("utf-8", "replace")) for r in comm],
                feed_records=feed.stats.records, feed_bad=feed.stats.bad_records)


def check_plugin(a) -> dict:
    lib, how = _plugin_library()
    versions = _plugin_symbols(lib)
    _log("plugin", f"library {lib} ({how}); ncclProfiler_v{versions[0]}..v{versions[-1]} exported")
    if a.dry_run:
        return _plugin_driven(a, lib, how)
    return _plugin_in_nccl(a, lib, how)


def _plugin_driven(a, lib: Path, how: str) -> dict:
    """Dry run: the test driver calls the plugin as NCCL would (one rank of its 4-rank ring, 18 collectives
    on 2 channels: 72 proxy ops and 1 communicator record), under every interface version."""
    from tests.nccl_plugin.driver import RING_HASH

    driver = ROOT / "tests" / "nccl_plugin" / "driver.py"
    seen = []
    for v in (5, 4, 3, 2, 1):
        out = Path(a.work) / f"peers-v{v}"
        done = subprocess.run([sys.executable, str(driver), "ring", str(v), "0", str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"driver (v{v}) exited {done.returncode}: {done.stderr.strip()[-300:]}")
        stats = json.loads(done.stdout.strip().splitlines()[-1])
        files = list(out.glob("nccl-peers-*.bin"))
        if len(files) != 1:
            raise RuntimeError(f"v{v}: expected one plugin file in {out}, found {[f.name for f in files]}")
        got = _read_plugin_file(files[0])
        want_hash = hex(RING_HASH)
        if (got["comm"], got["proxy"], got["feed_records"], got["feed_bad"], stats["dropped"]) != (1, 72, 73, 0, 0) \
                or got["comms"][0]["hash"] != want_hash:
            raise RuntimeError(f"v{v}: unexpected records {got}, plugin counters {stats}")
        seen.append(v)
    return dict(status="DRY", result=f"v1..v5 exported; driven v{','.join(map(str, seen))}: 1 comm + 72 proxy "
                                     "records each, read back by nccl_peers",
                target="plugin loaded by NCCL, its comm record read",
                notes=f"no NCCL here: the test driver called the plugin as NCCL would ({how})")


def _plugin_in_nccl(a, lib: Path, how: str) -> dict:
    """On the GPU: NCCL loads the plugin for a one-rank communicator; a few collectives; the file read."""
    import ctypes

    from ingest.nccl_profiler import arm
    from tests.nccl_plugin.driver import STAT_NAMES

    peers = Path(a.work) / "peers"
    # Set before NCCL makes its first communicator, which is when it reads them. Armed as `stragglerscope
    # trace` arms a rank; a carried library older than its source is refused there, and set by hand here.
    why = arm(os.environ, str(peers))
    if why:
        os.environ.update(NCCL_PROFILER_PLUGIN=str(lib), STRAGGLERSCOPE_NCCL_PEERS_DIR=str(peers))
        how += f"; armed by hand ({why[:100]})"
    else:
        how += "; armed by ingest.nccl_profiler.arm"
    # NCCL's own account of loading (or not loading) the plugin, into a file: it is quoted in the row.
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="ALL", NCCL_DEBUG_FILE=str(Path(a.work) / "nccl-debug.log"))
    torch, cuda, dev = _torch(False)
    import torch.distributed as dist

    info = _env_info(torch, True)
    _init_group(torch, True)
    x = torch.ones(1 << 20, device=dev)
    out = torch.empty_like(x)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    for _ in range(4):
        dist.all_reduce(x)
        gather(out, x)
    dist.barrier()
    torch.cuda.synchronize()
    # NCCL dlopen'ed the library by this path: ctypes gets the same handle, so these are NCCL's counters.
    handle = ctypes.CDLL(str(lib))
    handle.stragglerscope_nccl_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
    handle.stragglerscope_nccl_flush.argtypes = [ctypes.c_int]
    handle.stragglerscope_nccl_flush(5000)
    buf = (ctypes.c_uint64 * len(STAT_NAMES))()
    handle.stragglerscope_nccl_stats(buf, len(STAT_NAMES))
    stats = dict(zip(STAT_NAMES, buf))
    dist.destroy_process_group()  # NCCL finalizes the plugin: its writer drains and closes the file
    said = []
    with contextlib.suppress(OSError):
        for f in Path(a.work).glob("nccl-debug.log*"):
            said += [ln.strip() for ln in f.read_text(errors="replace").splitlines() if "profiler" in ln.lower()]
    said_s = ("NCCL said: " + " / ".join(s[-140:] for s in said[:2])) if said else "NCCL logged no profiler line"
    files = list(peers.glob(f"nccl-peers-{os.getpid()}.bin"))
    if not files:
        return dict(status="FAILED", result="no plugin file: NCCL did not load the plugin or made no communicator",
                    target="plugin loaded by NCCL, its comm record read",
                    notes=f"NCCL {info.get('nccl')}; plugin counters {stats}; {said_s}", env=info)
    got = _read_plugin_file(files[0])
    ok = got["comm"] >= 1 and got["feed_bad"] == 0 and got["feed_records"] == got["records"] and \
        any(c["rank"] == 0 and c["nranks"] in (0, 1) for c in got["comms"])
    proxy_note = ("0 proxy ops, as expected: a one-rank communicator has no peer, so NCCL runs no proxy op; "
                  "per-peer link times are not checked by this run") if got["proxy"] == 0 else \
        f"{got['proxy']} proxy ops recorded (not expected of one rank: worth a look)"
    return dict(status="PASS" if ok else "FAILED",
                result=f"NCCL {info.get('nccl')}: {got['comm']} comm record(s) {got['comms']}, "
                       f"{got['proxy']} proxy, {got['p2p']} p2p; plugin saw {stats['events']} events, "
                       f"wrote {stats['written']}, dropped {stats['dropped']}",
                target="plugin loaded by NCCL, its comm record read",
                notes=f"{proxy_note}. {said_s}. Library {how}", env=info)


def _rel_stats(xs: list[float]) -> dict:
    return dict(n=len(xs), median=statistics.median(xs), max_abs=max(map(abs, xs))) if xs else dict(n=0)


def check_timing(a) -> dict:
    torch, cuda, dev = _torch(a.dry_run)
    import torch.distributed as dist

    from ingest.exporter import RankExporter, Sampling
    from ingest.torch_ccl import instrument_distributed

    info = _env_info(torch, cuda)
    _init_group(torch, cuda)
    sink = _Sink()
    exp = RankExporter("gpuval-timing", 0, 0, 0, sink, sampling=Sampling(1, 1), heartbeat_s=3600, use_cuda=cuda,
                       nvml=False, tcp_flows=False, port_counters=False)
    undo = instrument_distributed(exp)
    # 2 GiB of float32 on the GPU: a copy of about a millisecond, long beside the microsecond between two
    # event records; 1 MiB on CPU (the dry run checks the pairing, not the figure).
    inp = torch.ones((1 << 29) if cuda else (1 << 18), device=dev)
    out = torch.empty_like(inp)  # world size 1: the gathered output is the input's size
    m = 4096 if cuda else 96
    w = torch.randn(m, m, device=dev, dtype=torch.bfloat16 if cuda else torch.float32) / m ** 0.5
    event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else _HostEvent
    steps, drop = (25, 3) if cuda else (12, 2)
    hand: list[tuple[int, list]] = []
    for step in range(steps):
        if time.time() > a.deadline - 15:
            _log("timing", f"stopping at step {step}: the check's time is nearly spent")
            break
        with exp.step(step):
            if cuda:
                # Queued work ahead of the timed calls: the GPU is busy when their events are recorded, so
                # the events run back to back as the GPU reaches them, not at the host's record times.
                busy = w
                for _ in range(8):
                    busy = busy @ w
            h = [event() for _ in range(4)]
            h[0].record()
            # Looked up on the module at the call: the wrapped function (all_gather_single where torch has
            # it: all_gather_into_tensor is deprecated there).
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp)
            h[1].record()
            h[2].record()
            with exp.op("forward-compute"):
                y = w
                for _ in range(20 if cuda else 8):
                    y = y @ w
            h[3].record()
        if cuda:
            torch.cuda.synchronize()
        hand.append((step, h))
    exp.close()
    undo()
    dist.destroy_process_group()
    ccl = {r["step"]: r["exit_ns"] - r["enter_ns"] for r in sink.rows("ccl_record")
           if r["op"] in ("all_gather_single", "all_gather_into_tensor")}
    ops = {r["step"]: r["duration_ns"] for r in sink.rows("op_span") if r["optype"] == "forward-compute"}
    coll_err, op_err, coll_ms, op_ms = [], [], [], []
    for step, h in hand:
        if step < drop:
            continue
        hc, ho = _elapsed_ns(h[0], h[1]), _elapsed_ns(h[2], h[3])
        if step in ccl and hc > 0:
            coll_err.append(ccl[step] / hc - 1)
            coll_ms.append(hc / 1e6)
        if step in ops and ho > 0:
            op_err.append(ops[step] / ho - 1)
            op_ms.append(ho / 1e6)
    c, o = _rel_stats(coll_err), _rel_stats(op_err)
    if not c["n"] or not o["n"]:
        return dict(status="FAILED", result=f"recorded spans matched: collective {c['n']}, op {o['n']} of "
                                            f"{len(hand) - drop} steps",
                    target=f"|median| <= {TIMING_TARGET:.1%}",
                    notes=f"exporter errors {exp.stats.errors}; collective rows {len(ccl)}, op rows {len(ops)}",
                    env=info)
    result = (f"collective {c['median']:+.3%} median, {c['max_abs']:.3%} max (n={c['n']}, hand "
              f"{statistics.median(coll_ms):.3f} ms); op span {o['median']:+.3%} median, {o['max_abs']:.3%} max "
              f"(n={o['n']}, hand {statistics.median(op_ms):.3f} ms)")
    met = abs(c["median"]) <= TIMING_TARGET and abs(o["median"]) <= TIMING_TARGET
    notes = ("recorded = the exporter's event pair inside the wrapper, hand = torch.cuda.Event pair around the "
             "call" if cuda else "host clock on CPU: the CUDA-event path did not run, the figure means nothing")
    return dict(status=("PASS" if met else "MISS") if cuda else "DRY", result=result,
                target=f"|median| <= {TIMING_TARGET:.1%}", notes=notes + f"; exporter errors {exp.stats.errors}",
                env=info)


def check_overhead(a) -> dict:
    torch, cuda, dev = _torch(a.dry_run)
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors

    from ingest.exporter import RankExporter, Sampling
    from ingest.torch_ccl import instrument_distributed

    info = _env_info(torch, cuda)
    _init_group(torch, cuda)
    d, layers, tokens = (4096, 8, 16384) if cuda else (64, 3, 32)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(d, d, bias=False),
                                                                      torch.nn.ReLU())]).to(dev, dtype)
    params = list(model.parameters())
    if cuda:
        opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
        opt_step = opt.step
    else:
        # Any torch.optim class imports torch._dynamo on creation (about 7 s on a busy two-core machine,
        # most of the dry run's time): on CPU a plain SGD update stands in, the step's shape unchanged.
        def opt_step():
            with torch.no_grad():
                torch._foreach_add_(params, [p.grad for p in params], alpha=-1e-5)
    x = torch.randn(tokens, d, device=dev, dtype=dtype)
    null = contextlib.nullcontext()

    def loop(exp, n: int) -> list[float]:
        """``n`` training steps; each step's host time from the end of the one before (what a job sees)."""
        op = exp.op if exp is not None else (lambda name: null)
        times = []
        t_prev = time.perf_counter()
        for i in range(n):
            with exp.step(i) if exp is not None else null:
                with op("forward-compute"):
                    loss = model(x).float().square().mean()
                with op("backward-compute"):
                    loss.backward()
                # A data-parallel job's two kinds of collective (one gradient bucket, the logged loss),
                # looked up on the module each time: wrapped while the exporter is armed.
                dist.all_reduce(_flatten_dense_tensors([p.grad for p in params]))
                total = loss.detach()
                dist.all_reduce(total)
                with op("optimizer"):
                    opt_step()
                    for p in params:  # zeroed in place, as zero_grad(set_to_none=False)
                        p.grad.zero_()
                total.item()  # waits for the GPU: the step is done
            now = time.perf_counter()
            times.append(now - t_prev)
            t_prev = now
        return times

    calib = loop(None, 20)  # warm-up too: cuBLAS handles, the optimizer's state, NCCL's first calls
    step_s = statistics.median(calib[5:])
    rounds = 3 if cuda else 2
    left = a.deadline - time.time() - 20  # kept for closing exporters and the report
    # Runs of 10 warm-up steps and then 100k measured ones: steps 10..110k-1 hold exactly k sampled
    # windows of 10 (the exporter samples steps 100j..100j+9), so the mean is that of 10% sampling.
    k = max(1, min(5 if cuda else 1, int(left * 0.8 / (2 * rounds * 110 * step_s))))
    n = 10 + 100 * k
    _log("overhead", f"step {step_s * 1e3:.2f} ms; {rounds} rounds of bare / 10% sampling, {n} steps each")
    runs: dict[str, list[list[float]]] = {"bare": [], "10%": []}
    sink = _Sink(encode=True)
    stats = []
    for r in range(rounds):
        for mode in (("bare", "10%") if r % 2 == 0 else ("10%", "bare")):  # neither always first
            if mode == "bare":
                runs[mode].append(loop(None, n)[10:])
            else:
                # As `stragglerscope trace` arms a rank: NVML heartbeats (every 2 s), TCP flow reads and
                # the collective wrappers on; op spans at 10 of every 100 steps.
                exp = RankExporter("gpuval-overhead", 0, 0, 0, sink, sampling=Sampling(10, 100), use_cuda=cuda)
                undo = instrument_distributed(exp)
                try:
                    runs[mode].append(loop(exp, n)[10:])
                finally:
                    undo()
                    exp.close()
                stats.append(exp.stats)
            _log("overhead", f"round {r + 1} {mode:>4}: mean {statistics.mean(runs[mode][-1]) * 1e3:.3f} ms, "
                             f"median {statistics.median(runs[mode][-1]) * 1e3:.3f} ms")
    sink.close()
    dist.destroy_process_group()
    bare = [s for run in runs["bare"] for s in run]
    inst = [s for run in runs["10%"] for s in run]
    mean_ovh = statistics.mean(inst) / statistics.mean(bare) - 1
    med_ovh = statistics.median(inst) / statistics.median(bare) - 1
    bare_means = [statistics.mean(run) for run in runs["bare"]]
    spread = (max(bare_means) - min(bare_means)) / statistics.median(bare_means)
    per_round = [statistics.mean(i) / statistics.mean(b) - 1 for i, b in zip(runs["10%"], runs["bare"])]
    hb = sink.rows("heartbeat")
    sampled_hb = sum(1 for h in hb if h["gpu_sm_mhz"] > 0)
    ops = sum(s.ops for s in stats)
    ccl = sum(s.ccl for s in stats)
    errors = sum(s.errors for s in stats)
    result = (f"mean step {mean_ovh:+.3%} ({statistics.mean(bare) * 1e3:.2f} -> {statistics.mean(inst) * 1e3:.2f} "
              f"ms), median {med_ovh:+.3%}; per round {', '.join(f'{p:+.2%}' for p in per_round)}; "
              f"bare rounds spread {spread:.2%}")
    notes = (f"{len(bare)} + {len(inst)} steps, {d}x{d} x{layers} Linear, {tokens} tokens/step; exported "
             f"{ops} op spans, {ccl} collective records, {len(hb)} heartbeats ({sampled_hb} with NVML samples), "
             f"{sink.encoded_bytes / 1e6:.1f} MB encoded, no broker; exporter errors {errors}")
    if not cuda:
        return dict(status="DRY", result=result, target=f"mean step <= +{OVERHEAD_TARGET:.1%}",
                    notes="CPU, gloo, no NVML: the loop and the exporter ran, the figure means nothing; " + notes,
                    env=info)
    if spread > OVERHEAD_TARGET:
        notes += "; the bare rounds alone spread more than the target: the figure is within noise"
    return dict(status="PASS" if mean_ovh <= OVERHEAD_TARGET and errors == 0 else "MISS", result=result,
                target=f"mean step <= +{OVERHEAD_TARGET:.1%}", notes=notes, env=info)


def _sane_sample(s) -> list[str]:
    """What is out of range in an NVML sample (empty when all is sane). Wide bounds: any datacenter GPU."""
    bad = []
    if not 100 <= s.sm_mhz <= 3500:
        bad.append(f"SM clock {s.sm_mhz} MHz")
    if not 100 <= s.mem_mhz <= 20000:
        bad.append(f"memory clock {s.mem_mhz} MHz")
    if not 50 <= s.power_limit_w <= 2000:
        bad.append(f"power limit {s.power_limit_w} W")
    if not 0 < s.power_w <= 1.2 * max(s.power_limit_w, 1):
        bad.append(f"power {s.power_w} W")
    if not 5 <= s.temp_c <= 105:
        bad.append(f"temperature {s.temp_c} C")
    return bad


def check_nvml(a) -> dict:
    from ingest.nvml import GpuSample, NvmlSampler

    sampler = NvmlSampler()
    first = sampler.sample()
    if first is None:
        # The range rules still run, on made-up samples (one sane, one not), so the dry run covers them.
        good = GpuSample(1980, 3201, 650.0, 700.0, 45, "", 0, 0)
        assert not _sane_sample(good) and _sane_sample(GpuSample(0, 0, -1.0, 0.0, 200, "", -1, -1))
        return dict(status="SKIPPED" if a.dry_run else "FAILED",
                    result=f"no NVML sample: {sampler.unavailable or 'no reason given'}",
                    target="clocks, power, temperature in range",
                    notes="exporter heartbeats then carry -1 (NO_SAMPLE); range rules checked on made-up samples"
                    + ("; device check skipped (dry run)" if a.dry_run else ""),
                    env=dict(device="cpu (dry run)") if a.dry_run else {})
    if a.dry_run:  # NVML answered, but the dry run puts no load on a GPU: the one sample is all it checks
        bad = _sane_sample(first)
        return dict(status="FAILED" if bad else "DRY", result=f"one sample, no load: {first}",
                    target="clocks, power, temperature in range",
                    notes=("out of range: " + "; ".join(bad)) if bad else "device check under load skipped (dry run)",
                    env=dict(device="cpu (dry run)"))
    torch, cuda, dev = _torch(False)
    from ingest.exporter import RankExporter

    info = _env_info(torch, cuda)
    w = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    # About a second of queued matmuls (async), sampled as the GPU works through them: the clocks and the
    # power under load, not idle.
    for _ in range(600):
        w2 = w @ w
    samples = [first]
    for _ in range(8):
        time.sleep(0.1)
        samples.append(sampler.sample())
    torch.cuda.synchronize()
    del w2
    samples = [s for s in samples if s is not None]
    bad = sorted({b for s in samples for b in _sane_sample(s)})
    sink = _Sink()
    exp = RankExporter("gpuval-nvml", 0, 0, 0, sink, heartbeat_s=0.25, use_cuda=True, tcp_flows=False,
                       port_counters=False)
    time.sleep(1.3)
    exp.close()
    hb = sink.rows("heartbeat")
    in_hb = [h for h in hb if h["gpu_sm_mhz"] > 0]
    top = max(samples, key=lambda s: s.power_w)
    result = (f"{len(samples)} samples under load: SM up to {max(s.sm_mhz for s in samples)} MHz, memory "
              f"{top.mem_mhz} MHz, power up to {top.power_w:.0f} of {top.power_limit_w:.0f} W, "
              f"{max(s.temp_c for s in samples)} C; {len(in_hb)} of {len(hb)} exporter heartbeats carried one")
    ok = not bad and in_hb
    return dict(status="PASS" if ok else "FAILED", result=result, target="clocks, power, temperature in range",
                notes=("out of range: " + "; ".join(bad)) if bad else
                (f"throttle reasons seen: {sorted({s.throttle for s in samples if s.throttle}) or 'none'}"
                 + ("" if in_hb else "; no heartbeat carried a sample")), env=info)


def check_mfu(a) -> dict:
    torch, cuda, dev = _torch(a.dry_run)
    from torch.utils.flop_counter import FlopCounterMode

    from analyzers.mfu import flops_per_step, window_mfu
    from core.gpus import peak_flops_of

    info = _env_info(torch, cuda)
    d, layers, tokens = (4096, 8, 16384) if cuda else (128, 3, 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(d, d, bias=False),
                                                                      torch.nn.ReLU())]).to(dev, dtype)
    # The input wants its gradient (as any block but a model's first does): every layer's backward then
    # computes both its input's and its weight's gradient, and 6 x params x tokens is the exact count.
    x = torch.randn(tokens, d, device=dev, dtype=dtype, requires_grad=True)
    params = sum(p.numel() for p in model.parameters())

    def step():
        model(x).float().square().mean().backward()
        for p in model.parameters():
            p.grad = None
        x.grad = None

    with FlopCounterMode(display=False) as counter:  # the matmuls' FLOPs as torch dispatches them
        step()
    counted = counter.get_total_flops()
    event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else _HostEvent
    pairs = []
    for i in range(25 if cuda else 8):
        e0, e1 = event(), event()
        e0.record()
        step()
        e1.record()
        if i >= 3:  # warm-up left out
            pairs.append((e0, e1))
    if cuda:
        torch.cuda.synchronize()
    times = [_elapsed_ns(e0, e1) / 1e9 for e0, e1 in pairs]
    name = info["device"]
    # No CPU is in core.gpus' table: the dry run registers a nominal peak to run the same arithmetic.
    peak = peak_flops_of(name) if cuda else 1e12
    reg = dict(params=params, tokens_per_step=tokens, n_gpus=1, gpu_type=name if cuda else "",
               peak_flops=0 if cuda else peak)
    if peak <= 0:
        return dict(status="FAILED", result=f"no peak FLOP/s for {name!r} in core.gpus",
                    target=f"|analyzer / direct - 1| <= {MFU_TARGET:.0%}", notes="", env=info)
    mfu, _ = window_mfu(reg, len(times), times, times)
    achieved = counted * len(times) / sum(times)
    direct = achieved / peak
    flops_rel = flops_per_step(reg) / counted - 1
    rel = mfu / direct - 1
    result = (f"analyzer {mfu:.4f} vs counted {direct:.4f} ({rel:+.3%}); 6 x params vs FlopCounter "
              f"{flops_rel:+.3%}; {achieved / 1e12:.3g} TFLOP/s of {peak / 1e12:.0f} peak")
    ok = abs(rel) <= MFU_TARGET and 0 < mfu <= 1
    notes = (f"{layers} x Linear({d}, {d}), {tokens} tokens, {len(times)} timed steps (forward and backward, "
             f"{'CUDA events' if cuda else 'host clock'}), "
             f"{counted / 1e12:.2f} TFLOP per step counted")
    if not cuda:
        return dict(status="DRY", result=result, target=f"|analyzer / direct - 1| <= {MFU_TARGET:.0%}",
                    notes="CPU, nominal 1 TFLOP/s peak: the arithmetic ran, the MFU means nothing; " + notes,
                    env=info)
    return dict(status="PASS" if ok else "MISS", result=result,
                target=f"|analyzer / direct - 1| <= {MFU_TARGET:.0%}", notes=notes, env=info)


CHECK_FUNCS = {"plugin": check_plugin, "timing": check_timing, "overhead": check_overhead, "nvml": check_nvml,
               "mfu": check_mfu}


def run_child(a) -> int:
    """One check, in this process; its row goes to ``a.result`` as JSON (an exception becomes a FAILED row:
    the parent's table always gets one)."""
    t0 = time.time()
    try:
        row = CHECK_FUNCS[a.child](a)
    except Exception as e:
        traceback.print_exc()
        row = dict(status="FAILED", result=f"{type(e).__name__}: {e}"[:400], target="", notes="traceback above")
    row["seconds"] = round(time.time() - t0, 1)
    Path(a.result).write_text(json.dumps(row, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # NCCL's and the exporter's threads are done with; a hung interpreter shutdown must not eat the budget.
    os._exit(0)


# -- the driver ---------------------------------------------------------------------------------------

def _run_check(name: str, budget: float, a, work: Path) -> dict:
    """Start the check's child, wait at most ``budget`` seconds, and turn whatever happened into a row."""
    result = work / f"{name}.json"
    log = work / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--result", str(result),
           "--work", str(work / name), "--deadline", str(time.time() + budget)]
    if a.dry_run:
        cmd.append("--dry-run")
    (work / name).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    # The child's stdout (NCCL's and torch's chatter) goes to a file; its stderr (the check's progress and
    # any traceback) to ours. A session of its own, so a timeout kills the child and anything it started.
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=None, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = p.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return dict(status="FAILED", result=f"timed out after {budget:.0f} s (its budget); killed", target="",
                        notes=_tail(log))
    if result.exists():
        return json.loads(result.read_text())
    return dict(status="FAILED", result=f"the check's process exited {rc} without a result", target="",
                notes=_tail(log))


def _tail(path: Path, n: int = 300) -> str:
    with contextlib.suppress(OSError):
        text = path.read_text(errors="replace").strip()
        return ("its output ended: " + text[-n:].replace("\n", " / ")) if text else "it printed nothing"
    return ""


def _cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def render_table(rows: list[dict]) -> str:
    """The rows as one Markdown table (printed, and what goes into BENCHMARKS.md)."""
    lines = ["| check | status | result | target | notes | s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k, "")) for k in ("check", "status", "result", "target", "notes",
                                                                       "seconds")) + " |")
    return "\n".join(lines)


def render_section(res: dict) -> str:
    """The BENCHMARKS.md section of one run: when, on what, the command, the table, what the statuses mean."""
    env = res.get("env", {})
    what = ", ".join(f"{k} {env[k]}" for k in ("torch", "cuda", "nccl") if env.get(k))
    head = (f"### Last run: {res['date']} on {env.get('device', 'an unknown device')}" + (f" ({what})" if what else "")
            + (" — DRY RUN, no device: not a measurement" if res.get("dry") else ""))
    return "\n".join([
        head, "", f"    {res['command']}", "", render_table(res["rows"]), "",
        f"{res['total_s']:.0f} s of the {res['budget_s']:.0f} s budget. PASS: target met; MISS: ran, target not "
        "met; FAILED: did not complete (its reason given); SKIPPED: not possible here; DRY: the code path ran on "
        "CPU, nothing was measured.",
    ])


def replace_section(text: str, section: str) -> str:
    """``text`` with the part between the markers replaced by ``section`` (the markers kept); without
    markers, a new section with them is appended. Broken markers (one without the other, twice, in the
    wrong order) raise: a hand edit is not overwritten by guess."""
    nb, ne = text.count(BEGIN), text.count(END)
    if nb == ne == 0:
        return text.rstrip("\n") + f"\n\n## One prepared GPU validation run (issue 53)\n\n{BEGIN}\n{section}\n{END}\n"
    i, j = text.find(BEGIN), text.find(END)
    if nb != 1 or ne != 1 or j < i:
        raise ValueError(f"the markers {BEGIN} / {END} are broken ({nb} and {ne} found): fix them by hand")
    return text[:i + len(BEGIN)] + "\n" + section + "\n" + text[j:]


def write_benchmarks(path: Path, section: str) -> None:
    new = replace_section(path.read_text(), section)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new)
    os.replace(tmp, path)  # never half a file, should this be killed mid-write


def _writer_dry_check(section: str, work: Path) -> dict:
    """The section writer on temporary copies of BENCHMARKS.md: written, written again (replaced, not
    added), the rest of the file unchanged; and on a copy without markers (appended). The real file is
    compared by hash before and after."""
    t0 = time.time()
    real_before = hashlib.sha256(BENCHMARKS.read_bytes()).hexdigest()
    copy = work / "BENCHMARKS.md"
    shutil.copyfile(BENCHMARKS, copy)
    original = copy.read_text()
    write_benchmarks(copy, section)
    write_benchmarks(copy, section + "\n(second write)")
    got = copy.read_text()
    problems = []
    if got.count(BEGIN) != 1 or got.count(END) != 1 or "(second write)" not in got or got.count(section) != 1:
        problems.append("a second write did not replace the first")
    outside = lambda t: t[:t.find(BEGIN)] + t[t.find(END):] if BEGIN in t else t  # noqa: E731
    if BEGIN in original and outside(got) != outside(original):
        problems.append("text outside the markers changed")
    bare = work / "no-markers.md"
    bare.write_text(original.replace(BEGIN, "").replace(END, ""))
    write_benchmarks(bare, section)
    if bare.read_text().count(BEGIN) != 1 or section not in bare.read_text():
        problems.append("no section appended where there were no markers")
    if hashlib.sha256(BENCHMARKS.read_bytes()).hexdigest() != real_before:
        problems.append("the real BENCHMARKS.md changed")
    return dict(check="benchmarks-writer", status="FAILED" if problems else "DRY",
                result="; ".join(problems) if problems else
                "section written into a temporary copy, replaced in place on a second write, appended where "
                "markers were missing; text outside the markers unchanged",
                target="", notes=f"the real BENCHMARKS.md untouched (copy: {copy})",
                seconds=round(time.time() - t0, 1))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="gpu_validation.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: run every check's code on CPU, skip the device, write BENCHMARKS.md's section "
                        "into a temporary copy only")
    p.add_argument("--write-benchmarks", action="store_true",
                   help="write the table, command, date and device into BENCHMARKS.md between the gpu-validation "
                        "markers (replacing the last run's); ignored with --dry-run")
    p.add_argument("--benchmarks", type=Path, default=BENCHMARKS, help="the file --write-benchmarks writes")
    p.add_argument("--out", type=Path, help="also write gpu_validation.json and gpu_validation.md here ($OUT on "
                                            "the device machine)")
    p.add_argument("--from-results", type=Path, metavar="JSON",
                   help="run nothing: print (and with --write-benchmarks write) the table of a saved run")
    p.add_argument("--only", type=lambda s: [c for c in s.split(",") if c], default=[],
                   help="a comma-separated subset of: " + ",".join(c for c, *_ in CHECKS))
    p.add_argument("--total-s", type=float, default=420.0,
                   help="the whole run's time budget in seconds (default 420: the device call's 8 minutes less "
                        "a margin); each check also has its own")
    p.add_argument("--child", choices=list(CHECK_FUNCS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return run_child(a)
    unknown = set(a.only) - set(CHECK_FUNCS)
    if unknown:
        p.error(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECK_FUNCS)}")

    if a.from_results:
        res = json.loads(a.from_results.read_text())
        print(render_section(res))
        if a.write_benchmarks:
            if res.get("dry"):
                p.error("a dry run's results are not written to BENCHMARKS.md")
            write_benchmarks(a.benchmarks, render_section(res))
            print(f"\nwrote the GPU validation section of {a.benchmarks}")
        return 1 if any(r["status"] == "FAILED" for r in res["rows"]) else 0

    start = time.time()  # the budget counts the import below too
    deadline = start + a.total_s
    if not a.dry_run:
        import torch  # only asks whether a device is there; the checks' own processes use it

        if not torch.cuda.is_available():
            print("no CUDA device here: run with --dry-run (or on the device machine, see --help)", file=sys.stderr)
            return 2
    todo = [(c, dry if a.dry_run else gpu) for c, gpu, dry in CHECKS if not a.only or c in a.only]
    print(f"GPU validation{' (DRY RUN: no device; device checks skipped)' if a.dry_run else ''}: "
          f"{len(todo)} checks, {a.total_s:.0f} s budget", flush=True)
    rows: list[dict] = []
    env: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpuval-") as tmp:
        work = Path(tmp)
        for i, (name, budget) in enumerate(todo, 1):
            budget = min(budget, deadline - time.time() - 5)
            if budget < 10:
                row = dict(status="FAILED", result="not run: the run's time budget was spent", target="", notes="")
            else:
                print(f"[{i}/{len(todo)}] {name}: running (at most {budget:.0f} s)", flush=True)
                row = _run_check(name, budget, a, work)
            row["check"] = name
            env = env or {k: v for k, v in (row.pop("env", None) or {}).items() if v}
            row.pop("env", None)
            rows.append(row)
            print(f"[{i}/{len(todo)}] {name}: {row['status']} in {row.get('seconds', '?')} s: {row['result']}",
                  flush=True)
        res = dict(version=1, date=datetime.date.today().isoformat(), dry=a.dry_run, env=env or
                   dict(device="cpu (dry run)" if a.dry_run else "unknown"), budget_s=a.total_s,
                   command=shlex.join(["python3", "benchmarks/gpu_validation.py", *argv]), rows=rows,
                   total_s=time.time() - start)
        if a.dry_run:
            rows.append(_writer_dry_check(render_section(res), work))
            res["total_s"] = time.time() - start
        section = render_section(res)
        print("\n" + section, flush=True)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / RESULTS_NAME).write_text(json.dumps(res, indent=1, default=str))
            (a.out / "gpu_validation.md").write_text(section + "\n")
        if a.dry_run:
            print("\nDRY RUN: no device check ran. DRY rows ran their code on CPU and measured nothing; the "
                  "BENCHMARKS.md section went into a temporary copy only.")
        elif a.write_benchmarks:
            write_benchmarks(a.benchmarks, section)
            print(f"\nwrote the GPU validation section of {a.benchmarks}")
    return 1 if any(r["status"] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
