"""Query parameters: typed, validated, bound by the engine, never spliced into SQL.

How binding works (both backends run the same SQL text):

- Queries name parameters as ClickHouse query parameters, ``{since:Int64}``.
- chDB (engine 26.x) binds them itself: the text goes unchanged to
  ``Session.query(sql, params=...)`` and the engine parses each value as its
  declared type.
- The 18.16 server has no server-side parameters. There, each placeholder
  becomes a scalar subquery ``(SELECT since FROM _params)`` over ``_params``,
  a one-row *external table* that clickhouse-driver sends beside the query
  over the native protocol with typed columns. The value travels as data in
  the column's binary encoding, so a quote in a value cannot end a literal.
  18.16 accepts only a literal after LIMIT: a ``LIMIT {n:UInt64}`` is removed
  there and applied to the result instead (documented; results are the same).

This module turns user input (strings from the command line, numbers and
dates from the console) into values of the declared type, or raises
StoreError with a one-line reason.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from typing import Any

from storage.errors import StoreError

INT_RANGES = {
    "Int8": (-2**7, 2**7 - 1), "Int16": (-2**15, 2**15 - 1), "Int32": (-2**31, 2**31 - 1),
    "Int64": (-2**63, 2**63 - 1), "UInt8": (0, 2**8 - 1), "UInt16": (0, 2**16 - 1),
    "UInt32": (0, 2**32 - 1), "UInt64": (0, 2**64 - 1),
}
FLOATS = ("Float32", "Float64")
SUPPORTED = tuple(INT_RANGES) + FLOATS + ("String", "Date")

NS_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter of a named query.

    ``type`` is the ClickHouse type in the SQL placeholder. ``time=True``
    accepts nanoseconds since the epoch or an ISO date/time (UTC unless it
    says otherwise) and binds nanoseconds.
    """

    name: str
    type: str
    default: Any
    description: str = ""
    time: bool = False


def parse_time_ns(value: Any, name: str = "time") -> int:
    """Nanoseconds since the epoch from an int/float (ns), a date, a datetime or an ISO string."""
    if isinstance(value, bool):
        raise StoreError(f"parameter {name!r}: expected ns since the epoch or an ISO date, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise StoreError(f"parameter {name!r}: not a finite time: {value!r}")
        return int(value)
    if isinstance(value, dt.datetime):
        stamp = value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
        return int(stamp.timestamp()) * 1_000_000_000 + stamp.microsecond * 1000
    if isinstance(value, dt.date):
        return parse_time_ns(dt.datetime(value.year, value.month, value.day), name)
    if hasattr(value, "value") and hasattr(value, "tz_localize"):  # pandas.Timestamp
        return int(value.value)
    text = str(value).strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            return parse_time_ns(dt.date.fromisoformat(text), name)
        return parse_time_ns(dt.datetime.fromisoformat(text.replace("Z", "+00:00")), name)
    except ValueError:
        raise StoreError(f"parameter {name!r}: expected ns since the epoch or an ISO date "
                         f"(2024-05-01 or 2024-05-01T12:00:00Z), got {text!r}") from None


def coerce(name: str, ch_type: str, value: Any) -> Any:
    """``value`` as a Python value of ClickHouse type ``ch_type``, or StoreError."""
    base = ch_type
    m = re.fullmatch(r"(?:LowCardinality|Nullable)\((.*)\)", ch_type)
    if m:
        base = m.group(1)
    if base not in SUPPORTED:
        raise StoreError(f"parameter {name!r}: type {ch_type} is not supported (use one of {', '.join(SUPPORTED)})")
    if value is None:
        raise StoreError(f"parameter {name!r} ({ch_type}) has no value")
    if base in INT_RANGES:
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            text = str(value).strip()
            if not re.fullmatch(r"[+-]?\d+", text):
                raise StoreError(f"parameter {name!r}: expected an integer ({ch_type}), got {text!r}")
            value = int(text)
        lo, hi = INT_RANGES[base]
        if not lo <= value <= hi:
            raise StoreError(f"parameter {name!r}: {value} is out of range for {ch_type}")
        return int(value)
    if base in FLOATS:
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise StoreError(f"parameter {name!r}: expected a number ({ch_type}), got {value!r}") from None
        if not math.isfinite(out):
            raise StoreError(f"parameter {name!r}: expected a finite number, got {value!r}")
        return out
    if base == "Date":
        if isinstance(value, dt.datetime):
            return value.date()
        if isinstance(value, dt.date):
            return value
        try:
            return dt.date.fromisoformat(str(value).strip()[:10])
        except ValueError:
            raise StoreError(f"parameter {name!r}: expected a date YYYY-MM-DD, got {value!r}") from None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    text = str(value)
    if "\x00" in text:
        raise StoreError(f"parameter {name!r}: NUL characters are not allowed")
    return text


def bind(specs: tuple[ParamSpec, ...], given: dict[str, Any] | None, query_name: str = "") -> dict[str, tuple[str, Any]]:
    """Named-query parameters: defaults filled, unknown names refused, values coerced.

    Returns ``{name: (ClickHouse type, value)}`` for every spec. A value of
    None or "" means "not given" and takes the default.
    """
    given = dict(given or {})
    known = {p.name: p for p in specs}
    unknown = sorted(set(given) - set(known))
    if unknown:
        where = f" of {query_name}" if query_name else ""
        raise StoreError(f"unknown parameter {unknown[0]!r}{where}; known: {', '.join(known) or 'none'}")
    out: dict[str, tuple[str, Any]] = {}
    for p in specs:
        v = given.get(p.name)
        if v is None or (isinstance(v, str) and not v.strip()):
            v = p.default
        if v is None:
            where = f"{query_name}: " if query_name else ""
            raise StoreError(f"{where}parameter {p.name!r} ({p.type}) is required")
        if p.time:
            v = parse_time_ns(v, p.name)
        out[p.name] = (p.type, coerce(p.name, p.type, v))
    return out


def bind_free(types: dict[str, str], given: dict[str, Any] | None) -> dict[str, tuple[str, Any]]:
    """Parameters of free SQL: each placeholder needs a value, and each value a placeholder."""
    given = dict(given or {})
    missing = sorted(set(types) - set(given))
    if missing:
        raise StoreError(f"parameter {missing[0]!r} ({types[missing[0]]}) has no value")
    extra = sorted(set(given) - set(types))
    if extra:
        raise StoreError(f"parameter {extra[0]!r} is not used by the query (write it as {{{extra[0]}:Type}})")
    return {n: (t, coerce(n, t, given[n])) for n, t in types.items()}


def parse_cli_params(items: list[str] | None) -> dict[str, str]:
    """``["k=v", ...]`` from ``--param`` into a dict; a malformed item raises StoreError."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise StoreError(f"bad --param {item!r}: write NAME=VALUE")
        if key in out:
            raise StoreError(f"--param {key} given twice")
        out[key] = value
    return out
