"""Wrap ``torch.distributed`` collectives and point-to-point calls into CCL records, transparently.

``instrument_distributed(exporter)`` replaces the communication functions of
``torch.distributed`` (and of ``torch.distributed.distributed_c10d``, where
torch's own code looks them up) with wrappers, and returns a function that
restores them. A wrapper names the group (``world``, ``ranks:0-3`` or
``p2p:a>b``), numbers the call within its group (the sequence number that lets
the hang detector see who never entered collective n), counts the bytes, tells
the exporter the op is in flight, calls the original and records the exit.
Async calls (``isend``, ``irecv``, ``batch_isend_irecv``, ``async_op=True``)
record their exit when the returned work is waited on (or found completed).
On CUDA tensors (NCCL), where every call returns at once, the record's enter
and exit are GPU events on the calling stream: before the call (the GPU
reached it) and at its exit or ``wait()`` (the stream then waits for the
collective), resolved off the training thread (``RankExporter.gpu_mark``).
The functional collectives (``torch.distributed._functional_collectives``,
what DTensor and tensor parallelism call) are wrapped too; their exit is the
first wait on the ``AsyncCollectiveTensor`` they return.

Transparency is the contract, because frameworks inspect these objects:
- a wrapper compares equal to (and hashes like) the function it wraps, and the
  module globals are replaced too, so ``P2POp(dist.isend, ...)``'s check
  ``op in [isend, irecv]`` and ``batch_isend_irecv``'s ``op.op is isend`` hold
  (``torch.distributed.pipelining`` and Megatron's batched p2p rely on both);
- an async result is a ``torch.distributed.Work`` subclass that forwards
  every call to the real work, so ``isinstance(w, dist.Work)`` holds;
- a call made by a wrapped call (``all_gather_into_tensor`` calls
  ``all_gather_single``) is not recorded twice;
- nothing of ours is ever raised: a failing record is counted in
  ``exporter.stats.errors``, logged once, and the collective's own result and
  exceptions pass through untouched.

``observer`` (optional) sees every recorded ``Call``: ``on_enter`` on the
calling thread, ``on_exit`` where it completed, and ``on_blocked(call, ns)``
for the time a thread spent blocked in it (a synchronous call, or ``wait()``).
The automatic instrumentation uses it to turn pipeline transfers and
data-parallel collectives into op spans, and to take the time a compute span
spent waiting for other ranks out of its compute.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import time
from typing import Any, Callable

from core.layout import fold_ranks
from ingest.exporter import RankExporter

log = logging.getLogger(__name__)

# Every tensor collective of torch.distributed. The object collectives (all_gather_object, ...) are
# not listed: they call these, and are recorded through them.
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_coalesced",
               "all_gather_single", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "barrier", "monitored_barrier")
P2P = ("send", "recv", "isend", "irecv")
# Functional collectives (torch.distributed._functional_collectives: DTensor, tensor parallelism): they
# reach the process group in C++, past every function above. Each returns an AsyncCollectiveTensor that
# waits on first use; that wait is the call's exit.
FUNCTIONAL = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
              "all_gather_into_tensor_coalesced", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
              "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd", "broadcast")


@dataclasses.dataclass(slots=True)
class Call:
    """One recorded communication call, as the observer sees it."""

    op: str
    group: str
    ranks: list[int]
    seq: int
    nbytes: int
    peers: list[int]
    enter_ns: int            # job clock
    enter_perf_ns: int       # time.perf_counter_ns, for spans the observer cuts
    tensor: Any = None       # the call's first tensor (observers match P2P ops by it)
    is_p2p: bool = False
    is_send: bool = False
    is_async: bool = False
    note: Any = None         # the observer's own state for this call
    via: list[int] | None = None  # a P2P call's process group (its ranks), None for the default group
    gpu_enter: Any = None    # on device tensors: where the GPU reached the call (exporter.gpu_mark)


def _nbytes(x: Any) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    try:
        return int(x.numel() * x.element_size())
    except (AttributeError, TypeError, RuntimeError):
        return 0


def _device_type(x: Any) -> str | None:
    """The device type of a tensor (or of a list's first): "cpu", "cuda" (NCCL's: its calls return before
    the collective runs), or None for anything else."""
    if isinstance(x, (list, tuple)):
        return _device_type(x[0]) if x else None
    return getattr(getattr(x, "device", None), "type", None)


def _on_device(x: Any) -> bool:
    return _device_type(x) == "cuda"


def _on_cpu(x: Any) -> bool:
    return _device_type(x) == "cpu"


class TracedFunction:
    """Stands in for one torch.distributed function: calls ``impl``, compares equal to the original."""

    def __init__(self, original: Callable, impl: Callable):
        functools.update_wrapper(self, original)
        self.__wrapped__ = original
        self._impl = impl

    def __call__(self, *args, **kwargs):
        return self._impl(*args, **kwargs)

    def __eq__(self, other) -> bool:
        if isinstance(other, TracedFunction):
            return other.__wrapped__ is self.__wrapped__
        return other is self.__wrapped__

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __repr__(self) -> str:
        return f"<traced {getattr(self.__wrapped__, '__name__', self.__wrapped__)!r}>"


def _work_class():
    import torch.distributed as dist

    no_future: set[type] = set()

    class TimedWork(dist.Work):
        """A ``dist.Work`` that forwards to the real one and records its op's exit once it is done.

        Done is the first of: the work's future completing (CPU work, where the future is plain:
        the real end of a send that nobody waits on at once), ``wait()`` returning, or
        ``is_completed()`` saying so.
        """

        def __init__(self, work, on_done: Callable[[], None], cpu: bool = False,
                     on_blocked: Callable[[int], None] | None = None):
            super().__init__()
            self._ss_work = work
            self._ss_on_done = on_done
            self._ss_on_blocked = on_blocked
            self._ss_lock = threading.Lock()
            if cpu and type(work) not in no_future:
                try:
                    work.get_future().add_done_callback(lambda _fut: self._ss_done())
                except Exception:  # no future for this kind of work (gloo send/recv): wait() records the exit
                    no_future.add(type(work))  # and not asked again: the C++ exception costs ~0.1 ms

        def _ss_done(self) -> None:
            with self._ss_lock:
                cb, self._ss_on_done = self._ss_on_done, None
            if cb is not None:
                cb()

        def wait(self, *args, **kwargs):
            t0 = time.perf_counter_ns()
            out = self._ss_work.wait(*args, **kwargs)
            if self._ss_on_blocked is not None:
                self._ss_on_blocked(time.perf_counter_ns() - t0)
            self._ss_done()
            return out

        def is_completed(self):
            done = self._ss_work.is_completed()
            if done:
                self._ss_done()
            return done

        def __getattr__(self, name):
            # Only reached for names that neither this class nor Work has: the real work's own.
            try:
                work = self.__dict__["_ss_work"]
            except KeyError:
                raise AttributeError(name) from None
            return getattr(work, name)

    # Work's inherited methods would act on this empty shell: each one forwards to the real work.
    # (Forwarders, not a __getattribute__ override: that would put every attribute read, our own
    # included, through Python on the training thread.)
    def forwarder(name: str):
        def forward(self, *args, **kwargs):
            return getattr(self._ss_work, name)(*args, **kwargs)
        forward.__name__ = name
        return forward

    for name in dir(dist.Work):
        raw = inspect.getattr_static(dist.Work, name)
        if name.startswith("__") or name in vars(TimedWork) or isinstance(raw, (staticmethod, classmethod)) \
                or not callable(raw):
            continue  # ours, dunders, and static methods (Work.unbox) stay as they are
        setattr(TimedWork, name, forwarder(name))
    return TimedWork


def _param_index(fn: Callable, name: str) -> int | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) if name in params else None


def instrument_distributed(exporter: RankExporter, observer: Any = None) -> Callable[[], None]:
    """Wrap torch.distributed for ``exporter``; returns a function that undoes it."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    TimedWork = _work_class()
    seqs: dict[str, int] = {}
    names: dict[Any, tuple[str, list[int]]] = {}
    local = threading.local()  # .depth: >0 inside a wrapped call (its inner calls are not recorded)
    local.depth = 0
    warned: set[str] = set()
    pending_batch: list | None = None  # done-callbacks of p2p ops coalesced into one batch (NCCL)

    def failed(where: str, e: BaseException) -> None:
        exporter.stats.errors += 1
        if where not in warned:
            warned.add(where)
            log.warning("stragglerscope: %s failed, record dropped (logged once): %r", where, e)

    def group_of(group) -> tuple[str, list[int]]:
        key = None if group is None or group is dist.group.WORLD else group
        got = names.get(key)
        if got is None:
            ranks = list(range(dist.get_world_size())) if key is None else list(dist.get_process_group_ranks(group))
            got = names[key] = ("world" if key is None else f"ranks:{fold_ranks(ranks)}", ranks)
        return got

    def next_seq(name: str) -> int:
        seqs[name] = seqs.get(name, -1) + 1
        return seqs[name]

    def enter(call: Call) -> Call:
        exporter.ccl_enter(call.op, call.group, call.ranks, call.seq)
        if _on_device(call.tensor):
            call.gpu_enter = exporter.gpu_mark(call.op, call.group, call.seq)
        if observer is not None:
            observer.on_enter(call)
        return call

    def begin(fname: str, gname: str, ranks: list[int], tensor: Any, is_async: bool) -> Call:
        """A collective's record, entered: its sequence number in the group, bytes and peers."""
        me = dist.get_rank()
        return enter(Call(fname, gname, ranks, next_seq(gname), _nbytes(tensor), [r for r in ranks if r != me],
                          exporter.now_ns(), time.perf_counter_ns(), tensor, is_async=is_async))

    def make_done(call: Call) -> Callable[[], None]:
        def done():
            try:
                exporter.ccl_exit(call.op, call.group, call.ranks, call.seq, call.enter_ns, call.nbytes, call.peers,
                                  gpu_enter=call.gpu_enter)
                if observer is not None:
                    observer.on_exit(call)
            except Exception as e:
                failed("recording a collective's exit", e)
        return done

    def finish(call: Call | None, out: Any, is_async: bool) -> Any:
        """Record ``call``'s exit now, or when its async work is done; returns what the caller gets."""
        if call is None:
            return out
        try:
            done = make_done(call)
            if not is_async:
                done()
                if observer is not None:
                    observer.on_blocked(call, time.perf_counter_ns() - call.enter_perf_ns)
                return out
            if out is None:  # coalesced into a batch: its works complete the op
                if pending_batch is not None:
                    pending_batch.append(done)
                else:
                    done()
                return out
            blocked = None if observer is None else functools.partial(observer.on_blocked, call)
            # Completion times matter in profiled steps only; elsewhere wait() is exact enough.
            return TimedWork(out, done, cpu=exporter.profiling and _on_cpu(call.tensor), on_blocked=blocked)
        except Exception as e:
            failed("wrapping an async work", e)
            return out

    def run(orig: Callable, args, kwargs):
        local.depth = getattr(local, "depth", 0) + 1
        try:
            return orig(*args, **kwargs)
        except BaseException:
            exporter.ccl_failed()  # torch raised: the call is not in flight (nor recorded as done)
            raise
        finally:
            local.depth -= 1

    def wrap_collective(fname: str, orig: Callable) -> TracedFunction:
        g_idx = _param_index(orig, "group")
        a_idx = _param_index(orig, "async_op")
        # Where the op's payload is: the input tensor(s), which for the *_single/_into_tensor/_tensor
        # forms and all_to_all is the second argument.
        t_idx = 1 if fname in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce_scatter",
                               "all_gather", "all_gather_coalesced") else 0

        def impl(*args, **kwargs):
            if getattr(local, "depth", 0):
                return orig(*args, **kwargs)
            call = None
            try:
                group = kwargs.get("group", args[g_idx] if g_idx is not None and len(args) > g_idx else None)
                is_async = bool(kwargs.get("async_op", args[a_idx] if a_idx is not None and len(args) > a_idx
                                           else False))
                call = begin(fname, *group_of(group), args[t_idx] if len(args) > t_idx else None, is_async)
            except Exception as e:  # never in training's way
                failed(f"recording {fname}", e)
                call, is_async = None, False
            out = run(orig, args, kwargs)
            return finish(call, out, is_async)
        return TracedFunction(orig, impl)

    def wrap_p2p(fname: str, orig: Callable) -> TracedFunction:
        is_send = fname in ("send", "isend")
        is_async = fname.startswith("i")
        peer_arg, gpeer_arg = ("dst", "group_dst") if is_send else ("src", "group_src")

        def impl(tensor, *args, **kwargs):
            if getattr(local, "depth", 0):
                return orig(tensor, *args, **kwargs)
            call = None
            try:
                peer = kwargs.get(peer_arg, args[0] if args else None)
                group = kwargs.get("group", args[1] if len(args) > 1 else None)
                if peer is None and kwargs.get(gpeer_arg) is not None:
                    peer = dist.get_global_rank(group, kwargs[gpeer_arg])
                me = dist.get_rank()
                a, b = (me, peer) if is_send else (peer, me)
                gname = f"p2p:{a}>{b}"
                # The group a transfer names tells which pipeline it belongs to (Megatron passes its
                # pipeline group): the observer reads its direction from the stages' order in it.
                via = None if group is None or group is dist.group.WORLD else group_of(group)[1]
                call = enter(Call(fname, gname, [a, b], next_seq(gname + (":s" if is_send else ":r")),
                                  _nbytes(tensor), [peer], exporter.now_ns(), time.perf_counter_ns(), tensor,
                                  is_p2p=True, is_send=is_send, is_async=is_async, via=via))
            except Exception as e:
                failed(f"recording {fname}", e)
                call = None
            out = run(orig, (tensor,) + args, kwargs)
            return finish(call, out, is_async)
        return TracedFunction(orig, impl)

    originals: dict[str, Callable] = {}
    wrappers: dict[str, TracedFunction] = {}
    for fname in COLLECTIVES + P2P:
        orig = getattr(c10d, fname, None)
        if orig is None or isinstance(orig, TracedFunction):
            continue
        originals[fname] = orig
        wrappers[fname] = (wrap_p2p if fname in P2P else wrap_collective)(fname, orig)

    orig_batch = getattr(c10d, "batch_isend_irecv", None)
    if orig_batch is not None and not isinstance(orig_batch, TracedFunction):
        plain = {originals.get("isend"): wrappers.get("isend"), originals.get("irecv"): wrappers.get("irecv")}

        def batch_impl(p2p_op_list):
            # The ops inside are recorded by the isend/irecv wrappers (the batch calls op.op). An op
            # built with a function captured before instrumentation is pointed at the wrapper, so
            # the batch's own ``op.op is isend`` test holds.
            nonlocal pending_batch
            try:
                for p in p2p_op_list:
                    w = plain.get(getattr(p, "op", None))
                    if w is not None:
                        p.op = w
            except Exception as e:
                failed("batch_isend_irecv ops", e)
            outer, pending_batch = pending_batch, []
            try:
                works = orig_batch(p2p_op_list)
            finally:
                coalesced, pending_batch = pending_batch, outer
            if not coalesced:
                return works
            try:  # NCCL-style coalescing: the batch's works complete every op in it
                def all_done():
                    for cb in coalesced:
                        cb()
                return [TimedWork(w, all_done) for w in works] if works else works
            except Exception as e:
                failed("wrapping batch works", e)
                return works
        originals["batch_isend_irecv"] = orig_batch
        wrappers["batch_isend_irecv"] = TracedFunction(orig_batch, batch_impl)

    for fname, w in wrappers.items():
        setattr(c10d, fname, w)
        if getattr(dist, fname, None) is originals[fname]:
            setattr(dist, fname, w)

    undo_functional = _instrument_functional(begin, group_of, make_done, run, failed, observer)

    def undo() -> None:
        for fname, orig in originals.items():
            if getattr(c10d, fname, None) is wrappers[fname]:
                setattr(c10d, fname, orig)
            if getattr(dist, fname, None) is wrappers[fname]:
                setattr(dist, fname, orig)
        undo_functional()
    return undo


def _instrument_functional(begin, group_of, make_done, run, failed, observer) -> Callable[[], None]:
    """Wrap the functional collectives; their exit is recorded when the result's wait runs.

    Under ``torch.compile`` the wrappers step aside (``is_compiling``): the call becomes a node of the
    graph, which a Python record would break, and inductor schedules its wait, not us.
    """
    try:
        import torch
        import torch.distributed._functional_collectives as fc
        import torch.distributed.distributed_c10d as c10d

        act = fc.AsyncCollectiveTensor
        resolve = fc._resolve_group_name
        find_pg = c10d._resolve_process_group
        compiling = torch.compiler.is_compiling
    except (ImportError, AttributeError):  # an older or trimmed torch: nothing to wrap
        return lambda: None
    group_idx = {"all_reduce": 2, "all_reduce_coalesced": 2, "all_gather_tensor": 2,
                 "all_gather_tensor_autograd": 2, "all_gather_into_tensor_coalesced": 1,
                 "reduce_scatter_tensor": 3, "reduce_scatter_tensor_autograd": 3,
                 "reduce_scatter_tensor_coalesced": 3, "all_to_all_single": 3, "all_to_all_single_autograd": 3,
                 "broadcast": 2}

    def wrap(fname: str, orig: Callable) -> TracedFunction:
        g_idx = group_idx[fname]

        def impl(*args, **kwargs):
            if compiling():
                return orig(*args, **kwargs)
            call = None
            try:
                group = kwargs.get("group", args[g_idx] if len(args) > g_idx else None)
                tensor = args[0] if args else kwargs.get("self", kwargs.get("inputs"))
                call = begin(fname, *group_of(find_pg(resolve(group, kwargs.get("tag", "")))), tensor, True)
            except Exception as e:
                failed(f"recording {fname}", e)
                call = None
            out = run(orig, args, kwargs)
            if call is None:
                return out
            try:
                results = out if isinstance(out, (list, tuple)) else [out]
                waiting = [t for t in results if isinstance(t, act) and not t.completed]
                done = make_done(call)
                if not waiting:
                    done()
                else:
                    # Any one wait completes the call; the others find it recorded.
                    once = _Once(done, call, observer, failed)
                    for t in waiting:
                        t.__dict__["_ss_done"] = once
            except Exception as e:
                failed(f"recording {fname}'s exit", e)
            return out
        return TracedFunction(orig, impl)

    originals = {n: getattr(fc, n) for n in FUNCTIONAL if callable(getattr(fc, n, None))
                 and not isinstance(getattr(fc, n), TracedFunction)}
    wrappers = {n: wrap(n, f) for n, f in originals.items()}
    for n, w in wrappers.items():
        setattr(fc, n, w)

    orig_trigger, orig_wait = act.trigger_wait, act.wait

    def waited(orig_method):
        def method(self, *args, **kwargs):
            state = getattr(self, "__dict__", None)
            once = state.pop("_ss_done", None) if state else None
            t0 = time.perf_counter_ns()
            out = orig_method(self, *args, **kwargs)
            if once is not None:
                once(time.perf_counter_ns() - t0)
            return out
        method.__wrapped__ = orig_method
        method.__doc__ = orig_method.__doc__
        return method

    act.trigger_wait, act.wait = waited(orig_trigger), waited(orig_wait)

    def undo() -> None:
        for n, f in originals.items():
            if getattr(fc, n, None) is wrappers[n]:
                setattr(fc, n, f)
        act.trigger_wait, act.wait = orig_trigger, orig_wait
    return undo


class _Once:
    """Record a functional collective's exit at the first wait on any of its results."""

    __slots__ = ("done", "call", "observer", "failed", "fired")

    def __init__(self, done: Callable[[], None], call: Call, observer: Any, failed: Callable) -> None:
        self.done, self.call, self.observer, self.failed, self.fired = done, call, observer, failed, False

    def __call__(self, blocked_ns: int) -> None:
        if self.fired:
            return
        self.fired = True
        self.done()  # records its own failures
        if self.observer is not None:
            try:
                self.observer.on_blocked(self.call, blocked_ns)
            except Exception as e:
                self.failed("a functional collective's wait", e)
