"""`stragglerscope control set|clear|status`: change a running job's (or the fleet's) sampling and thresholds.

A change is checked here by the same function every reader uses (``core.control.check``), so what the
command refuses no exporter or shard would take, and what it accepts every one of them does; then it is
published on the control topic (``core.control_topic``) and printed with its id, which `clear` takes.
`status` reads the topic back and lists what is in force now. The pipeline stores every change it reads
in the ``control_changes`` table (who, when, what, until), which the console's job page shows.

A change for one job is for a job the store has a registration of (``require_registered``): a mistyped job id
would otherwise be published, stored and never applied, and whoever made it would think it was. The command
line skips that check with ``--force``, for a job about to start (its ranks read the topic from its start).

The same look at the store gives the step a change for one job starts from (``from_step``), the same on every
rank of it (``core.control.agreed_from_step``): its newest window's last step, extrapolated to now at its step
time, plus a few seconds' worth of steps for the change to reach every rank. A job the store has no recent window
of, a change for the fleet, and one made with ``--force`` carry no step: each rank applies them at its next step
end, as it hears of them.

The console makes the same changes through these same functions, only when it is started with control on
(``console_control_off``): the fleet's Kafka and ``ui.control_token_file``, whose token the user types
(``token_matches``). Without that file the console is read-only.
"""
from __future__ import annotations

import dataclasses
import getpass
import hmac
import json
import os
import time

from typing import Callable

from core.control import ControlBook, ControlChange, ControlError, agreed_from_step, check, make_change
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


def control_set(conn: KafkaConn | str, who: str, job_id: str | None, what: dict, for_s: float = 0.0,
                known: Callable[[str], int | None] | None = None) -> ControlChange:
    """Publish a change of ``what`` for ``job_id`` (None: the fleet) lasting ``for_s`` (0: until cleared).

    ``known(job_id)``, given, raises ControlError for a job it does not know (``require_registered``) and returns
    the step the change starts from on every rank of it (0 or None: no step); it runs after the change is checked
    (bad input is refused without touching the store) and before it is published."""
    change = make_change(who, time.time_ns(), job_id, what, for_s)
    if known is not None and change.job_id is not None:
        from_step = known(change.job_id)
        # Thresholds apply at the shard's next decision: a step would be shown (status, audit, console) that
        # nothing waits for.
        if from_step and change.waits_for_a_step:
            change = check(dataclasses.replace(change, from_step=int(from_step)).to_json())
    publish(conn, change)
    return change


def job_from_step(store, job_id: str, now_ns: int) -> int:
    """The step a change for ``job_id`` starts from on all its ranks (``core.control.agreed_from_step``), from the
    newest windows of its newest registered attempt; 0 when the store cannot tell (no window of that attempt yet,
    none recent). A restarted job resumes at its checkpoint's step: its windows of before say nothing of it."""
    t = store.query(
        "SELECT last_step, end_ns, step_time_actual FROM windows WHERE job_id = {job:String} "
        "AND attempt = (SELECT max(attempt) FROM jobs WHERE job_id = {job:String}) "
        "ORDER BY window_id DESC LIMIT 2", {"job": job_id})
    rows = t.to_pylist()
    if not rows:
        return 0
    newest = rows[0]
    period_s = (newest["end_ns"] - rows[1]["end_ns"]) / 1e9 if len(rows) > 1 else 0.0
    return agreed_from_step(int(newest["last_step"]), int(newest["end_ns"]), float(newest["step_time_actual"]),
                            now_ns, period_s)


def registered(store, job_id: str) -> bool:
    """Whether the store's ``jobs`` table has a registration (any attempt) of ``job_id``."""
    t = store.query("SELECT count() AS n FROM jobs WHERE job_id = {job:String}", {"job": job_id})
    return bool(t.num_rows and t.column("n")[0].as_py())


def require_registered(store_url: str, job_id: str, open_store: Callable | None = None,
                       now_ns: int | None = None) -> int:
    """ControlError, one line, unless the store at ``store_url`` has registered ``job_id``; a store that cannot
    be read refuses too (the check was asked for and could not be made), each saying that ``--force`` skips it.
    Returns the step a change for it starts from (``job_from_step``; 0: none). ``open_store``: the store's opener
    (``storage.open_store`` by default; a test passes a fake)."""
    from core.redact import redact_url
    from storage import StoreError

    if open_store is None:
        from storage import open_store
    try:
        store = open_store(store_url)
        try:
            store.setup()
            known = registered(store, job_id)
            from_step = job_from_step(store, job_id, time.time_ns() if now_ns is None else now_ns) if known else 0
        finally:
            store.close()
    except StoreError as e:  # its message is one line already, any password in it masked
        raise ControlError(f"cannot check that job {job_id!r} is registered ({str(e)[:300]}): give --force to "
                           "set it anyway") from None
    if not known:
        raise ControlError(f"job {job_id!r} is not registered in the store {redact_url(store_url)} (no run of it "
                           "has reported): check the id, or give --force for a job about to start")
    return from_step


MAX_TOKEN_BYTES = 4096


def read_console_token(path: str) -> str:
    """The console's control token: the file's text without surrounding whitespace; ControlError (one line) when
    the file cannot be read, is open to other users, or holds nothing (an empty token would match an empty field)."""
    import stat

    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ControlError(f"the console's control token file {path} is not a regular file")
        if mode & 0o077:  # anyone who can read it could change every job's profiling and thresholds
            raise ControlError(f"the console's control token file {path} is open to other users (mode "
                               f"{stat.S_IMODE(mode):04o}): chmod 600 {path}")
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as e:
        raise ControlError(f"cannot read the console's control token file {path}: {e.strerror or e}") from None
    token = raw.decode("utf-8", "replace").strip()
    if not token or len(raw) > MAX_TOKEN_BYTES:
        raise ControlError(f"the console's control token file {path} must hold one token (1 to {MAX_TOKEN_BYTES} "
                           "bytes)")
    return token


def token_matches(typed: str, path: str) -> bool:
    """Whether ``typed`` is the token in ``path``, compared in constant time (the time taken says nothing of how
    much of it was right). ControlError when the file cannot be used."""
    return hmac.compare_digest(typed.strip().encode(), read_console_token(path).encode())


def console_control_off(cfg) -> str:
    """'' when the console (``cfg``: a ``core.config.Config``) may offer run-time changes, else why not, one line."""
    if not cfg.ui.control_token_file:
        return "ui.control_token_file is not set: the console is read-only"
    if not cfg.kafka.bootstrap:
        return "console control needs the fleet's Kafka: set kafka.bootstrap"
    try:
        read_console_token(cfg.ui.control_token_file)
    except ControlError as e:
        return str(e)
    return ""


def control_clear(conn: KafkaConn | str, who: str, job_id: str | None, change_id: str = "*") -> ControlChange:
    """End the change ``change_id`` (``*``: every change of the job's, or the fleet's, scope). A clear is one record
    per setting it ends (``core.control.records_of``): ``*`` ends every setting of the scope; one change, the
    settings it still holds, read from the topic first (ControlError when it holds none: cleared, run out or
    replaced by a later change of each of its settings)."""
    unset = None
    if change_id and change_id != "*":
        _, book = control_status(conn)
        scope = "fleet" if job_id is None else f"job:{job_id}"
        unset = sorted(name for (sc, name), held in book.held.items()
                       if sc == scope and held[-1].change_id == change_id)
        if not unset:
            raise ControlError(f"change {change_id} holds no setting of {scope} now (cleared, run out, replaced by "
                               "later changes, or of another scope): nothing to clear")
    change = make_change(who, time.time_ns(), job_id, {}, clears=change_id or "*", unset=unset)
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
    book.take(records)
    book.flush()  # the end of the topic: a change whose other parts were compacted away is whole as it is
    now = time.time_ns()
    return (book.in_force(now) if job_id is None else book.in_force(now, job_id)), book


def format_status(changes: list[ControlChange], book: ControlBook, job_id: str | None = None) -> str:
    if not changes:
        lines = ["nothing in force" + (f" for {job_id}" if job_id else "") + ": every job runs with its own settings"]
    else:
        lines = [f"{'change':<17} {'scope':<24} {'who':<12} {'since (UTC)':<20} {'until (UTC)':<20} "
                 f"{'from step':<10} settings"]
        for c in changes:
            what = ", ".join(f"{k}={v}" for k, v in sorted(c.what.items()))
            step = str(c.from_step) if c.from_step else "next"  # next: each rank's next step end
            lines.append(f"{c.change_id:<17} {c.scope[:24]:<24} {c.who[:12]:<12} {_utc(c.when):<20} "
                         f"{_utc(c.until) if c.until else 'until cleared':<20} {step:<10} {what}")
        if job_id:
            merged = ", ".join(f"{k}={v}" for k, v in sorted(book.settings(time.time_ns(), job_id).items()))
            lines.append(f"in force for {job_id}: {merged}")
    if book.refused:
        lines.append(f"{len(book.refused)} record(s) on the topic refused, the last: {book.refused[-1]}")
    return "\n".join(lines)


def audit_states(rows: list[dict], now_ns: int, when: Callable[[int], str] | None = None) -> list[str]:
    """What became of each stored change (rows of the ``control_changes`` table, any order), as the console's job
    page says it: ``clears ...`` for a record that clears; ``in force`` (with until when), ``cleared``, ``ran out``
    or ``replaced by <change>`` for a change. A later change of a setting in the same scope replaces the earlier
    (``core.control``: the earlier does not come back when the later ends), so each setting of a change ends at
    the first of: a clear of it or of its whole scope, a later change of that setting, its ``until``. A change
    whose settings did not all end says which did (``in force ...; sample replaced by <change>``). ``when``
    writes a time (default: UTC)."""
    when = when or (lambda ns: f"{_utc(ns)} UTC")
    later: dict[tuple[str, str], list[tuple[int, str]]] = {}  # (scope, setting) -> [(when, change id)]
    clears: dict[str, list[tuple[int, str]]] = {}  # scope -> [(when, cleared id or '*')]
    what = [json.loads(r["what_json"] or "{}") for r in rows]
    for r, w in zip(rows, what):
        if r["clears"]:
            clears.setdefault(r["scope"], []).append((r["when_ns"], r["clears"]))
        for name in w:
            later.setdefault((r["scope"], name), []).append((r["when_ns"], r["change_id"]))
    out = []
    for r, w in zip(rows, what):
        if r["clears"]:
            out.append("clears " + ("every change of its scope" if r["clears"] == "*" else r["clears"]))
            continue
        t0, until = r["when_ns"], r["until_ns"]
        cleared = min((t for t, c in clears.get(r["scope"], ()) if t > t0 and c in ("*", r["change_id"])),
                      default=None)
        ran_out = until if until and until <= now_ns else None
        ends = {}  # setting -> (when, why)
        for name in sorted(w):
            by = min(((t, c) for t, c in later[(r["scope"], name)] if t > t0), default=None)
            candidates = [e for e in ((cleared, "cleared"), (ran_out, "ran out"),
                                      (by and by[0], by and f"replaced by {by[1]}")) if e[0] is not None]
            if candidates:
                ends[name] = min(candidates)
        whys = list(dict.fromkeys(why for _, why in ends.values()))
        if w and len(ends) == len(w):
            out.append(", ".join(whys))
            continue
        state = "in force" + (f" until {when(until)}" if until else " until cleared")
        if ends:
            state += "; " + ", ".join(f"{name} {why}" for name, (_, why) in sorted(ends.items()))
        out.append(state)
    return out


def _utc(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9))
