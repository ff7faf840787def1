"""One stored window as the actions read it: the job's registration, the window, its kept raw op spans.

The store keeps the raw op spans of some windows only (``pipeline.keep_op_spans_*``); advice and the
timeline both need them, and both default to the job's latest window that kept them.
"""
from __future__ import annotations

import dataclasses

import pyarrow as pa

from core import codec
from core import schema as S
from core.layout import JobLayout


class WindowUnavailable(ValueError):
    """The store lacks what is asked for: the job's registration or the window's raw op spans."""


@dataclasses.dataclass(frozen=True)
class StoredWindow:
    registration: dict
    """The job's JOB row, as stored."""
    attempt: int
    window_id: int
    ops: pa.Table
    """Its raw op spans (``core.schema.OP_SPAN``)."""

    @property
    def layout(self) -> JobLayout:
        from core.registration import Registration

        return Registration.from_row(self.registration).layout


def registration(store, job_id: str, attempt: int = -1) -> dict:
    """The job's registration (``attempt`` -1: the latest); ``WindowUnavailable`` when it is not stored."""
    reg = store.run_named("job_info", {"job_id": job_id, "attempt": attempt}).to_pylist()
    if not reg:
        raise WindowUnavailable(f"job {job_id!r} is not registered in the store")
    return reg[0]


def kept_windows(store, job_id: str, attempt: int) -> list[int]:
    """The job attempt's windows whose raw op spans are kept, in order."""
    return [int(w) for w in store.run_named("job_span_windows", {"job_id": job_id, "attempt": attempt})
            .column("window_id").to_pylist()]


def stored_window(store, job_id: str, attempt: int = -1, window_id: int | None = None,
                  reg: dict | None = None) -> StoredWindow:
    """The stored window with its raw op spans; ``window_id`` None: the job's latest that kept them.
    ``reg``: the registration when the caller read it already. ``WindowUnavailable`` says what is missing."""
    from core.config import SPANS_KEPT_RULE

    reg = registration(store, job_id, attempt) if reg is None else reg
    attempt = int(reg["attempt"])
    if window_id is None:
        kept = kept_windows(store, job_id, attempt)
        if not kept:
            raise WindowUnavailable(f"no window of {job_id!r} attempt {attempt} kept its raw op spans "
                                    f"({SPANS_KEPT_RULE})")
        window_id = max(kept)
    ops = store.run_named("window_ops", {"job_id": job_id, "attempt": attempt, "window_id": int(window_id)})
    if ops.num_rows == 0:
        which = ", ".join(str(k) for k in kept_windows(store, job_id, attempt)[-10:]) or "none"
        raise WindowUnavailable(f"no raw op spans are kept for window {window_id} of {job_id!r}; this job's "
                                f"windows with spans: {which} ({SPANS_KEPT_RULE})")
    return StoredWindow(reg, attempt, int(window_id), codec.conform(ops, S.OP_SPAN))
