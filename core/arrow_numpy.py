"""Arrow columns as numpy arrays without pyarrow's pandas bridge.

Why: ``pyarrow.Array.to_numpy`` goes through Arrow's pandas conversion, whose
first call imports pandas (half a second of a `stragglerscope whatif` run that
otherwise never needs it). Fixed-width values and validity bitmaps are read
straight from the array's buffers here instead, zero-copy for the values.
Anything else falls back to ``to_numpy``.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

_FIXED = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
          pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64,
          pa.float32(): np.float32, pa.float64(): np.float64}


def values(arr: pa.Array | pa.ChunkedArray, null: int | float | None = None) -> np.ndarray:
    """A column's values (read-only and zero-copy for one fixed-width chunk without nulls).

    Nulls become ``null`` (a copy; also cheaper than ``fill_null``, whose fill scalar imports pandas).
    With nulls and no ``null``, booleans or any other type, this is ``to_numpy`` (nulls as NaN or
    None there, as pyarrow does).
    """
    if isinstance(arr, pa.ChunkedArray):
        if arr.num_chunks == 1:
            return values(arr.chunk(0), null)
        if arr.num_chunks == 0:
            return np.zeros(0, _FIXED.get(arr.type, np.float64))
        return np.concatenate([values(c, null) for c in arr.chunks])
    dtype = _FIXED.get(arr.type)
    if dtype is None or (arr.null_count and null is None):
        if pa.types.is_boolean(arr.type) and not arr.null_count:
            return _bits(arr.buffers()[1], arr.offset, len(arr))
        return arr.to_numpy(zero_copy_only=False)
    x = np.frombuffer(arr.buffers()[1], dtype, count=len(arr), offset=arr.offset * np.dtype(dtype).itemsize)
    if arr.null_count:
        x = x.copy()
        x[is_null(arr)] = null
    return x


def is_null(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """bool per row: the value is null."""
    if isinstance(arr, pa.ChunkedArray):
        if arr.num_chunks == 0:
            return np.zeros(0, bool)
        return np.concatenate([is_null(c) for c in arr.chunks])
    if not arr.null_count:
        return np.zeros(len(arr), bool)
    validity = arr.buffers()[0]
    if validity is None:  # a null-typed array, or one whose nulls are not in a bitmap
        return values(arr.is_null())
    return ~_bits(validity, arr.offset, len(arr))


def _bits(buf: pa.Buffer, offset: int, n: int) -> np.ndarray:
    """A little-endian bitmap as bools."""
    raw = np.frombuffer(buf, np.uint8)
    return np.unpackbits(raw, count=offset + n, bitorder="little")[offset:].astype(bool)


def strings(items: list[str]) -> pa.Array:
    """A string array built from its buffers (``pa.array`` of Python objects imports pandas first)."""
    data = [s.encode() for s in items]
    offsets = np.zeros(len(data) + 1, np.int32)
    np.cumsum([len(b) for b in data], out=offsets[1:])
    return pa.Array.from_buffers(pa.string(), len(data), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))])


def array(x: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    """A fixed-width numpy array as an Arrow array, zero-copy, ``mask`` (True = null) as its validity.

    ``pa.array`` of a numpy array imports pandas first.
    """
    x = np.ascontiguousarray(x)
    arrow_type = pa.from_numpy_dtype(x.dtype)
    validity, n_null = None, 0
    if mask is not None and mask.any():
        validity = pa.py_buffer(np.packbits(~np.asarray(mask, bool), bitorder="little"))
        n_null = int(np.count_nonzero(mask))
    if x.dtype == np.bool_:
        return pa.Array.from_buffers(arrow_type, len(x), [validity, pa.py_buffer(np.packbits(x, bitorder="little"))],
                                     null_count=n_null)
    return pa.Array.from_buffers(arrow_type, len(x), [validity, pa.py_buffer(x)], null_count=n_null)
