"""Helpers behind ``stragglerscope sql``: run a named query or read-only SQL, format the result.

    stragglerscope sql fleet_summary --format json
    stragglerscope sql top_wasting_jobs --param team=llm --param limit=5
    stragglerscope sql --query "SELECT job_id, slowdown FROM windows WHERE slowdown > {s:Float64}" --param s=1.5

Every failure is a StoreError with one line (unknown query, bad parameter,
refused SQL, unreachable store).
"""
from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math

import pyarrow as pa

from storage.errors import StoreError
from storage.params import parse_cli_params

FORMATS = ("table", "json", "csv", "parquet")


def list_queries() -> str:
    """One block per named query: name, description, parameters with types and defaults."""
    from storage.queries import NAMED_QUERIES

    lines = []
    for name in sorted(NAMED_QUERIES):
        q = NAMED_QUERIES[name]
        lines.append(f"{name}: {q.description}")
        for p in q.params:
            default = "required" if p.default is None else f"default {p.default!r}"
            lines.append(f"    {p.name} ({p.type}, {default}): {p.description}")
    return "\n".join(lines)


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (dt.date, dt.datetime)):
        return v.isoformat()
    if isinstance(v, bytes):
        return v.hex()
    return v


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.6g}" if abs(v) < 1e6 else f"{v:.0f}"
    if isinstance(v, (dt.date, dt.datetime)):
        return v.isoformat()
    return str(v)


def format_result(table: pa.Table, fmt: str) -> str | bytes:
    """``table`` as text (table, json, csv) or Parquet bytes.

    json: a list of row objects (NaN and infinities as null); table: aligned
    columns for a terminal; csv: a header and one line per row.
    """
    if fmt not in FORMATS:
        raise StoreError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "parquet":
        import pyarrow.parquet as pq

        sink = io.BytesIO()
        pq.write_table(table, sink)
        return sink.getvalue()
    rows = table.to_pylist()
    if fmt == "json":
        return json.dumps([{k: _jsonable(v) for k, v in r.items()} for r in rows], indent=1) + "\n"
    names = table.column_names
    if fmt == "csv":
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(names)
        for r in rows:
            w.writerow(["" if r[n] is None else _jsonable(r[n]) for n in names])
        return out.getvalue()
    cells = [[_cell(r[n]) for n in names] for r in rows]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    for c in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines) + "\n"


def run_sql(store_url: str, name: str | None = None, query: str | None = None, params: list[str] | None = None,
            fmt: str = "table", limits=None) -> str | bytes:
    """Run named query ``name`` or free ``query`` on the store at ``store_url``; the formatted result.

    ``limits`` bound a free query (``[sql]``'s SQLConfig, or SQLLimits; None: their defaults).
    """
    from storage import open_store
    from storage.queries import NAMED_QUERIES

    if bool(name) == bool(query):
        raise StoreError("give either a query name or --query SQL")
    if fmt not in FORMATS:
        raise StoreError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if name and name not in NAMED_QUERIES:
        raise StoreError(f"unknown query {name!r}; known: {', '.join(sorted(NAMED_QUERIES))}")
    values = parse_cli_params(params)
    store = open_store(store_url)
    try:
        store.setup()
        table = store.run_named(name, values) if name else store.query(query, values, limits)
    finally:
        store.close()
    return format_result(table, fmt)
