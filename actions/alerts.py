"""Acknowledging alerts: the on-call's "seen, handled" kept in the store, so every console agrees.

An acknowledgement is a row of ``alert_ack`` (``core.schema.ALERT_ACK``); the
latest row per alert wins, so an acknowledgement can be undone, and the alert
feed's named query reads the state back (``storage.queries``).
"""
from __future__ import annotations

import time

import pyarrow as pa


def acknowledge(store, alert_ids, by: str = "", note: str = "", acked: bool = True,
                now_ns: int | None = None) -> int:
    """Record that alerts were (or, with ``acked=False``, no longer are) acknowledged; returns the count."""
    ids = sorted({str(a) for a in alert_ids if str(a)})
    if not ids:
        return 0
    ts = time.time_ns() if now_ns is None else int(now_ns)
    store.insert("alert_ack", pa.table({
        "alert_id": ids, "acked_ns": pa.array([ts] * len(ids), pa.int64()),
        "acked": pa.array([1 if acked else 0] * len(ids), pa.uint8()),
        "acked_by": [str(by)[:200]] * len(ids), "note": [str(note)[:2000]] * len(ids)}))
    return len(ids)
