"""Wrap ``torch.distributed`` collectives and point-to-point calls into CCL records.

``instrument_distributed(exporter)`` replaces the module functions with thin
wrappers (and returns a function that restores them). A wrapper names the
group (``world`` or the folded ranks of the group, ``p2p:a>b`` for
point-to-point), numbers the call within its group (the sequence number that
lets the hang detector see who never entered collective n), counts the bytes,
tells the exporter the op is in flight, calls the original, and records the
exit. Async calls (``isend``, ``irecv``, ``batch_isend_irecv``, ``async_op=True``)
record their exit when the returned work is waited on.

The wrappers add a few microseconds per call on the training thread and never
raise anything of their own: a failing record is dropped, the collective's
own result and exceptions pass through untouched.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from ingest.exporter import RankExporter
from ingest.schema import fold_ranks

log = logging.getLogger(__name__)

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
               "broadcast", "barrier")
P2P = ("send", "recv", "isend", "irecv")


def _nbytes(x: Any) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    try:
        return int(x.numel() * x.element_size())
    except AttributeError:
        return 0


class _TimedWork:
    """A distributed Work whose wait() records the exit of its op."""

    def __init__(self, work, on_done: Callable[[], None]):
        self._work = work
        self._on_done = on_done
        self._done = False

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if not self._done:
            self._done = True
            self._on_done()
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def instrument_distributed(exporter: RankExporter) -> Callable[[], None]:
    """Wrap torch.distributed for ``exporter``; returns a function that undoes it."""
    import torch.distributed as dist

    seqs: dict[str, int] = {}
    names: dict[Any, tuple[str, list[int]]] = {}
    originals: dict[str, Callable] = {}

    def group_of(group) -> tuple[str, list[int]]:
        if group is None or group is dist.group.WORLD:
            key = None
        else:
            key = group
        if key not in names:
            ranks = list(range(dist.get_world_size())) if key is None else list(dist.get_process_group_ranks(group))
            names[key] = ("world" if key is None else f"ranks:{fold_ranks(ranks)}", ranks)
        return names[key]

    def next_seq(name: str) -> int:
        seqs[name] = seqs.get(name, -1) + 1
        return seqs[name]

    def wrap_collective(fname: str, orig: Callable) -> Callable:
        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            try:
                gname, ranks = group_of(kwargs.get("group"))
                seq = next_seq(gname)
                nbytes = _nbytes(args[0]) if args else 0
                me = dist.get_rank()
                peers = [r for r in ranks if r != me]
                enter = exporter.ccl_enter(fname, gname, ranks, seq)
            except Exception as e:  # never in training's way
                log.debug("ccl record skipped: %s", e)
                return orig(*args, **kwargs)

            def done():
                try:
                    exporter.ccl_exit(fname, gname, ranks, seq, enter, nbytes, peers)
                except Exception as e:
                    log.debug("ccl exit skipped: %s", e)

            out = orig(*args, **kwargs)
            if kwargs.get("async_op") and out is not None:
                return _TimedWork(out, done)
            done()
            return out
        return wrapper

    def wrap_p2p(fname: str, orig: Callable) -> Callable:
        is_send = fname in ("send", "isend")
        is_async = fname.startswith("i")

        @functools.wraps(orig)
        def wrapper(tensor, *args, **kwargs):
            try:
                peer = kwargs.get("dst" if is_send else "src", args[0] if args else None)
                me = dist.get_rank()
                a, b = (me, peer) if is_send else (peer, me)
                gname = f"p2p:{a}>{b}"
                seq = next_seq(gname + (":s" if is_send else ":r"))
                enter = exporter.ccl_enter(fname, gname, [a, b], seq)
                nbytes = _nbytes(tensor)
            except Exception as e:
                log.debug("ccl record skipped: %s", e)
                return orig(tensor, *args, **kwargs)

            def done():
                try:
                    exporter.ccl_exit(fname, gname, [a, b], seq, enter, nbytes, [peer])
                except Exception as e:
                    log.debug("ccl exit skipped: %s", e)

            out = orig(tensor, *args, **kwargs)
            if is_async and out is not None:
                return _TimedWork(out, done)
            done()
            return out
        return wrapper

    for fname in COLLECTIVES + P2P:
        orig = getattr(dist, fname, None)
        if orig is None:
            continue
        originals[fname] = orig
        setattr(dist, fname, (wrap_p2p if fname in P2P else wrap_collective)(fname, orig))

    orig_batch = getattr(dist, "batch_isend_irecv", None)
    if orig_batch is not None:
        originals["batch_isend_irecv"] = orig_batch

        @functools.wraps(orig_batch)
        def batch_wrapper(p2p_op_list):
            works = orig_batch(p2p_op_list)
            try:
                out = []
                me = dist.get_rank()
                for op, work in zip(p2p_op_list, works):
                    is_send = getattr(op.op, "__name__", "").endswith("send")
                    peer = op.peer
                    a, b = (me, peer) if is_send else (peer, me)
                    gname = f"p2p:{a}>{b}"
                    seq = next_seq(gname + (":s" if is_send else ":r"))
                    enter = exporter.ccl_enter("isend" if is_send else "irecv", gname, [a, b], seq)
                    nbytes = _nbytes(op.tensor)
                    out.append(_TimedWork(work, functools.partial(
                        exporter.ccl_exit, "isend" if is_send else "irecv", gname, [a, b], seq, enter, nbytes,
                        [peer])))
                return out
            except Exception as e:
                log.debug("batch ccl records skipped: %s", e)
                return works
        dist.batch_isend_irecv = batch_wrapper

    def undo() -> None:
        for fname, orig in originals.items():
            setattr(dist, fname, orig)
    return undo
