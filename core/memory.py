"""Giving freed memory back to the operating system between phases of big-table work."""
from __future__ import annotations

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
