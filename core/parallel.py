"""Large columnar work on several threads: the what-if analysis of a big window, and reading its trace.

Why threads: the what-if's compiled kernels, numpy copies and parquet decoding
release the GIL, and the pieces are independent: a pass's batch columns, the
column blocks of measuring, ranges of rows of the gather, row groups of a
file. On two cores a 16k-GPU window's passes take about half the time.

Small work (the pipeline's usual windows) stays on the calling thread: below
``MIN_PARALLEL_CELLS`` a thread's start costs more than it saves, and the
pipeline already runs one analysis per shard on every core.

Results never depend on the thread count: each piece writes its own part and
the parts are put together in the order of the pieces.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

MIN_PARALLEL_CELLS = 4_000_000
"""Cells ((op, column) of a pass, rows of a table) below which work runs on the calling thread."""
MAX_THREADS = 8
ENV = "STRAGGLERSCOPE_THREADS"
"""Overrides the thread count (1 = the calling thread only)."""

T = TypeVar("T")
R = TypeVar("R")


def threads(cells: int) -> int:
    """How many threads work of ``cells`` cells uses."""
    if cells < MIN_PARALLEL_CELLS:
        return 1
    env = os.environ.get(ENV, "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass  # a bad value means the default, not a failed analysis
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_THREADS))


def map_slices(items: Sequence[T], fn: Callable[[Sequence[T]], list[R]], n_threads: int) -> list[R]:
    """``fn`` on ``n_threads`` contiguous slices of ``items``, one thread each; the results in item order.

    ``fn`` gets a whole slice so that it can hold its own scratch memory across the slice.
    """
    n_threads = max(1, min(n_threads, len(items)))
    if n_threads == 1:
        return fn(items)
    bounds = [len(items) * i // n_threads for i in range(n_threads + 1)]
    parts = [items[bounds[i]:bounds[i + 1]] for i in range(n_threads)]
    with ThreadPoolExecutor(n_threads, thread_name_prefix="whatif") as ex:
        futures = [ex.submit(fn, part) for part in parts[1:]]
        out = fn(parts[0])  # the calling thread takes the first slice
        for f in futures:
            out.extend(f.result())
    return out


def ranges(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[0, n) cut into ``parts`` contiguous (lo, hi) ranges, inner cuts at multiples of ``align``."""
    parts = max(1, parts)
    cuts = [n * i // parts // align * align for i in range(parts)] + [n]
    return [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]) if hi > lo]
