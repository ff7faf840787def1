"""Checkpoint saves and loads of an unchanged job, as the hang detector and the downtime accounting need them.

A checkpoint is the commonest long pause of a healthy job: rank 0 writes the
model with ``torch.save`` while the others wait in a barrier, every rank
writes its own shard, ``torch.distributed.checkpoint`` writes a sharded one,
possibly in the background (``async_save``). While one runs on the training
thread, the rank's heartbeats say ``checkpoint-save`` (or ``-load``) is in
flight, so the hang detector gives it ``hang.checkpoint_s`` rather than the
seconds of a stalled step; when it completes, a CHECKPOINT record says which
step it holds (lost progress after a fault is counted from the last one).

Wrapped, once the trace session starts:
- ``torch.save`` (also as ``torch.serialization.save``) to a path or a file:
  a save into an in-memory buffer is serialisation, not a checkpoint;
- ``torch.load`` of a path or file (a resumed job's load);
- ``torch.distributed.checkpoint``'s ``save``, ``load`` and ``async_save``
  (the save's staging, and a wait on its future, are in flight on the
  training thread; the write in the background is not a pause);
- ``safetensors.torch``'s ``save_file`` and ``save_model``.

A checkpoint written some other way (``pickle``, ``numpy.save``, an object
store's client) is not seen here: the hang detector learns such a pause once
it recurs at a regular interval of steps (``analyzers.hang``).
Every wrapper compares equal in behaviour to what it wraps: arguments, return
value and exceptions pass through unchanged; a failure of our own is counted
and logged once, never raised.
"""
from __future__ import annotations

import functools
import io
import os
import sys
import threading
from typing import Any, Callable

from ingest.autotrace.imports import when_imported


def _is_file_target(f: Any) -> bool:
    """A path, or a file object that is not an in-memory buffer."""
    if isinstance(f, (str, bytes, os.PathLike)):
        return True
    return (hasattr(f, "write") or hasattr(f, "read")) and not isinstance(f, (io.BytesIO, io.StringIO))


class CheckpointWatch:
    """Wraps the checkpoint calls of one process for ``exporter`` (a ``RankExporter``); ``undo()`` restores them.

    ``failed(where, exc)`` is told of an error of our own (the session's guard)."""

    def __init__(self, exporter, failed: Callable[[str, BaseException], None]):
        self.exp = exporter
        self.failed = failed
        self.thread = threading.get_ident()  # the training thread: the one that initialised torch.distributed
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        import torch
        import torch.serialization

        self._wrap(torch, "save", "save", target_arg=1, also=(torch.serialization,))
        self._wrap(torch, "load", "load", target_arg=0, also=(torch.serialization,))
        when_imported("torch.distributed.checkpoint", self._patch_dcp)
        when_imported("safetensors.torch", self._patch_safetensors)

    def undo(self) -> None:
        for u in reversed(self._undo):
            u()
        self._undo.clear()

    def _patch_dcp(self, dcp) -> None:
        self._wrap(dcp, "save", "save")
        self._wrap(dcp, "load", "load")
        self._wrap(dcp, "async_save", "save", asynchronous=True)

    def _patch_safetensors(self, st) -> None:
        self._wrap(st, "save_file", "save")
        self._wrap(st, "save_model", "save")

    def _wrap(self, module, name: str, kind: str, target_arg: int | None = None, also: tuple = (),
              asynchronous: bool = False) -> None:
        orig = getattr(module, name, None)
        if orig is None or getattr(orig, "_stragglerscope", False):
            return
        watch = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if target_arg is not None:
                target = args[target_arg] if len(args) > target_arg else kwargs.get("f")
                if not _is_file_target(target):
                    return orig(*args, **kwargs)
            out = watch._timed(kind, orig, args, kwargs)
            if asynchronous:
                watch._watch_future(out)
            return out
        wrapper._stragglerscope = True
        for m in (module, *also):
            if getattr(m, name, None) is orig:
                setattr(m, name, wrapper)
                self._undo.append(lambda m=m, orig=orig: setattr(m, name, orig))

    def _timed(self, kind: str, orig, args, kwargs):
        exp = self.exp
        if threading.get_ident() != self.thread:
            # A save on a thread of the job's own: training goes on meanwhile, so it is no pause; it is still
            # a checkpoint once it completes.
            t0 = exp.now_ns()
            out = orig(*args, **kwargs)
            self._record(kind, t0)
            return out
        try:
            step = self._step(kind)
            ctx = exp.checkpointing(step, kind)
            ctx.__enter__()
        except Exception as e:
            self.failed(f"checkpoint {kind}", e)
            return orig(*args, **kwargs)
        try:
            out = orig(*args, **kwargs)
        except BaseException:
            ctx.__exit__(*sys.exc_info())  # a failed save is not a checkpoint; it ends the pause
            raise
        try:
            ctx.__exit__(None, None, None)
        except Exception as e:
            self.failed(f"checkpoint {kind}", e)
        return out

    def _step(self, kind: str) -> int:
        """The step a save holds (the last one completed) or a load resumes at."""
        done = self.exp.last_step_done
        return max(0, done) if kind == "save" else done + 1

    def _record(self, kind: str, t0: int) -> None:
        try:
            self.exp.checkpoint(self._step(kind), kind, start_ns=t0, duration_ns=self.exp.now_ns() - t0)
        except Exception as e:
            self.failed(f"checkpoint {kind}", e)

    def _watch_future(self, fut) -> None:
        """``async_save``'s future: a wait on it (``result()``) on the training thread is a checkpoint pause
        (the job waits for the previous write before starting the next)."""
        result = getattr(fut, "result", None)
        if result is None or getattr(result, "_stragglerscope", False):
            return
        watch = self

        @functools.wraps(result)
        def waited(*args, **kwargs):
            if threading.get_ident() != watch.thread:
                return result(*args, **kwargs)
            with watch.exp.in_flight("checkpoint-save"):
                return result(*args, **kwargs)
        waited._stragglerscope = True
        try:
            fut.result = waited
        except (AttributeError, TypeError):
            pass  # a future that takes no attribute: its waits go unmarked
