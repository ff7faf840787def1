"""Inputs of the what-if analyzer: op-span tables (``core.golden`` reads golden traces as such).

Contract
- ``prepare_ops`` turns an ``OP_SPAN``-like table into ``PreparedOps``: plain
  numpy columns, sorted by (step, worker, stream, start, seq), with bad rows,
  unknown op types and duplicates removed and every removal reported in
  ``warnings``. It never raises for bad rows, only for unusable input
  (missing columns, no usable op at all, missing workers when the caller
  asked for complete windows): ``WhatIfInputError`` with a one-line message.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core import parallel
from core.arrow_numpy import array, is_null, strings, values
from core.layout import JobLayout
from core.memory import release_memory
from core.optypes import OPTYPES

from . import kernels
from .opcodes import CODE, STREAM_OF_CODE

REQUIRED = ("dp_rank", "pp_rank", "step", "optype", "start_ns", "duration_ns")
"""Columns ``analyze`` cannot do without; the rest of OP_SPAN has defaults."""


class WhatIfInputError(ValueError):
    """Input the analyzer cannot use; the message is one line for the user."""


@dataclasses.dataclass(frozen=True)
class PreparedOps:
    """Validated op columns sorted by (step, dp, pp, stream, start, seq).

    Times are int64 ns relative to the start of their step (the earliest op
    start of that step over all workers), so every step starts at 0.
    """

    step_idx: np.ndarray  # int16 (int32 past 32,766 steps), index into ``steps``
    dp: np.ndarray  # int16 (int32 for layouts past 32,766 ranks)
    pp: np.ndarray  # as dp
    code: np.ndarray  # int8, index into OPTYPES
    start: np.ndarray  # int64 ns from step start
    dur: np.ndarray  # ns: int32 when every duration fits (about 2.1 s), else int64
    seq: np.ndarray  # int16 or int32, whichever holds the values
    mc: np.ndarray  # int16, >= 0
    gmc: np.ndarray  # int16, >= 0
    mb: np.ndarray  # int16 or int32, whichever holds the values
    steps: np.ndarray  # int64, sorted distinct steps
    step_start_ns: np.ndarray  # int64, absolute start of each step
    layout: JobLayout
    job_id: str
    warnings: tuple[str, ...]
    unknown_optypes: tuple[str, ...]
    missing_workers: tuple[tuple[int, int], ...]
    n_input: int

    @property
    def n(self) -> int:
        return len(self.code)

    def workers_present(self) -> np.ndarray:
        """[dp_size, pp_size] bool: the worker has ops (from ``missing_workers``, no pass over the ops)."""
        present = np.ones((self.layout.dp_size, self.layout.pp_size), bool)
        for d, x in self.missing_workers:
            present[d, x] = False
        return present

    def step_bounds(self) -> np.ndarray:
        """Row offsets of each step (rows are sorted by step): len(steps) + 1."""
        # Probe values of the column's own dtype: a mixed-dtype searchsorted copies the whole column.
        return np.searchsorted(self.step_idx, np.arange(len(self.steps) + 1, dtype=self.step_idx.dtype),
                               side="left").astype(np.int64)


def _column(t: pa.Table, name: str) -> pa.Array:
    c = t.column(name)
    if isinstance(c, pa.ChunkedArray):
        return c.chunk(0) if c.num_chunks == 1 else c.combine_chunks()
    return c


def _int_col(t: pa.Table, name: str, dtype, default: int, bad: np.ndarray) -> np.ndarray:
    """Column as ``dtype`` (None: an integer column as it is, floats as int64); nulls and non-finite
    values mark rows in ``bad``."""
    n = t.num_rows
    if name not in t.column_names:
        return np.full(n, default, dtype or np.int64)
    c = _column(t, name)
    if c.null_count:
        bad |= is_null(c)
        c = c.fill_null(default)
    if pa.types.is_floating(c.type):
        x = values(c)
        nonfinite = ~np.isfinite(x)
        bad |= nonfinite
        return np.where(nonfinite, default, x).astype(dtype or np.int64)
    if not (pa.types.is_integer(c.type) or pa.types.is_boolean(c.type)):
        raise WhatIfInputError(f"column {name!r} is {c.type}, want an integer")
    x = values(c)
    if dtype is None:
        return x if np.issubdtype(x.dtype, np.integer) else x.astype(np.int64)
    if x.dtype != dtype and (np.issubdtype(x.dtype, np.integer) and np.iinfo(x.dtype).bits > np.iinfo(dtype).bits):
        lo, hi = (int(x.min()), int(x.max())) if len(x) else (0, 0)
        if lo < np.iinfo(dtype).min or hi > np.iinfo(dtype).max:
            raise WhatIfInputError(f"column {name!r} has values out of range for {np.dtype(dtype).name}")
    return x.astype(dtype, copy=False)


def _codes(t: pa.Table) -> tuple[np.ndarray, list[str]]:
    """Op type codes (index into OPTYPES, -1 unknown) and the unknown names."""
    c = _column(t, "optype")
    if pa.types.is_dictionary(c.type):
        dict_codes = _codes_of(c.dictionary.cast(pa.string()))
        idx = values(c.indices, 0)
        codes = dict_codes[0][idx] if len(dict_codes[0]) else np.full(len(idx), -1, np.int8)
        if c.null_count:
            codes = np.where(is_null(c), -1, codes).astype(np.int8)
    else:
        codes, _ = _codes_of(c.cast(pa.string()))
    unknown_mask = codes < 0
    names: list[str] = []
    if unknown_mask.any():
        u = pc.unique(c.filter(array(unknown_mask)).cast(pa.string())).to_pylist()
        names = sorted(str(x) for x in u)
    return codes.astype(np.int8), names


def _codes_of(names: pa.Array) -> tuple[np.ndarray, None]:
    idx = pc.index_in(names, value_set=strings(list(OPTYPES)))
    return np.asarray(values(idx, -1), dtype=np.int8), None


def prepare_ops(ops: pa.Table, layout: JobLayout, *, allow_incomplete: bool = True) -> PreparedOps:
    """Validate, clean and sort op spans (see the module docstring)."""
    return prepare_ops_taking([ops], layout, allow_incomplete=allow_incomplete)


def prepare_ops_taking(box: list[pa.Table], layout: JobLayout, *, allow_incomplete: bool = True) -> PreparedOps:
    """``prepare_ops`` of the table in ``box`` (a one-element list), which it empties.

    A caller that keeps no other reference to the table lets each column's memory go as soon as it
    has been used: the step and start columns before the sort, the table itself before the gather
    (with a 16k-GPU window, half a GB less at the peak).
    """
    ops = box.pop()
    if not isinstance(ops, pa.Table):
        raise WhatIfInputError(f"ops must be a pyarrow.Table, got {type(ops).__name__}")
    if not isinstance(layout, JobLayout):
        raise WhatIfInputError(f"layout must be a JobLayout, got {type(layout).__name__}")
    missing = [c for c in REQUIRED if c not in ops.column_names]
    if missing:
        raise WhatIfInputError(f"op spans lack columns {missing}")
    n_in = ops.num_rows
    warnings: list[str] = []
    bad = np.zeros(n_in, bool)
    # Native widths: the columns of a 7.5M-op window are read without copies where possible.
    dp = _int_col(ops, "dp_rank", np.int32, 0, bad)
    pp = _int_col(ops, "pp_rank", np.int32, 0, bad)
    step = _int_col(ops, "step", None, 0, bad)  # any integer type: it only becomes step offsets
    start = _int_col(ops, "start_ns", np.int64, 0, bad)
    dur = _int_col(ops, "duration_ns", np.int64, 0, bad)
    n_null = int(bad.sum())
    if n_null:
        warnings.append(f"{n_null} op spans rejected: null or non-finite rank, step, start or duration")
    neg = (dur < 0) & ~bad
    if neg.any():
        warnings.append(f"{int(neg.sum())} op spans rejected: negative duration")
        bad |= neg
    out_of_layout = ((dp < 0) | (dp >= layout.dp_size) | (pp < 0) | (pp >= layout.pp_size) | (step < 0)) & ~bad
    if out_of_layout.any():
        warnings.append(f"{int(out_of_layout.sum())} op spans rejected: rank outside the layout "
                        f"dp<{layout.dp_size} pp<{layout.pp_size} or negative step")
        bad |= out_of_layout
    codes, unknown = _codes(ops)
    unk = (codes < 0) & ~bad
    if unk.any():
        warnings.append(f"{int(unk.sum())} ops of unknown types ignored: {unknown}")
    bad |= codes < 0
    quiet = np.zeros(n_in, bool)
    seq = _int_col(ops, "seq_id", np.int32, 0, quiet)
    mc = _int_col(ops, "mc", np.int16, 0, quiet)  # OP_SPAN's types: a chunk index
    gmc = _int_col(ops, "gmc", np.int16, -1, quiet)
    mb = _int_col(ops, "mb_id", np.int32, -1, quiet)
    job_id = ""
    if "job_id" in ops.column_names and n_in:
        job_id = str(_column(ops, "job_id")[0].as_py() or "")
    del ops  # the columns above are views of its buffers: each buffer now lives as long as its view
    if bad.any():
        idx = np.flatnonzero(~bad)
        dp, pp, step, start, dur, codes, seq, mc, gmc, mb = (
            a[idx] for a in (dp, pp, step, start, dur, codes, seq, mc, gmc, mb))
    del bad, quiet
    if len(codes) == 0:
        raise WhatIfInputError("no usable op spans (all rows rejected or empty input)")

    steps = np.unique(values(pc.unique(array(step)))).astype(np.int64)
    span = int(steps[-1]) - int(steps[0]) + 1
    if span <= 4 * len(step) + 1024:
        # Offsets from the first step, written as int32 directly (an int64 temporary is 240 MB at 16k GPUs).
        step_idx = np.subtract(step, steps[0], out=np.empty(len(step), np.int32), casting="unsafe")
        if span != len(steps):  # not consecutive: a lookup table, one gather instead of a search per op
            lut = np.zeros(span, np.int32)
            lut[steps - steps[0]] = np.arange(len(steps), dtype=np.int32)
            step_idx = lut[step_idx]
            del lut
    else:
        step_idx = np.searchsorted(steps, step).astype(np.int32)
    del step
    step_start, rel = kernels.relative_starts(step_idx, start, len(steps))
    del start
    if max(layout.dp_size, layout.pp_size) > 0xFFFF:
        raise WhatIfInputError(f"layout dp={layout.dp_size} pp={layout.pp_size}: at most 65,535 ranks per dimension")
    order = _sort_order(step_idx, dp, pp, codes, rel, seq, layout, len(steps))
    rank_t = _narrow(max(layout.dp_size, layout.pp_size))
    n = len(order)
    # One gather, then the narrowest types that hold the values (a 7.5M-op window: 27 bytes an op). The
    # gather's own types are few, so its compiled variants are too (kernels.warm compiles them all). A large
    # window is gathered on threads, a range of rows each (most of its time is first touches of new pages).
    out = tuple(np.empty(n, t) for t in (_narrow(len(steps)), rank_t, rank_t, np.int8, np.int64, np.int64,
                                         np.int32, np.int16, np.int16, np.int32))
    dup = np.empty(n, bool)
    n_dup = _gather(order, (step_idx, dp, pp, codes, rel, dur, seq, mc, gmc, mb, layout.pp_size, *out, dup))
    del order, step_idx, dp, pp, codes, rel, dur, seq, mc, gmc, mb
    if n_dup:
        warnings.append(f"{n_dup} duplicate op spans dropped")
        keep = ~dup
        out = tuple(x[keep] for x in out)
    del dup
    step_idx, dp, pp, codes, rel, dur, seq, mc, gmc, mb = out
    del out
    dur, seq, mb = _fit(dur), _fit(seq), _fit(mb)

    release_memory()  # the sort's temporaries and pyarrow.compute's op-type codes
    present = np.bincount(dp.astype(np.int64) * layout.pp_size + pp,
                          minlength=layout.dp_size * layout.pp_size).reshape(layout.dp_size, layout.pp_size) > 0
    missing_workers = tuple((int(d), int(p)) for d, p in zip(*np.nonzero(~present)))
    if missing_workers:
        shown = ", ".join(f"dp{d}/pp{p}" for d, p in missing_workers[:8])
        more = f" and {len(missing_workers) - 8} more" if len(missing_workers) > 8 else ""
        if not allow_incomplete:
            raise WhatIfInputError(f"{len(missing_workers)} workers have no ops: {shown}{more}")
        warnings.append(f"incomplete window: {len(missing_workers)} workers have no ops ({shown}{more}); "
                        f"analysed what is there")
    return PreparedOps(
        step_idx=step_idx, dp=dp, pp=pp, code=codes, start=rel, dur=dur, seq=seq, mc=mc, gmc=gmc, mb=mb,
        steps=steps, step_start_ns=step_start, layout=layout, job_id=job_id, warnings=tuple(warnings),
        unknown_optypes=tuple(unknown), missing_workers=missing_workers, n_input=n_in,
    )


def _gather(order: np.ndarray, args: tuple) -> int:
    """``kernels.gather_rows`` over all rows, a range of rows per thread; the number of re-deliveries."""
    n_thr = parallel.threads(len(order))

    def gather(rows):
        return [kernels.gather_rows(order, t0, t1, *args) for t0, t1 in rows]

    return sum(parallel.map_slices(parallel.ranges(len(order), n_thr), gather, n_thr))


def _fit(x: np.ndarray) -> np.ndarray:
    """``x`` as int16 or int32 when its values fit (exact, half or a quarter of the memory)."""
    if len(x) == 0:
        return x
    lo, hi = int(x.min()), int(x.max())
    for t in (np.int16, np.int32):
        if np.dtype(t).itemsize < x.dtype.itemsize and np.iinfo(t).min <= lo and hi <= np.iinfo(t).max:
            return x.astype(t)
    return x


def _narrow(n_values: int):
    """Smallest of int16/int32 that holds 0..n_values."""
    return np.int16 if n_values < np.iinfo(np.int16).max else np.int32


def _sort_order(step_idx, dp, pp, codes, rel, seq, layout: JobLayout, n_steps: int) -> np.ndarray:
    """Row order by (step, dp, pp, stream, start, seq), equal rows in input order.

    The compiled counting sort needs a counter per stream of every worker-step; past four per op
    (a few ops spread over very many steps or ranks) a lexsort is cheaper.
    """
    n_keys = n_steps * layout.dp_size * layout.pp_size * 8
    if n_keys <= 4 * len(codes) + (1 << 20):
        return kernels.sort_rows(step_idx, dp, pp, codes, STREAM_OF_CODE, layout.dp_size, layout.pp_size,
                                 n_steps, rel, seq)
    return np.lexsort((seq, rel, _major_key(step_idx, dp, pp, codes, layout)))


def _major_key(step_idx, dp, pp, codes, layout: JobLayout) -> np.ndarray:
    """(step, dp, pp, stream) packed into one int64, built in place."""
    major = step_idx.astype(np.int64)
    major *= layout.dp_size
    major += dp
    major *= layout.pp_size
    major += pp
    major *= 8
    major += STREAM_OF_CODE[codes]
    return major


__all__ = ["CODE", "REQUIRED", "PreparedOps", "WhatIfInputError", "prepare_ops", "prepare_ops_taking"]
