"""Numbers as a person reads them: times as '3 min ago' and clock times, tables without raw nanoseconds.

The store keeps times as nanoseconds since the epoch (exact, cheap to compare);
nobody reads 1795812303008193449. Every page shows times through here: the
age first (what an on-call engineer asks at 3 a.m.), then the clock time in the
viewer's own time zone and in UTC (what a shared incident channel uses).
Pure: no Streamlit, so the formats are unit-tested.
"""
from __future__ import annotations

import datetime as dt
import re
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import pandas as pd

_NS = 1_000_000_000
EPOCH_NS_MIN = 10**18  # 2001-09-09: a smaller integer is a duration, a count or a job-clock offset, not a time
EPOCH_NS_MAX = 4 * 10**18  # 2096


def is_epoch_ns(v) -> bool:
    """Whether ``v`` looks like a wall-clock time in ns (what the store's *_ns columns mostly hold)."""
    try:
        return EPOCH_NS_MIN <= int(v) < EPOCH_NS_MAX
    except (TypeError, ValueError, OverflowError):
        return False


def ago(ns: int, now_ns: int) -> str:
    """'just now', '42 s ago', '3 min ago', '5 h ago', '2 days ago'; 'in 3 min' for a clock ahead of ours."""
    s = (int(now_ns) - int(ns)) / _NS
    if abs(s) < 5:
        return "just now"
    a = abs(s)
    if a < 60:
        n = f"{a:.0f} s"
    elif a < 3600:
        n = f"{a / 60:.0f} min"
    elif a < 2 * 86400:
        n = f"{a / 3600:.0f} h"
    else:
        n = f"{a / 86400:.0f} days"
    return f"{n} ago" if s > 0 else f"in {n}"


def zone(name: str | None) -> ZoneInfo | None:
    """The viewer's time zone (an IANA name from the browser), or None when unknown or UTC itself."""
    if not name or name in ("UTC", "Etc/UTC", "GMT"):
        return None
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return None


def _stamp(t: dt.datetime, now: dt.datetime) -> str:
    """Clock time; the date only when it is not today, the year only when it is not this year."""
    if t.date() == now.date():
        return t.strftime("%H:%M:%S")
    if t.year == now.year:
        return t.strftime("%b %d, %H:%M")
    return t.strftime("%Y-%m-%d %H:%M")


def clock(ns: int, now_ns: int, tz: str | None = None) -> str:
    """'01:38:56 CET · 00:38:56 UTC' (the viewer's zone first); '00:38:56 UTC' alone when they are the same."""
    utc = dt.datetime.fromtimestamp(int(ns) / _NS, dt.UTC)
    now = dt.datetime.fromtimestamp(int(now_ns) / _NS, dt.UTC)
    text = f"{_stamp(utc, now)} UTC"
    local = zone(tz)
    if local is not None:
        lt = utc.astimezone(local)
        if lt.utcoffset():
            text = f"{_stamp(lt, now.astimezone(local))} {lt.tzname()} · {text}"
    return text


def when(ns: int, now_ns: int, tz: str | None = None) -> str:
    """'3 min ago (01:38:56 CET · 00:38:56 UTC)': the age and the clock time together."""
    return f"{ago(ns, now_ns)} ({clock(ns, now_ns, tz)})"


_NS_COLUMN = re.compile(r"(_ns|^hang_id)$")


def readable_frame(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of a query's result for the screen: wall-clock ns columns as UTC times, renamed '… (UTC)'.

    Only integer columns whose name says nanoseconds (``*_ns``, ``hang_id``) and whose values are
    wall-clock times are converted: a job-clock ``since_ns`` of a synthetic job (seconds after 1970)
    or a duration stays a number. Downloads keep the raw values; this is for reading only.
    """
    out = df.copy()
    renames = {}
    for col in df.columns:
        if not _NS_COLUMN.search(str(col)) or not pd.api.types.is_integer_dtype(df[col]):
            continue
        vals = df[col]
        ok = vals.map(is_epoch_ns)
        # 0 or -1 stand for "not yet" (an alert nobody acknowledged): they become blanks, not 1970.
        if len(vals) and ok.any() and (ok | (vals <= 0)).all():
            t = pd.to_datetime(vals.where(ok), unit="ns", utc=True)
            out[col] = t.dt.tz_localize(None).dt.floor("s")
            renames[col] = re.sub(r"_ns$", "", str(col)) + " (UTC)"
    return out.rename(columns=renames)


def alert_target(alert: dict) -> dict[str, str]:
    """The job page's query parameters that open what an alert is about: its job at its window or hang.

    The window is in the alert's details (``window_id``); a hang alert names its hang by the last part
    of its id (``job/attempt/hang/<hang_id>``, the schema's stable id), as does an analysis failure its
    window.
    """
    import json

    q = {"job": str(alert["job_id"]), "attempt": str(int(alert.get("attempt") or 0))}
    tail = str(alert.get("alert_id") or "").rsplit("/", 1)[-1]
    if alert.get("rule") in ("hang", "node_loss", "hang_ended"):
        if tail.isdigit():
            q["hang"] = tail
    else:
        try:
            details = json.loads(alert.get("details_json") or "{}")
        except ValueError:
            details = {}
        w = details.get("window_id") if isinstance(details, dict) else None
        if w is None and tail.lstrip("-").isdigit():
            w = tail
        if w is not None:
            q["window"] = str(int(w))
    if alert.get("alert_id"):
        q["alert"] = str(alert["alert_id"])
    return q


def alert_subject(alert: dict) -> str:
    """What of the job an alert is about, for its link: 'window 30', 'the hang', or '' (the job)."""
    q = alert_target(alert)
    if "hang" in q:
        return {"node_loss": "node loss", "hang_ended": "stall"}.get(alert.get("rule"), "hang")
    return f"window\u00a0{q['window']}" if "window" in q else ""  # 'window' and its number on one line


def alert_text(alert: dict) -> str:
    """The alert's summary without the job id it starts with (the job is shown beside it)."""
    s, job = str(alert.get("summary") or ""), str(alert.get("job_id") or "")
    return s[len(job) + 2:] if job and s.startswith(job + ": ") else s


_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]<>#|~$:])")


def md_escape(text: str) -> str:
    """Text shown through Markdown as written: a group 'ranks:0-3' or 'last_stage_imbalance' stays itself."""
    return _MD_SPECIAL.sub(r"\\\1", str(text))
