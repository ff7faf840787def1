"""Drives our NCCL profiler plugin (``ingest/nccl_profiler/plugin.c``) as NCCL would, with no GPU and no NCCL.

The library is loaded with ctypes and its ``ncclProfiler_vN`` struct found by name, as NCCL's loader finds
it; the descriptors below are a second, independent declaration of NCCL's documented layouts (a mismatch
with the C side shows as wrong records). The plugin's clock is pinned by the driver, so every time NCCL
would have seen is chosen here and the records' times are exact.

Run as a script, one process per rank (the plugin's file is per process, as on a real job)::

    python tests/nccl_plugin/driver.py SCENARIO VERSION RANK OUTDIR

prints the plugin's counters as JSON. Scenarios: ``ring`` (a ring all-reduce of 4 ranks on 2 channels
whose rings run opposite ways, link 2 -> 3 four times slower), ``pipeline`` (send/recv between 4 pipeline
stages, 1 -> 2 slow), ``grouped`` (two collectives and a send/recv pair in one group, their proxy ops
interleaved), ``bad`` (calls NCCL should never make), ``overflow`` (more records than the queue holds).
"""
from __future__ import annotations

import ctypes as C
import json
import os
import sys
import time

VERSIONS = (5, 4, 3, 2, 1)
COLL, P2P, PROXY_OP, PROXY_STEP, GROUP, COLL_API = 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 0, 1 << 9
ST_IN_PROGRESS, ST_SEND_GPU_WAIT, ST_SEND_PEER_WAIT, ST_SEND_WAIT = 19, 8, 20, 9
ST_RECV_WAIT, ST_RECV_FLUSH_WAIT, ST_RECV_GPU_WAIT = 10, 11, 12
ST_OP_SEND_TRANSMITTED, ST_OP_SEND_DONE, ST_OP_RECV_RECEIVED, ST_OP_RECV_DONE = 2, 3, 5, 7
US, MB = 1000, 1 << 20
WORLD = 4
STAT_NAMES = ("events", "records", "written", "dropped", "bad_calls", "detached", "untracked", "contexts")


# -- NCCL's documented layouts --------------------------------------------------------------------------

class ProxyOp(C.Structure):
    _fields_ = [("pid", C.c_int), ("channel", C.c_uint8), ("peer", C.c_int), ("n_steps", C.c_int),
                ("chunk_size", C.c_int), ("is_send", C.c_int)]


class ProxyStep(C.Structure):
    _fields_ = [("step", C.c_int)]


class Coll1(C.Structure):
    _fields_ = [("comm_name", C.c_char_p), ("comm_hash", C.c_uint64), ("seq", C.c_uint64), ("func", C.c_uint8),
                ("sendbuf", C.c_void_p), ("recvbuf", C.c_void_p), ("count", C.c_size_t), ("root", C.c_int),
                ("dtype", C.c_uint8), ("op", C.c_uint32), ("traffic", C.c_size_t), ("channels", C.c_uint8),
                ("warps", C.c_uint8), ("algo", C.c_uint8), ("proto", C.c_uint8), ("collnet", C.c_int),
                ("nvls", C.c_int)]


class P2p1(C.Structure):
    _fields_ = [("comm_name", C.c_char_p), ("comm_hash", C.c_uint64), ("func", C.c_uint8), ("buf", C.c_void_p),
                ("dtype", C.c_uint8), ("count", C.c_size_t), ("peer", C.c_int)]


class Coll2(C.Structure):
    _fields_ = [("comm_name", C.c_char_p), ("comm_hash", C.c_uint64), ("seq", C.c_uint64), ("func", C.c_char_p),
                ("sendbuf", C.c_void_p), ("recvbuf", C.c_void_p), ("count", C.c_size_t), ("root", C.c_int),
                ("dtype", C.c_char_p), ("traffic", C.c_size_t), ("channels", C.c_uint8), ("warps", C.c_uint8),
                ("algo", C.c_char_p), ("proto", C.c_char_p)]


class Coll3(C.Structure):  # v2 less its traffic bytes
    _fields_ = [f for f in Coll2._fields_ if f[0] != "traffic"]


class P2p23(C.Structure):
    _fields_ = [("comm_name", C.c_char_p), ("comm_hash", C.c_uint64), ("func", C.c_char_p), ("buf", C.c_void_p),
                ("dtype", C.c_char_p), ("count", C.c_size_t), ("peer", C.c_int)]


class Coll45(C.Structure):
    _fields_ = [("seq", C.c_uint64), ("func", C.c_char_p), ("sendbuf", C.c_void_p), ("recvbuf", C.c_void_p),
                ("count", C.c_size_t), ("root", C.c_int), ("dtype", C.c_char_p), ("channels", C.c_uint8),
                ("warps", C.c_uint8), ("algo", C.c_char_p), ("proto", C.c_char_p), ("parent_group", C.c_void_p)]


class P2p45(C.Structure):
    _fields_ = [("func", C.c_char_p), ("buf", C.c_void_p), ("dtype", C.c_char_p), ("count", C.c_size_t),
                ("peer", C.c_int), ("channels", C.c_uint8), ("parent_group", C.c_void_p)]


def _descr(type_t, coll, p2p):
    class U(C.Union):
        _fields_ = [("coll", coll), ("p2p", p2p), ("proxy_op", ProxyOp), ("proxy_step", ProxyStep)]

    class Descr(C.Structure):
        _anonymous_ = ("u",)
        _fields_ = [("type", type_t), ("parent", C.c_void_p), ("rank", C.c_int), ("u", U)]
    return Descr


DESCR = {1: _descr(C.c_uint8, Coll1, P2p1), 2: _descr(C.c_uint8, Coll2, P2p23), 3: _descr(C.c_uint8, Coll3, P2p23),
         4: _descr(C.c_uint8, Coll45, P2p45), 5: _descr(C.c_uint64, Coll45, P2p45)}


class StateArgs(C.Structure):  # v1-v3's proxyOp {transSize, steps}; v4+'s proxyStep {transSize}
    _fields_ = [("trans_size", C.c_size_t), ("steps", C.c_int)]


INIT_OLD = C.CFUNCTYPE(C.c_int, C.POINTER(C.c_void_p), C.POINTER(C.c_int))
INIT_V4 = C.CFUNCTYPE(C.c_int, C.POINTER(C.c_void_p), C.POINTER(C.c_int), C.c_char_p, C.c_uint64, C.c_int, C.c_int,
                      C.c_int, C.c_void_p)
INIT_V5 = C.CFUNCTYPE(C.c_int, C.POINTER(C.c_void_p), C.c_uint64, C.POINTER(C.c_int), C.c_char_p, C.c_int, C.c_int,
                      C.c_int, C.c_void_p)
START = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(C.c_void_p), C.c_void_p)
STOP = C.CFUNCTYPE(C.c_int, C.c_void_p)
RECORD = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.c_void_p)
FINALIZE = C.CFUNCTYPE(C.c_int, C.c_void_p)


def _profiler(init):
    class Profiler(C.Structure):
        _fields_ = [("name", C.c_char_p), ("init", init), ("start", START), ("stop", STOP), ("record", RECORD),
                    ("finalize", FINALIZE)]
    return Profiler


PROFILER = {1: _profiler(INIT_OLD), 2: _profiler(INIT_OLD), 3: _profiler(INIT_OLD), 4: _profiler(INIT_V4),
            5: _profiler(INIT_V5)}
DTYPE_V1 = {"ncclFloat32": 7, "ncclFloat16": 6, "ncclInt8": 0, "ncclBfloat16": 9}
FUNC_V1 = {"AllReduce": 4, "AllGather": 2, "ReduceScatter": 3, "Send": 6, "Recv": 7}


class Nccl:
    """NCCL's side of the interface, version ``version``: what NCCL 2.23 (v1) ... 2.28+ (v5) would call."""

    def __init__(self, lib_path: str, version: int):
        self.lib = C.CDLL(lib_path)
        self.version = version
        self.p = PROFILER[version].in_dll(self.lib, f"ncclProfiler_v{version}")
        self.Descr = DESCR[version]
        self.lib.stragglerscope_nccl_stats.argtypes = [C.POINTER(C.c_uint64), C.c_int]
        self.lib.stragglerscope_nccl_test_clock.argtypes = [C.c_int64]
        self.lib.stragglerscope_nccl_flush.argtypes = [C.c_int]
        self.lib.stragglerscope_nccl_test_pause_writer.argtypes = [C.c_int]
        self.comm = {}  # context -> (hash, name), for v1-v3 whose calls carry their communicator

    def clock(self, ns: int) -> None:
        self.lib.stragglerscope_nccl_test_clock(ns)

    def stats(self) -> dict[str, int]:
        out = (C.c_uint64 * len(STAT_NAMES))()
        self.lib.stragglerscope_nccl_stats(out, len(STAT_NAMES))
        return dict(zip(STAT_NAMES, out))

    def flush(self) -> bool:
        return bool(self.lib.stragglerscope_nccl_flush(5000))

    def init(self, comm_hash: int, name: str, nranks: int, rank: int) -> tuple[int | None, int]:
        ctx, mask = C.c_void_p(), C.c_int(-1)
        if self.version == 5:
            self.p.init(C.byref(ctx), comm_hash, C.byref(mask), name.encode(), 1, nranks, rank, None)
        elif self.version == 4:
            self.p.init(C.byref(ctx), C.byref(mask), name.encode(), comm_hash, 1, nranks, rank, None)
        else:
            self.p.init(C.byref(ctx), C.byref(mask))
        self.comm[ctx.value] = (comm_hash, name.encode())
        return ctx.value, mask.value

    def start(self, ctx, descr) -> int | None:
        h = C.c_void_p()
        self.p.start(ctx, C.byref(h), C.byref(descr) if descr is not None else None)
        return h.value

    def event(self, etype: int, parent=None, rank: int = 0):
        d = self.Descr()
        d.type, d.parent, d.rank = etype, parent, rank
        return d

    def coll(self, ctx, rank: int, count: int, dtype: str = "ncclFloat32", func: str = "AllReduce", parent=None):
        d = self.event(COLL, parent, rank)
        c = d.coll
        c.count, c.channels, c.root = count, 2, 0
        if self.version == 1:
            c.func, c.dtype = FUNC_V1[func], DTYPE_V1[dtype]
        else:
            c.func, c.dtype, c.algo, c.proto = func.encode(), dtype.encode(), b"RING", b"SIMPLE"
        if self.version <= 3:
            c.comm_hash, c.comm_name = self.comm[ctx]
        return self.start(ctx, d)

    def p2p(self, ctx, rank: int, func: str, peer: int, count: int, dtype: str = "ncclFloat32"):
        d = self.event(P2P, None, rank)
        p = d.p2p
        p.peer, p.count = peer, count
        if self.version == 1:
            p.func, p.dtype = FUNC_V1[func], DTYPE_V1[dtype]
        else:
            p.func, p.dtype = func.encode(), dtype.encode()
        if self.version <= 3:
            p.comm_hash, p.comm_name = self.comm[ctx]
        return self.start(ctx, d)

    def proxy_op(self, ctx, parent, rank: int, channel: int, peer: int, is_send: bool, n_steps: int, pid=None):
        d = self.event(PROXY_OP, parent, rank)
        o = d.proxy_op
        o.pid, o.channel, o.peer, o.n_steps, o.chunk_size, o.is_send = (
            os.getpid() if pid is None else pid), channel, peer, n_steps, MB, int(is_send)
        return self.start(ctx, d)

    def step(self, ctx, op, step: int):
        d = self.event(PROXY_STEP, op)
        d.proxy_step.step = step
        return self.start(ctx, d)

    def state(self, h, state: int, trans_size: int | None = None) -> None:
        args = None if trans_size is None else C.byref(StateArgs(trans_size, 0))
        self.p.record(h, state, args)

    def stop(self, h) -> None:
        self.p.stop(h)

    def finalize(self, ctx) -> None:
        self.p.finalize(ctx)


# -- how NCCL's proxy moves one op, as timed calls ---------------------------------------------------------

def send_op(n: Nccl, at: list, ctx, parent, rank, channel, peer, t0, wire_ns, steps=4, step_bytes=MB,
            credit_ns=20 * US) -> None:
    """A send: its data is ready 50 us in, waits ``credit_ns`` for the receiver's credit, then its steps go on
    the wire at once and complete one per ``wire_ns`` (the path is the limit). Its transfer is steps x
    wire_ns, whatever the version."""
    op = {}
    at.append((t0, lambda: op.setdefault("h", n.proxy_op(ctx, parent, rank, channel, peer, True, steps))))
    if n.version >= 4:
        at.append((t0 + US, lambda: n.state(op["h"], ST_IN_PROGRESS)))
    sent = 0
    for s in range(steps):
        h = {}
        on_wire = t0 + 50 * US + credit_ns + s
        at.append((t0 + 2 * US + s, lambda h=h, s=s: (h.setdefault("h", n.step(ctx, op["h"], s)),
                                                     n.state(h["h"], ST_SEND_GPU_WAIT, 0 if n.version >= 4 else None))))
        if n.version >= 4:
            at.append((t0 + 50 * US + s, lambda h=h: n.state(h["h"], ST_SEND_PEER_WAIT, 0)))
        sent += step_bytes
        at.append((on_wire, lambda h=h, sent=sent: (
            n.state(h["h"], ST_SEND_WAIT, step_bytes if n.version >= 4 else None),
            n.version < 4 and n.state(op["h"], ST_OP_SEND_TRANSMITTED, sent))))
        done = t0 + 50 * US + credit_ns + (s + 1) * wire_ns
        at.append((done, lambda h=h, sent=sent: (n.stop(h["h"]),
                                                 n.version < 4 and n.state(op["h"], ST_OP_SEND_DONE, sent))))
    at.append((t0 + 50 * US + credit_ns + steps * wire_ns + US, lambda: n.stop(op["h"])))


def recv_op(n: Nccl, at: list, ctx, parent, rank, channel, peer, t0, wire_ns, steps=4, step_bytes=MB,
            late_ns=70 * US) -> None:
    """A receive: posted at once; its sender's data lands ``late_ns`` + (s + 1) x wire_ns in."""
    op = {}
    at.append((t0, lambda: op.setdefault("h", n.proxy_op(ctx, parent, rank, channel, peer, False, steps))))
    got = 0
    for s in range(steps):
        h = {}
        at.append((t0 + 2 * US + s, lambda h=h, s=s: h.setdefault("h", n.step(ctx, op["h"], s))))
        at.append((t0 + 3 * US + s, lambda h=h: n.state(h["h"], ST_RECV_WAIT, 0 if n.version >= 4 else None)))
        land = t0 + late_ns + (s + 1) * wire_ns
        got += step_bytes
        at.append((land, lambda h=h, got=got: (
            n.state(h["h"], ST_RECV_FLUSH_WAIT, step_bytes if n.version >= 4 else None),
            n.version < 4 and n.state(op["h"], ST_OP_RECV_RECEIVED, got))))
        at.append((land + 5 * US, lambda h=h: n.state(h["h"], ST_RECV_GPU_WAIT, 0 if n.version >= 4 else None)))
        at.append((land + 10 * US, lambda h=h, got=got: (n.stop(h["h"]),
                                                         n.version < 4 and n.state(op["h"], ST_OP_RECV_DONE, got))))
    at.append((t0 + late_ns + steps * wire_ns + 11 * US, lambda: n.stop(op["h"])))


def run_timeline(n: Nccl, at: list) -> None:
    """The calls in time order (equal times in the order they were planned), the clock pinned at each."""
    for t, fn in sorted(at, key=lambda x: x[0]):
        n.clock(t)
        fn()


# -- scenarios --------------------------------------------------------------------------------------------

RING_HASH, PIPE_HASH = 0x77, 0x99
SLOW_RING = (2, 3)    # the ring's slow path: sender, receiver
SLOW_PIPE = (1, 2)
WIRE_NS, SLOW = 100 * US, 4


def wire(src: int, dst: int, slow: tuple[int, int]) -> int:
    return WIRE_NS * (SLOW if (src, dst) == slow else 1)


def ring(n: Nccl, rank: int, collectives: int = 18) -> None:
    """One rank of a ring all-reduce of 4 ranks on 2 channels whose rings run opposite ways: on channel 0 it
    sends to the next rank and receives from the previous, on channel 1 the reverse. 16 MB in 4 x 1 MB steps
    per channel and peer. Each collective's proxy ops start after the collective was stopped (enqueued), as
    NCCL's host thread does."""
    ctx, mask = n.init(RING_HASH, "", WORLD, rank)
    assert mask & PROXY_STEP and ctx, (ctx, mask)
    nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
    for k in range(collectives):
        t0 = 1_000_000_000 + k * 5_000_000
        n.clock(t0)
        api = n.start(ctx, n.event(COLL_API)) if n.version == 5 else None  # not tracked: no handle
        group = n.start(ctx, n.event(GROUP))
        assert api is None and group is None
        coll = n.coll(ctx, rank, 4 * MB)  # 4M floats: 16 MB
        n.stop(coll)
        at: list = []
        for ch, (to, frm) in enumerate(((nxt, prv), (prv, nxt))):
            send_op(n, at, ctx, coll, rank, ch, to, t0 + 10 * US, wire(rank, to, SLOW_RING))
            recv_op(n, at, ctx, coll, rank, ch, frm, t0 + 10 * US, wire(frm, rank, SLOW_RING))
        run_timeline(n, at)
    n.finalize(ctx)


def pipeline(n: Nccl, rank: int, microbatches: int = 6) -> None:
    """One stage of a 4-stage pipeline: activations sent forward (s -> s+1) and gradients back, 8 MB each in
    one channel; the path 1 -> 2 is slow. Sends and receives are point-to-point calls of the pipeline's
    communicator."""
    ctx, _ = n.init(PIPE_HASH, "pp", WORLD, rank)
    for mb in range(microbatches):
        t0 = 2_000_000_000 + mb * 10_000_000
        n.clock(t0)
        at: list = []
        for peer, is_send in ((rank + 1, True), (rank - 1, False), (rank - 1, True), (rank + 1, False)):
            if not 0 <= peer < WORLD:
                continue
            task = n.p2p(ctx, rank, "Send" if is_send else "Recv", peer, 2 * MB)  # 2M floats: 8 MB
            n.stop(task)
            src, dst = (rank, peer) if is_send else (peer, rank)
            (send_op if is_send else recv_op)(n, at, ctx, task, rank, 0, peer, t0 + 10 * US, wire(src, dst, SLOW_PIPE),
                                              steps=8)
        run_timeline(n, at)
    n.finalize(ctx)


def grouped(n: Nccl, rank: int) -> None:
    """ncclGroupStart; all_reduce 16 MB; all_gather 4 MB; send to the next rank, recv from the previous;
    ncclGroupEnd: every call is started and stopped before any proxy op, then the ops of all of them run
    interleaved (one step each in turn). Two communicators interleaved too: a second one's all-reduce in
    between."""
    ctx, _ = n.init(0xA1, "dp", WORLD, rank)
    other, _ = n.init(0xB2, "tp", 2, rank % 2)
    nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
    t0 = 3_000_000_000
    n.clock(t0)
    a = n.coll(ctx, rank, 4 * MB)
    b = n.coll(ctx, rank, MB, func="AllGather")
    x = n.coll(other, rank % 2, 256 * 1024)
    s = n.p2p(ctx, rank, "Send", nxt, MB)
    r = n.p2p(ctx, rank, "Recv", prv, MB)
    for h in (a, b, x, s, r):
        n.stop(h)
    at: list = []
    send_op(n, at, ctx, a, rank, 0, nxt, t0 + 10 * US, 100 * US)
    send_op(n, at, ctx, b, rank, 1, nxt, t0 + 11 * US, 200 * US, steps=1)
    send_op(n, at, other, x, rank % 2, 0, 1 - rank % 2, t0 + 12 * US, 50 * US, steps=1)
    send_op(n, at, ctx, s, rank, 2, nxt, t0 + 13 * US, 300 * US)
    recv_op(n, at, ctx, r, rank, 2, prv, t0 + 14 * US, 300 * US)
    run_timeline(n, at)
    n.finalize(other)
    n.finalize(ctx)


def bad(n: Nccl, rank: int) -> None:
    """Everything NCCL should never do, and PXN's ops from another process: none of it may crash, hang or
    write a record it should not."""
    pid = os.getpid()
    n.clock(4_000_000_000)
    ctx, _ = n.init(0xC3, "bad", 2, 0)
    for h in (None, 0x1234, 0xDEADBEEF00000001, (1 << 60) | (8191 << 32) | 7, (2 << 60) | 5, (3 << 60) | 9):
        n.stop(h)                                   # stop with no start
        n.state(h, ST_SEND_WAIT, 1)                 # a state change of no event
    assert n.start(ctx, n.event(1 << 20)) is None   # unknown event types
    assert n.start(ctx, n.event(0x7F)) is None
    n.start(ctx, None)                              # NULL descriptor
    n.p.start(ctx, None, C.byref(n.event(COLL)))    # NULL handle pointer
    assert n.start(None, n.event(COLL)) is None     # NULL and foreign contexts
    assert n.start(0x1000, n.event(COLL)) is None
    assert n.proxy_op(ctx, None, 0, 0, 1, True, 1) is None          # a proxy op without a call
    coll = n.coll(ctx, 0, 1024)
    assert n.proxy_op(ctx, coll, 0, 0, 1, True, 1, pid=pid + 1) is None  # PXN: another process's
    op = n.proxy_op(ctx, coll, 0, 0, 1, True, 2)
    st = n.step(ctx, op, 0)
    n.state(st, ST_SEND_WAIT, None)                 # NULL state arguments
    n.state(st, 999, 7)                             # an unknown state
    n.stop(st)
    n.stop(st)                                      # stopped twice
    n.state(st, ST_SEND_WAIT, 1)                    # a state change on a finished step
    assert n.step(ctx, st, 1) is None               # a step whose parent is a step
    n.stop(op)                                      # one record
    n.stop(op)                                      # and no second one
    n.state(op, ST_IN_PROGRESS)
    assert n.step(ctx, op, 1) is None               # a step of a finished op
    n.stop(coll)
    n.stop(coll)
    # Finalize with events open, then NCCL (wrongly) goes on with them: the open op still ends in a record
    # while another communicator keeps the writer running, the finalized context starts nothing.
    keep, _ = n.init(0xD4, "keep", 2, 0)
    open_op = n.proxy_op(ctx, coll, 0, 1, 1, False, 1)
    open_step = n.step(ctx, open_op, 0)
    n.finalize(ctx)
    n.finalize(ctx)                                 # twice
    assert n.coll(ctx, 0, 1024) is None
    n.state(open_step, ST_RECV_FLUSH_WAIT, 4096)
    n.stop(open_step)
    n.stop(open_op)
    n.finalize(None)
    n.finalize(0x1000)
    # A child forked now (a data loader's worker) that exits as a program does, destructors and all: it has
    # no writer thread to join and must not write to this process's file.
    child = os.fork()
    if child == 0:
        n.stop(n.proxy_op(keep, coll, 0, 0, 1, True, 1))
        n.finalize(keep)
        sys.exit(0)
    for _ in range(1000):
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(child, 9)
        raise AssertionError("a forked child hung at exit")
    assert os.waitstatus_to_exitcode(status) == 0, status
    n.flush()
    n.finalize(keep)


def overflow(n: Nccl, rank: int) -> None:
    """The writer held while 20,000 ops finish: the queue (16,384) fills, the rest are dropped and counted,
    NCCL's calls never wait; released, the writer writes what it holds and a drops record."""
    n.lib.stragglerscope_nccl_test_pause_writer(1)  # before init: the communicator's record waits too
    ctx, _ = n.init(0xE5, "flood", 2, 0)
    n.clock(5_000_000_000)
    coll = n.coll(ctx, 0, 1024)
    for _ in range(20_000):
        n.stop(n.proxy_op(ctx, coll, 0, 0, 1, True, 1))
    n.lib.stragglerscope_nccl_test_pause_writer(0)
    n.flush()
    n.finalize(ctx)


SCENARIOS = {"ring": ring, "pipeline": pipeline, "grouped": grouped, "bad": bad, "overflow": overflow}


def main(argv: list[str]) -> None:
    scenario, version, rank, outdir = argv[0], int(argv[1]), int(argv[2]), argv[3]
    os.environ["STRAGGLERSCOPE_NCCL_PEERS_DIR"] = outdir  # the plugin reads it when NCCL first inits it
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    from ingest.nccl_profiler import library_path

    n = Nccl(str(library_path()), version)
    assert n.p.name == b"stragglerscope"
    SCENARIOS[scenario](n, rank)
    print(json.dumps({"pid": os.getpid(), **n.stats()}))


if __name__ == "__main__":
    main(sys.argv[1:])
