"""Key bookkeeping for ``Store.insert``'s idempotence, kept cheap for large batches (see ``storage.store``).

Two steps of an insert took about half as long as the engine's own write of
a backfill batch (875,000 windows on this 2-core VM: 0.5 s against 0.9 s):

- Finding keys that occur twice in the batch. An Arrow group-by over the
  whole key took 0.29 s. ``first_of_each_key`` hashes every key to 64 bits
  and sorts the hashes (about 40 ms). Only when two hashes are equal (a true
  duplicate or a collision) does it run the exact group-by.
- Reading stored keys back to drop replays (0.2-0.35 s, growing with the
  table). A job's windows reach the store in order of ``window_id``, so
  ``HighWater`` remembers, per table and (job_id, attempt), the largest
  ``window_id`` stored. Rows above it cannot be stored yet and skip the read.
  Rows at or below it (a replay, a late window) still get the exact check.
  This is only exact for a store that is its tables' sole writer: chDB, where
  one process owns a path and every write goes through it.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

GROWING_KEY = ("job_id", "attempt", "window_id")
"""Tables whose key starts with these columns get high-water marks: window_id grows within a job attempt."""

_NOTHING_STORED = -(2**63)
_U64 = np.uint64


def _mix(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit finaliser (splitmix64's): nearby inputs get unrelated outputs."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


class Encoded:
    """A batch's string columns as indices into a dictionary of the batch's distinct values.

    Encoded once (18 ms for 875k job ids) and shared by the duplicate check
    and the high-water split; equal strings get equal indices within the batch.
    """

    def __init__(self, rows: pa.Table) -> None:
        self.rows = rows
        self._done: dict[str, tuple[np.ndarray, pa.Array]] = {}

    def codes(self, name: str) -> tuple[np.ndarray, pa.Array]:
        """``(indices as int64, dictionary)`` of a string column."""
        if name not in self._done:
            col = self.rows.column(name)
            col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
            if pa.types.is_dictionary(col.type):
                col = col.cast(col.type.value_type)
            enc = pc.dictionary_encode(col)
            self._done[name] = (enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), enc.dictionary)
        return self._done[name]


def _encoding(rows: pa.Table, enc: Encoded | None) -> Encoded:
    """``enc`` where it encodes ``rows`` themselves (not a batch before duplicates were dropped)."""
    return enc if enc is not None and enc.rows is rows else Encoded(rows)


def _is_text(typ: pa.DataType) -> bool:
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    return pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_binary(typ)


def key_hashes(rows: pa.Table, key: list[str], enc: Encoded | None = None) -> np.ndarray | None:
    """One 64-bit hash per row of its key columns, or None where a column cannot be hashed this way.

    Strings hash by their index in a dictionary built over this batch, so equal
    keys get equal hashes within the batch (not across batches).
    """
    enc = _encoding(rows, enc)
    h = np.zeros(rows.num_rows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for name in key:
            col = rows.column(name)
            if col.null_count:
                return None
            if pa.types.is_integer(col.type):
                values = col.to_numpy().astype(np.int64).view(np.uint64)
            elif _is_text(col.type):
                values = enc.codes(name)[0].view(np.uint64)
            else:
                return None
            h = _mix(h + values)
    return h


def keys_distinct(rows: pa.Table, key: list[str], enc: Encoded | None = None) -> bool:
    """True when no key occurs twice in ``rows`` (distinct hashes prove it); False means "not proven"."""
    h = key_hashes(rows, key, enc)
    if h is None:
        return False
    h.sort()
    return not bool(np.any(h[1:] == h[:-1]))


def first_of_each_key(rows: pa.Table, key: list[str], enc: Encoded | None = None) -> pa.Table:
    """``rows`` without the second and later rows of any key, in their original order."""
    if rows.num_rows < 2 or keys_distinct(rows, key, enc):
        return rows
    idx = pa.array(np.arange(rows.num_rows, dtype=np.int64))
    firsts = rows.select(key).append_column("__i", idx).group_by(key, use_threads=False) \
        .aggregate([("__i", "min")])
    if firsts.num_rows == rows.num_rows:
        return rows
    first = firsts.column("__i_min").combine_chunks()
    return rows.take(first.take(pc.array_sort_indices(first)))


class PendingMarks:
    """The marks a batch will set once its rows are stored (``commit`` after the engine's insert)."""

    def __init__(self, marks: dict, groups: list[tuple[str, int, int]]) -> None:
        self._marks = marks
        self._groups = groups

    def forget(self) -> None:
        """The batch may be partly stored (the engine failed after writing some blocks): drop its groups'
        marks, so that the next batch of these jobs learns them from the table."""
        for job, attempt, _hi in self._groups:
            self._marks.pop((job, attempt), None)

    def commit(self) -> None:
        for job, attempt, hi in self._groups:
            k = (job, attempt)
            if self._marks.get(k, _NOTHING_STORED) < hi:
                self._marks[k] = hi


class HighWater:
    """Per table and (job_id, attempt): the largest window_id stored, learned lazily from the table.

    At most ``max_groups`` marks per table are kept; past that a table's marks
    are forgotten and learned again (a lookup per job, pruned by the sort key).
    """

    def __init__(self, max_groups: int = 100_000) -> None:
        self.max_groups = max_groups
        self._tables: dict[str, dict[tuple[str, int], int]] = {}

    def forget(self) -> None:
        """Drop every mark (after migrations, or anything else that wrote behind the store's back)."""
        self._tables.clear()

    def mark(self, table: str, job: str, attempt: int, lookup) -> int:
        """The largest window_id of (job, attempt) stored in ``table`` (``lookup`` as in ``split`` learns it the
        first time); a window_id above it is not stored."""
        marks = self._tables.setdefault(table, {})
        key = (job, attempt)
        if key not in marks:
            if len(marks) >= self.max_groups:
                marks.clear()
            _learn(marks, [job], [key], lookup)
        return marks[key]

    def split(self, table: str, rows: pa.Table, lookup, enc: Encoded | None = None
              ) -> tuple[pa.Table, pa.Table, PendingMarks]:
        """``(fresh, rest, pending)``: rows that cannot be stored yet, rows that need the stored-key check.

        ``lookup(jobs)`` returns ``{(job_id, attempt): largest stored window_id}`` for those jobs.
        """
        enc = _encoding(rows, enc)
        codes, names = enc.codes("job_id")
        g = pa.table({"j": codes, "attempt": rows.column("attempt"), "window_id": rows.column("window_id")}) \
            .group_by(["j", "attempt"], use_threads=False).aggregate([("window_id", "min"), ("window_id", "max")])
        names = names.to_pylist()
        # (job code, job, attempt, lowest and highest window_id in the batch) per job attempt
        groups = [(j, names[j], a, lo, hi) for j, a, lo, hi in zip(
            g.column("j").to_pylist(), g.column("attempt").to_pylist(), g.column("window_id_min").to_pylist(),
            g.column("window_id_max").to_pylist())]
        marks = self._tables.setdefault(table, {})
        unknown = sorted({job for _j, job, attempt, _lo, _hi in groups if (job, attempt) not in marks})
        if unknown:
            if len(marks) + len(groups) > self.max_groups:
                marks.clear()
                unknown = sorted(set(names))
            _learn(marks, unknown, [(job, attempt) for _j, job, attempt, _lo, _hi in groups], lookup)
        pending = PendingMarks(marks, [(job, attempt, hi) for _j, job, attempt, _lo, hi in groups])
        # Whole jobs go to the check: a job's other attempts in the batch are checked too, which is exact.
        stale = np.zeros(len(names), dtype=bool)
        for j, job, attempt, lo, _hi in groups:
            if lo <= marks[(job, attempt)]:
                stale[j] = True
        if not stale.any():
            return rows, rows.slice(0, 0), pending
        if stale.all():
            return rows.slice(0, 0), rows, pending
        mask = pa.array(stale[codes])
        return rows.filter(pc.invert(mask)), rows.filter(mask), pending


def _learn(marks: dict, jobs: list[str], keys, lookup) -> None:
    """Marks of ``jobs`` from the table (``lookup``), never lowering one; ``keys`` with nothing stored get the
    lowest mark, so they are known from now on."""
    for k, hi in lookup(jobs).items():
        if marks.get(k, _NOTHING_STORED) < hi:
            marks[k] = hi
    for k in keys:
        marks.setdefault(k, _NOTHING_STORED)
