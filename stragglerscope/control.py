"""`stragglerscope control set|clear|status`: change a running job's (or the fleet's) sampling and thresholds.

A change is checked here by the same function every reader uses (``core.control.check``), so what the
command refuses no exporter or shard would take, and what it accepts every one of them does; then it is
published on the control topic (``core.control_topic``) and printed with its id, which `clear` takes.
`status` reads the topic back and lists what is in force now. The pipeline stores every change it reads
in the ``control_changes`` table (who, when, what, until), which the console's job page shows.
"""
from __future__ import annotations

import getpass
import os
import time

from core.control import ControlBook, ControlChange, ControlError, make_change
from core.control_topic import ControlReader, publish
from core.kafka_conn import KafkaConn


def who_am_i(given: str | None = None) -> str:
    """``--who``, else $USER, else the login name: every change says who made it."""
    who = given or os.environ.get("USER") or ""
    if not who:
        try:
            who = getpass.getuser()
        except Exception:  # no user database entry (a container): the change must still name someone
            who = ""
    if not who:
        raise ControlError("who made the change is unknown: give --who NAME")
    return who


def control_set(conn: KafkaConn | str, who: str, job_id: str | None, what: dict, for_s: float = 0.0) -> ControlChange:
    """Publish a change of ``what`` for ``job_id`` (None: the fleet) lasting ``for_s`` (0: until cleared)."""
    change = make_change(who, time.time_ns(), job_id, what, for_s)
    publish(conn, change)
    return change


def control_clear(conn: KafkaConn | str, who: str, job_id: str | None, change_id: str = "*") -> ControlChange:
    """End the change ``change_id`` (``*``: every change of the job's, or the fleet's, scope)."""
    change = make_change(who, time.time_ns(), job_id, {}, clears=change_id or "*")
    publish(conn, change)
    return change


def control_status(conn: KafkaConn | str, job_id: str | None = None, timeout_s: float = 10.0) \
        -> tuple[list[ControlChange], ControlBook]:
    """The changes in force now (all of them, or those that apply to ``job_id``), and the book they came from."""
    reader = ControlReader(conn, client_id="stragglerscope-control-status")
    try:
        records = reader.read_all(timeout_s)
    finally:
        reader.close()
    book = ControlBook()
    for r in records:
        book.add(r)
    now = time.time_ns()
    return (book.in_force(now) if job_id is None else book.in_force(now, job_id)), book


def format_status(changes: list[ControlChange], book: ControlBook, job_id: str | None = None) -> str:
    if not changes:
        lines = ["nothing in force" + (f" for {job_id}" if job_id else "") + ": every job runs with its own settings"]
    else:
        lines = [f"{'change':<17} {'scope':<24} {'who':<12} {'since (UTC)':<20} {'until (UTC)':<20} settings"]
        for c in changes:
            what = ", ".join(f"{k}={v}" for k, v in sorted(c.what.items()))
            lines.append(f"{c.change_id:<17} {c.scope[:24]:<24} {c.who[:12]:<12} {_utc(c.when):<20} "
                         f"{_utc(c.until) if c.until else 'until cleared':<20} {what}")
        if job_id:
            merged = ", ".join(f"{k}={v}" for k, v in sorted(book.settings(time.time_ns(), job_id).items()))
            lines.append(f"in force for {job_id}: {merged}")
    if book.refused:
        lines.append(f"{len(book.refused)} record(s) on the topic refused, the last: {book.refused[-1]}")
    return "\n".join(lines)


def _utc(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9))
