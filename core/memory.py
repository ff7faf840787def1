"""Memory policy of big-table work: freed memory back to the operating system between phases, and the
page size numpy asks for."""
from __future__ import annotations

import os
import sys
from typing import Any

import pyarrow as pa

_LIBC: Any = None


def release_memory() -> None:
    """Hand freed memory back to the OS: Arrow's pool, and glibc's heap where there is one.

    Freed numpy temporaries of a few tens of MB otherwise stay in the heap
    (glibc raises its trim threshold after such frees) and count in the peak
    RSS of the next phase.
    """
    global _LIBC
    pa.default_memory_pool().release_unused()
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC(0)


def small_pages() -> None:
    """Stop numpy asking the kernel for transparent huge pages for its large arrays, in this process and the
    processes it starts, unless ``NUMPY_MADVISE_HUGEPAGE`` already says which.

    Why: numpy ``madvise``s every large array for huge pages. Where THP runs in ``madvise`` mode with
    ``defrag=madvise`` (a common default, and these VMs'), each such fault may compact memory on the spot:
    measured here, the first touch of 1 GB took 1.8-2.2 s with huge pages and 0.36-0.45 s without, and
    ``stragglerscope whatif`` on a 16,384-GPU trace 7.5 s against 6.5 s (BENCHMARKS.md, "huge pages").
    The analysis reads its arrays in long runs, so it loses little to the smaller pages' TLB misses.
    """
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return  # the user's choice, which numpy applied when it was imported
    os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"  # read when numpy is imported, here or in a process started from here
    np = sys.modules.get("numpy")  # already imported: numpy's own switch (private, so looked up with care)
    setter = getattr(getattr(getattr(np, "_core", None), "multiarray", None), "_set_madvise_hugepage", None)
    if setter is not None:
        setter(False)
