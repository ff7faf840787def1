"""Reading SQL text without executing it: placeholders, the read-only check, rewriting.

Parameters are written as ClickHouse query parameters, ``{name:Type}``, in
every query (named or free). This module finds them outside string literals
and comments, checks that a statement only reads, and rewrites placeholders
for an engine that cannot bind them itself (see ``storage.params``). It never
puts a value into SQL text.
"""
from __future__ import annotations

import dataclasses
import re

from storage.errors import StoreError

_PLACEHOLDER = re.compile(r"\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*([A-Za-z][A-Za-z0-9_(), ]*?)\s*\}")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

READ_STATEMENTS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXISTS", "EXPLAIN"})
WRAPPABLE = frozenset({"SELECT", "WITH"})  # statements that can be a subquery


@dataclasses.dataclass(frozen=True)
class Segment:
    kind: str  # code, string, comment, placeholder
    text: str
    name: str = ""
    type: str = ""


def segments(sql: str) -> list[Segment]:
    """Split SQL into code, string literals, quoted identifiers, comments and placeholders."""
    out: list[Segment] = []
    i, n, start = 0, len(sql), 0

    def flush(upto: int) -> None:
        if upto > start:
            out.append(Segment("code", sql[start:upto]))

    while i < n:
        c = sql[i]
        if c in "'\"`":
            flush(i)
            j = i + 1
            while j < n:
                if sql[j] == "\\":
                    j += 2
                    continue
                if sql[j] == c:
                    if j + 1 < n and sql[j + 1] == c:  # doubled quote
                        j += 2
                        continue
                    break
                j += 1
            if j >= n:
                raise StoreError(f"unterminated quote {c} in SQL")
            out.append(Segment("string" if c == "'" else "identifier", sql[i:j + 1]))
            i = start = j + 1
        elif sql.startswith("--", i) or c == "#":
            flush(i)
            j = sql.find("\n", i)
            j = n if j < 0 else j
            out.append(Segment("comment", sql[i:j]))
            i = start = j
        elif sql.startswith("/*", i):
            flush(i)
            j = sql.find("*/", i + 2)
            if j < 0:
                raise StoreError("unterminated /* comment in SQL")
            out.append(Segment("comment", sql[i:j + 2]))
            i = start = j + 2
        elif c == "{":
            m = _PLACEHOLDER.match(sql, i)
            if not m:
                i += 1
                continue
            flush(i)
            out.append(Segment("placeholder", m.group(0), m.group(1), " ".join(m.group(2).split())))
            i = start = m.end()
        else:
            i += 1
    flush(n)
    return out


def placeholders(sql: str) -> dict[str, str]:
    """``{name: ClickHouse type}`` of every placeholder; one name used with two types is an error."""
    found: dict[str, str] = {}
    for seg in segments(sql):
        if seg.kind == "placeholder":
            if found.setdefault(seg.name, seg.type) != seg.type:
                raise StoreError(f"parameter {seg.name!r} is used as {found[seg.name]} and as {seg.type}")
    return found


def _code_words(segs: list[Segment]) -> list[str]:
    return [w.upper() for s in segs if s.kind == "code" for w in _WORD.findall(s.text)]


def check_read_only(sql: str) -> tuple[str, str]:
    """Refuse anything but one reading statement; returns (sql without a trailing ';', first keyword).

    Allowed: SELECT, WITH ... SELECT, SHOW, DESCRIBE, EXISTS, EXPLAIN. Refused
    with a StoreError naming the reason: DDL and DML (INSERT, ALTER, DROP,
    CREATE, ...), several statements, SET, ``INTO OUTFILE`` and ``FORMAT``
    (results always come back as Arrow; choose the output format outside SQL).
    """
    text = sql.strip()
    while text.endswith(";"):
        text = text[:-1].rstrip()
    if not text:
        raise StoreError("empty query")
    segs = segments(text)
    for s in segs:
        if s.kind == "code" and ";" in s.text:
            raise StoreError("only one statement per query (found ';' between statements)")
    words = _code_words(segs)
    if not words:
        raise StoreError("no SQL statement found")
    first = words[0]
    if first not in READ_STATEMENTS:
        raise StoreError(f"read-only store: {first} statements are refused (only SELECT, WITH, SHOW, DESCRIBE, "
                         "EXISTS and EXPLAIN run here)")
    for a, b in zip(words, words[1:]):
        if a == "INTO" and b == "OUTFILE":
            raise StoreError("read-only store: INTO OUTFILE is refused")
    if "FORMAT" in words[1:]:
        raise StoreError("FORMAT clauses are not supported: results come back as Arrow (use --format)")
    if first == "EXPLAIN" and any(w in words for w in ("INSERT", "ALTER", "DROP", "CREATE", "TRUNCATE")):
        raise StoreError("read-only store: EXPLAIN of a writing statement is refused")
    return text, first


def external_params_sql(sql: str, table: str = "_params") -> tuple[str, str | None]:
    """Rewrite ``{name:Type}`` to ``(SELECT name FROM _params)`` for an engine without query parameters.

    ``_params`` is a one-row external table that carries the typed values
    (the native protocol sends it beside the query). A placeholder right
    after LIMIT cannot be a subquery on old engines: it is removed, and its
    name returned so that the caller applies the limit to the result.
    """
    out: list[str] = []
    limit_name: str | None = None
    segs = segments(sql)
    for seg in segs:
        if seg.kind != "placeholder":
            out.append(seg.text)
            continue
        prev = "".join(out).rstrip()
        if re.search(r"\bLIMIT$", prev, re.IGNORECASE):
            if limit_name is not None:
                raise StoreError("only one parameterised LIMIT per query")
            cut = re.search(r"\bLIMIT$", prev, re.IGNORECASE).start()
            out = [prev[:cut]]
            limit_name = seg.name
            continue
        out.append(f"(SELECT {quote_ident(seg.name)} FROM {table})")
    return "".join(out), limit_name


def quote_ident(name: str) -> str:
    return "`" + name + "`"


def replace_identifier(sql: str, name: str, replacement: str) -> str:
    """Replace a bare identifier in code segments only (internal SQL: external tables on chDB)."""
    pat = re.compile(rf"(?<![A-Za-z0-9_.]){re.escape(name)}(?![A-Za-z0-9_])")
    return "".join(pat.sub(replacement, s.text) if s.kind == "code" else s.text for s in segments(sql))
