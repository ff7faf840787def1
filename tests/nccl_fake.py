"""A fake CUDA device with NCCL's semantics: the exporter's GPU path and the link diagnosis without a GPU.

What matters of a GPU here, and what this fake does in real time:
- one stream per process, run in order by a device thread: ``launch(ms)`` queues a kernel that keeps the
  stream busy for ``ms``; the host thread only queues and goes on (it runs ahead of the GPU);
- events (``module.Event``, what ``torch.cuda.Event`` offers the exporter) mark a stream position: they
  complete when the device thread passes them, ``synchronize`` waits for that, ``elapsed_time`` is the
  time between two completed ones, and a pending one raises as CUDA does;
- a collective on device tensors returns at once, as NCCL's calls do; it runs on the stream when the
  stream reaches it, through the real gloo collective of the job's process group, so it completes only
  when every member's stream reached it (a late rank holds up its peers) and takes as long as the real
  network does; ``link_delay`` stands in for a slow directed link (extra time on one pair's transfers);
- a kernel that never ends (``launch(math.inf)``) is a rank stuck on its GPU.

``install(device)`` puts the fake collectives in torch.distributed where NCCL's would be; the real
instrumentation (``ingest.torch_ccl``) then wraps them as it wraps any backend.
"""
from __future__ import annotations

import math
import queue
import threading
import time
import types
from typing import Any, Callable


def write_sent(path: str, tables: list, schema) -> int:
    """The tables of ``schema`` among ``tables`` (what an exporter sent), as one Arrow IPC file at ``path``;
    returns its rows. The fake-device workers hand their records to the tests this way."""
    import pyarrow as pa

    rows = [r for t in tables if t.schema.equals(schema, check_metadata=False) for r in t.to_pylist()]
    table = pa.Table.from_pylist(rows, schema=schema) if rows else schema.empty_table()
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    return table.num_rows


ACK_TAG = 7919
"""Tag of a receiver's acknowledgement of a transfer (the job's own tags are left to it)."""


class FakeDevice:
    def __init__(self) -> None:
        self._work: queue.Queue = queue.Queue()
        self.module = types.SimpleNamespace(Event=lambda enable_timing=False, blocking=False: FakeEvent(self),
                                            is_available=lambda: True, synchronize=self.synchronize)
        self._thread = threading.Thread(target=self._run, name="fake-gpu-stream", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> None:
        """Queue ``fn`` on the stream (it runs on the device thread, after everything queued before it)."""
        self._work.put(fn)

    def launch(self, ms: float) -> None:
        """A kernel busy for ``ms`` (forever for ``math.inf``)."""
        if math.isinf(ms):
            self.submit(threading.Event().wait)
        else:
            self.submit(lambda: time.sleep(ms / 1000))

    def synchronize(self) -> None:
        ev = FakeEvent(self)
        ev.record()
        ev.synchronize()

    def _run(self) -> None:
        while True:
            self._work.get()()


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.done = threading.Event()
        self.at_ns: int | None = None

    def record(self, stream=None) -> None:
        self.device.submit(self._reached)

    def _reached(self) -> None:
        self.at_ns = time.perf_counter_ns()
        self.done.set()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait()

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.done.is_set() and end.done.is_set()):
            raise RuntimeError("CUDA error: device not ready")
        return (end.at_ns - self.at_ns) / 1e6


class DeviceTensor:
    """A tensor on the fake device: its data a CPU tensor the stream's collectives work on."""

    def __init__(self, data) -> None:
        self.data = data
        self.device = types.SimpleNamespace(type="cuda", index=0)

    def numel(self) -> int:
        return self.data.numel()

    def element_size(self) -> int:
        return self.data.element_size()


class FakeWork:
    """What an async NCCL call returns: ``wait()`` orders the current stream after the collective (one
    stream here: already so) and returns at once; ``is_completed`` asks the stream."""

    def __init__(self, device: FakeDevice) -> None:
        self._done = FakeEvent(device)
        self._done.record()

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return self._done.query()


def install(device: FakeDevice, rank: int,
            link_delay: dict[tuple[int, int], float] | None = None) -> Callable[[], None]:
    """Fake NCCL ``all_reduce``, ``isend`` and ``irecv`` on device tensors (others go to the real ones);
    returns a function that puts the real ones back. ``link_delay``: (src, dst) -> extra ms of each transfer
    src -> dst (both ends wait for it, as both wait for a slow link)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    real = {n: getattr(c10d, n) for n in ("all_reduce", "isend", "irecv")}
    delays = link_delay or {}

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not isinstance(tensor, DeviceTensor):
            return real["all_reduce"](tensor, op, group, async_op)
        device.submit(lambda: real["all_reduce"](tensor.data, op, group))
        return FakeWork(device) if async_op else None

    def p2p(name: str, src_of: Callable[[int], tuple[int, int]]):
        def call(tensor, peer=None, group=None, tag=0):
            if not isinstance(tensor, DeviceTensor):
                return real[name](tensor, peer, group, tag)
            extra = delays.get(src_of(peer), 0.0)

            def transfer():
                # An ungrouped send or receive: a kernel that completes when the data is across, on both
                # ends (NCCL's send waits for its receiver; gloo's returns once the data is buffered, so the
                # receiver acknowledges it).
                real[name](tensor.data, peer, group, tag).wait()
                ack = torch.zeros(1)
                if name == "isend":
                    real["irecv"](ack, peer, group, ACK_TAG).wait()
                else:
                    real["isend"](ack, peer, group, ACK_TAG).wait()
                time.sleep(extra / 1000)
            device.submit(transfer)
            return FakeWork(device)
        call.__name__ = name
        return call

    fakes = {"all_reduce": all_reduce, "isend": p2p("isend", lambda dst: (rank, dst)),
             "irecv": p2p("irecv", lambda src: (src, rank))}
    for name, fn in fakes.items():
        setattr(c10d, name, fn)
        setattr(dist, name, fn)

    def undo() -> None:
        for name, fn in real.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
    return undo
