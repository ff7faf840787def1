"""Free SQL is a sandbox: it reads the project's tables with pure functions, within limits.

``Store.query`` (``stragglerscope sql --query``, the console's SQL tab) runs
SQL that a person typed. Before it reaches the engine, ``check_free_sql``
reads the statement with the tokenizer of ``storage.sqltext`` and refuses,
with a one-line StoreError naming the offending part:

- anything but one reading statement (``check_read_only``), and ``SETTINGS``,
  ``FORMAT`` and ``INTO OUTFILE`` anywhere in it;
- a function not in the allowlist of pure functions (``storage.sqlfuncs``):
  every ``name(`` counts, whatever its position or nesting (select list,
  WHERE, lambdas, subqueries, CTEs), and so does the function of ``APPLY``.
  Table functions (``file``, ``url``, ``s3``, ``remote``, ``numbers``, ...)
  and functions that read files, settings, dictionaries or server state
  (``file``, ``getSetting``, ``dictGet``, ``joinGet``, ``hostName``, ...)
  are not in it;
- a table that is not the project's: wherever a table can be named (after
  FROM, JOIN, a comma in a FROM list, IN, DESCRIBE, EXISTS, SHOW CREATE),
  the name must be one of ``PROJECT_TABLES`` (the views readers query, their
  ``*_data`` tables and ``schema_version``) or a CTE where it is defined (its
  SELECT and the subqueries inside; name it again in each SELECT of a
  UNION). ``system`` and ``information_schema`` tables are refused too: they
  show other databases, settings, running queries and the server's files;
  ``SHOW TABLES`` (its answer limited to the project's tables) and
  ``DESCRIBE`` answer what an analyst needs from them;
- ``SHOW`` other than ``SHOW TABLES [LIKE ...]`` and ``SHOW CREATE TABLE``,
  and ``EXPLAIN`` of anything but a SELECT;
- text the engine could read differently from this tokenizer: ``$``
  (heredoc strings), ``{`` other than a ``{name:Type}`` placeholder,
  backslashes in quoted names, characters outside ASCII in code.

The engines then run the statement read-only (``readonly = 1``, so no
setting can be changed by it) within ``SQLLimits``: time and memory as
ClickHouse settings, rows by reading at most ``max_result_rows + 1`` of the
result (a ``max_result_rows`` setting would also count the rows of every
subquery, and ``x IN (SELECT ...)`` over a large table would fail).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from storage import ddl
from storage.errors import StoreError
from storage.sqlfuncs import is_allowed_function
from storage.sqltext import check_read_only, segments

PROJECT_TABLES: frozenset[str] = frozenset(
    [t.name for t in ddl.TABLES] + [t.data for t in ddl.TABLES] + [ddl.distributed_name(t) for t in ddl.TABLES]
    + [ddl.SCHEMA_VERSION_TABLE])
"""The tables free SQL may read: the deduplicating views, their data tables (on a cluster: one server's
shard, and every shard's through the Distributed ``*_data_all``), the schema version."""


# --------------------------------------------------------------------------
# limits
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SQLLimits:
    """Limits of one free query; the defaults are those of ``[sql]`` in the configuration."""

    max_execution_time_s: float = 30.0
    max_memory_mb: int = 2048
    max_result_rows: int = 100_000

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise StoreError(f"SQL limit {f.name} must be a positive number, got {v!r}")

    @classmethod
    def of(cls, limits: Any = None) -> "SQLLimits":
        """Limits from None (the defaults), SQLLimits, a dict, or any object with the three attributes
        (``core.config.SQLConfig``)."""
        if limits is None:
            return cls()
        if isinstance(limits, cls):
            return limits
        if isinstance(limits, dict):
            get = limits.get
        else:
            def get(name, default=None):
                return getattr(limits, name, default)
        base = cls()
        try:
            return cls(float(get("max_execution_time_s", base.max_execution_time_s)),
                       int(get("max_memory_mb", base.max_memory_mb)),
                       int(get("max_result_rows", base.max_result_rows)))
        except (TypeError, ValueError) as e:
            raise StoreError(f"bad SQL limits {limits!r}: {e}") from None

    def capped(self, ceiling: "SQLLimits") -> "SQLLimits":
        """Each limit no larger than ``ceiling``'s (a store daemon caps what its clients ask for)."""
        return SQLLimits(min(self.max_execution_time_s, ceiling.max_execution_time_s),
                         min(self.max_memory_mb, ceiling.max_memory_mb),
                         min(self.max_result_rows, ceiling.max_result_rows))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def settings(self) -> dict[str, int]:
        """ClickHouse settings for time and memory (whole seconds: 18.16 takes no fractions)."""
        return {"max_execution_time": max(1, math.ceil(self.max_execution_time_s)),
                "max_memory_usage": int(self.max_memory_mb) * 1024 * 1024}

    def check_rows(self, n_rows: int) -> None:
        if n_rows > self.max_result_rows:
            raise StoreError(f"the result has more than {self.max_result_rows} rows (the [sql] max_result_rows "
                             "limit): add a LIMIT or aggregate")


def limited(sql: str, limits: SQLLimits) -> str:
    """A SELECT/WITH statement that returns at most ``max_result_rows + 1`` rows (one more tells "too many")."""
    return f"SELECT * FROM (\n{sql}\n) LIMIT {int(limits.max_result_rows) + 1}"


def limit_error(message: str, limits: SQLLimits) -> str:
    """The engine's error for a broken limit, with the limit named."""
    if "TIMEOUT_EXCEEDED" in message or "Timeout exceeded" in message or message.startswith("Code: 159."):
        return (f"free SQL ran past the [sql] max_execution_time_s limit ({limits.max_execution_time_s:g} s): "
                f"{message}")
    if "MEMORY_LIMIT_EXCEEDED" in message or "Memory limit" in message or message.startswith("Code: 241."):
        return f"free SQL needed more than the [sql] max_memory_mb limit ({limits.max_memory_mb} MB): {message}"
    return message


# --------------------------------------------------------------------------
# tokens
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Token:
    kind: str  # word (bare name or keyword), ident (quoted name), string, number, punct, placeholder
    text: str  # as written; for ident the name without quotes

    def is_punct(self, text: str) -> bool:
        return self.kind == "punct" and self.text == text

    @property
    def upper(self) -> str:
        return self.text.upper() if self.kind == "word" else ""

    @property
    def is_name(self) -> bool:
        return self.kind in ("word", "ident")


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"0[xX][0-9A-Fa-f]+|0[bB][01]+|[0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?")
_OPERATORS = ("->", "::", "||", "<=", ">=", "!=", "<>", "==")
_PUNCT = set("()[],.+-*/%=<>!|:?^")


def tokens(sql: str) -> list[Token]:
    """The statement's tokens, comments left out; refuses text this reader and the engine might read apart."""
    out: list[Token] = []
    for seg in segments(sql):
        if seg.kind == "comment":
            continue
        if seg.kind == "string":
            out.append(Token("string", seg.text))
        elif seg.kind == "placeholder":
            out.append(Token("placeholder", seg.text))
        elif seg.kind == "identifier":
            body = seg.text[1:-1]
            if "\\" in body:
                raise StoreError(f"free SQL: backslashes in quoted names are refused ({seg.text[:40]})")
            out.append(Token("ident", body.replace(seg.text[0] * 2, seg.text[0])))
        else:
            out.extend(_code_tokens(seg.text))
    return out


def _code_tokens(text: str) -> list[Token]:
    out: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\n\r\f\v":
            i += 1
            continue
        m = _WORD.match(text, i)
        if m:
            out.append(Token("word", m.group(0)))
            i = m.end()
            continue
        m = _NUMBER.match(text, i)
        if m:
            out.append(Token("number", m.group(0)))
            i = m.end()
            continue
        op = next((o for o in _OPERATORS if text.startswith(o, i)), None)
        if op:
            out.append(Token("punct", op))
            i += len(op)
            continue
        if c in _PUNCT:
            out.append(Token("punct", c))
            i += 1
            continue
        if c == "$":
            raise StoreError("free SQL: '$' is refused (heredoc strings); quote strings with '")
        if c in "{}":
            raise StoreError("free SQL: braces are only for {name:Type} parameters")
        shown = c if c.isprintable() and ord(c) < 128 else f"U+{ord(c):04X}"
        raise StoreError(f"free SQL: the character {shown!r} is refused outside strings and quoted names")
    return out


# --------------------------------------------------------------------------
# the check
# --------------------------------------------------------------------------
# Keywords that may stand right before "(" without being a function call.
_PAREN_KEYWORDS = frozenset({
    "SELECT", "FROM", "WHERE", "PREWHERE", "AND", "OR", "NOT", "IN", "AS", "ON", "USING", "JOIN", "BY", "HAVING",
    "LIMIT", "OFFSET", "UNION", "ALL", "DISTINCT", "EXCEPT", "INTERSECT", "WITH", "CASE", "WHEN", "THEN", "ELSE",
    "IS", "LIKE", "ILIKE", "BETWEEN", "EXISTS", "OVER", "INTERVAL", "ANY", "QUALIFY", "TOP", "DIV", "MOD", "ROLLUP",
    "CUBE", "SETS", "GROUPING", "FILTER", "INTERPOLATE", "STEP", "TO", "SAMPLE", "GLOBAL",
})
# Clauses that end a FROM list (a comma after them does not name another table).
_FROM_ENDERS = frozenset({
    "WHERE", "PREWHERE", "GROUP", "ORDER", "HAVING", "LIMIT", "UNION", "EXCEPT", "INTERSECT", "WINDOW", "QUALIFY",
})  # not SELECT (``FROM t select, db.t2`` reads select as an alias), not OFFSET (``SAMPLE 1/2 OFFSET 1/2, t2``)
# Words that start an IN operand without naming a table.
_NOT_TABLES = frozenset({"NULL", "TRUE", "FALSE", "NAN", "INF", "SELECT", "WITH"})
_EXPLAIN_KINDS = frozenset({"AST", "SYNTAX", "QUERY", "TREE", "PLAN", "PIPELINE", "ESTIMATE"})
# Calls whose own syntax has IN or FROM between their arguments: position(a IN b), extract(DAY FROM d), ...
_IN_CALLS = frozenset({"position", "locate"})


@dataclasses.dataclass
class _Frame:
    kind: str  # statement, group, call, bracket
    name: str = ""
    has_select: bool = False
    in_from: bool = False
    using_list: bool = False
    ctes: set[str] = dataclasses.field(default_factory=set)  # WITH name AS (SELECT ...) of this level

    @property
    def closer(self) -> str:
        return "]" if self.kind == "bracket" else ")"


def check_free_sql(sql: str) -> tuple[str, str]:
    """Refuse free SQL that could read beyond the project's tables (see the module docstring).

    Returns (the statement without a trailing ';', its first keyword) like
    ``check_read_only``; raises StoreError with one line naming the
    offending function, table or clause.
    """
    text, first = check_read_only(sql)
    toks = tokens(text)
    if first in ("SELECT", "WITH"):
        _Walk(toks).run(0)
    elif first in ("DESCRIBE", "DESC"):
        start = 2 if len(toks) > 1 and toks[1].upper == "TABLE" else 1
        _Walk(toks).run(start, expect_table=True)
    elif first == "EXISTS":
        start = 1
        if len(toks) > 1 and toks[1].upper in ("TEMPORARY", "DATABASE", "DICTIONARY"):
            raise StoreError(f"free SQL: EXISTS {toks[1].upper} is refused (EXISTS TABLE name runs here)")
        if len(toks) > 1 and toks[1].upper in ("TABLE", "VIEW"):
            start = 2
        _Walk(toks).run(start, expect_table=True)
    elif first == "SHOW":
        _check_show(toks)
    elif first == "EXPLAIN":
        _Walk(toks).run(_explained_start(toks))
    else:  # check_read_only admits nothing else; stay closed if it ever does
        raise StoreError(f"free SQL: {first} statements are refused")
    return text, first


def is_show_tables(sql: str) -> bool:
    """Whether a statement that passed ``check_free_sql`` is SHOW TABLES (its answer is filtered to
    ``PROJECT_TABLES``: a server database may hold other tables)."""
    toks = tokens(sql)
    return len(toks) > 1 and toks[0].upper == "SHOW" and toks[1].upper == "TABLES"


def _check_show(toks: list[Token]) -> None:
    what = toks[1].upper if len(toks) > 1 else ""
    if what == "TABLES":
        rest = toks[2:]
        if rest and rest[0].upper == "NOT":
            rest = rest[1:]
        if rest and rest[0].upper in ("LIKE", "ILIKE"):
            if len(rest) < 2 or rest[1].kind != "string":
                raise StoreError("free SQL: SHOW TABLES LIKE needs a quoted pattern")
            rest = rest[2:]
        if rest and rest[0].upper == "LIMIT" and len(rest) >= 2 and rest[1].kind == "number":
            rest = rest[2:]
        if rest:
            raise StoreError("free SQL: SHOW TABLES lists the project's tables only (no FROM/IN another database)")
        return
    if what == "CREATE":
        start = 3 if len(toks) > 2 and toks[2].upper in ("TABLE", "VIEW") else 2
        _Walk(toks).run(start, expect_table=True)
        return
    shown = toks[1].text if len(toks) > 1 else ""
    raise StoreError(f"free SQL: SHOW {shown} is refused (SHOW TABLES and SHOW CREATE TABLE run here)")


def _explained_start(toks: list[Token]) -> int:
    """Index of the SELECT that EXPLAIN explains, after its kind words and ``name = value`` options."""
    i, n = 1, len(toks)
    while i < n and toks[i].upper in _EXPLAIN_KINDS:
        i += 1
    while i + 2 < n and toks[i].kind == "word" and toks[i + 1].is_punct("=") \
            and toks[i + 2].kind in ("number", "string", "word"):
        i += 3
        if i < n and toks[i].is_punct(","):
            i += 1
    if i < n and (toks[i].upper in ("SELECT", "WITH") or toks[i].is_punct("(")):
        return i
    shown = toks[i].text if i < n else "nothing"
    raise StoreError(f"free SQL: EXPLAIN runs on a SELECT only (found {shown})")


def _dotted_end(toks: list[Token], i: int) -> int | None:
    """End index of the dotted name ``a.b.c`` starting at ``i``, or None when no name starts there."""
    n = len(toks)
    if i >= n or not toks[i].is_name:
        return None
    j = i + 1
    while j + 1 < n and toks[j].is_punct(".") and toks[j + 1].is_name:
        j += 2
    return j


def _matching(toks: list[Token], i: int) -> int:
    """Index of the bracket closing the one at ``i`` (len(toks) when unclosed)."""
    depth = 0
    for j in range(i, len(toks)):
        t = toks[j]
        if t.kind == "punct" and t.text in "([":
            depth += 1
        elif t.kind == "punct" and t.text in ")]":
            depth -= 1
            if depth == 0:
                return j
    return len(toks)


class _Walk:
    """One pass over the tokens with a stack of brackets: calls, table positions, clauses."""

    def __init__(self, toks: list[Token]) -> None:
        self.toks = toks
        self.stack: list[_Frame] = []

    # -- tables -----------------------------------------------------------
    def _table(self, names: list[str]) -> None:
        name = ".".join(names)
        if len(names) == 1 and (name in PROJECT_TABLES or any(name in f.ctes for f in self.stack)):
            return  # a CTE counts where it is defined: its SELECT and the subqueries inside
        raise StoreError(f"free SQL reads only the project's tables (SHOW TABLES lists them): {name} is refused")

    def _table_position(self, i: int) -> int:
        """Check the table named at ``i`` (after FROM, JOIN, ...); returns where the walk goes on."""
        toks = self.toks
        t = toks[i]
        if t.is_punct("("):
            self._bare_table(i, _matching(toks, i) + 1, alone=True)  # FROM (db.t): no engine takes it; stay sure
            return i  # a subquery: walked as a group
        end = _dotted_end(toks, i)
        if end is not None:
            names = [toks[k].text for k in range(i, end, 2)]
            if end < len(toks) and toks[end].is_punct("("):
                raise StoreError(f"free SQL: table function {'.'.join(names)}() is refused; read the project's "
                                 "tables by name")
            self._table(names)
            return end
        if t.kind == "string":
            raise StoreError(f"free SQL reads tables by name, not files or URLs: {t.text[:60]} is refused")
        if t.kind == "placeholder":
            raise StoreError("free SQL: a table cannot be a parameter")
        raise StoreError(f"free SQL: expected a table name, found {t.text[:40]}")

    def _in_operand(self, i: int) -> None:
        """``x IN t``, ``x IN (t)``, ``in(x, t)``: a bare name there is a table, checked like one after FROM."""
        toks, n = self.toks, len(self.toks)
        j = i + 1
        if j >= n:
            return
        if not toks[j].is_punct("("):
            self._bare_table(j, n, alone=False)
            return
        if j + 1 < n and toks[j + 1].upper in ("SELECT", "WITH"):
            return  # IN (SELECT ...): a subquery, walked as a group
        close = _matching(toks, j)
        start, depth = j + 1, 0
        for k in range(j + 1, close + 1):
            t = toks[k]
            if t.kind == "punct" and t.text in "([":
                depth += 1
            elif t.kind == "punct" and t.text in ")]":
                depth -= 1
            if k == close or (depth == 0 and t.is_punct(",")):
                self._bare_table(start, k, alone=True)
                start = k + 1

    def _bare_table(self, a: int, b: int, alone: bool) -> None:
        """If tokens a..b are a name in brackets (``t``, ``((db.t))``, ``t AS x``), it is a table."""
        toks = self.toks
        while a < b and toks[a].is_punct("(") and _matching(toks, a) == b - 1:
            a, b = a + 1, b - 1
        end = _dotted_end(toks, a)
        if end is None or toks[a].upper in _NOT_TABLES:
            return
        if end < len(toks) and toks[end].is_punct("("):
            return  # a call: checked as one
        if alone:
            tail = toks[end:b]
            if not (not tail or (len(tail) == 1 and tail[0].is_name)
                    or (len(tail) == 2 and tail[0].upper == "AS" and tail[1].is_name)):
                return  # an expression: (a + 1), (a, b) elements with operators
        self._table([toks[k].text for k in range(a, end, 2)])

    # -- functions --------------------------------------------------------
    def _call(self, i: int) -> str | None:
        """The name at ``i`` is followed by "(": the call's name, or None for a keyword's bracket."""
        toks = self.toks
        t = toks[i]
        if t.kind == "word" and t.upper in _PAREN_KEYWORDS:
            return None
        if i > 0 and toks[i - 1].is_punct("."):
            prefix = toks[i - 2].text if i > 1 else ""
            raise StoreError(f"free SQL: the qualified function {prefix}.{t.text}() is refused")
        if not is_allowed_function(t.text):
            raise StoreError(f"free SQL: function {t.text}() is not allowed (only pure functions over the "
                             "project's tables; storage/sqlfuncs.py lists them)")
        return t.text

    def _apply(self, i: int) -> None:
        """``* APPLY(f)`` / ``APPLY f`` calls ``f`` on each column: ``f`` must be allowed like any call."""
        toks, n = self.toks, len(self.toks)
        j = i + 1
        if j < n and toks[j].is_punct("("):
            j += 1
        if j >= n or not toks[j].is_name:
            return
        if j + 1 < n and (toks[j + 1].is_punct("->") or toks[j + 1].is_punct("(")):
            return  # a lambda or a call: its body is walked
        if not is_allowed_function(toks[j].text):
            raise StoreError(f"free SQL: APPLY({toks[j].text}) is refused (only pure functions; "
                             "storage/sqlfuncs.py lists them)")

    def _keyword_at(self, i: int) -> bool:
        """Whether the word at ``i`` can be a keyword: after "AS" or "." or before "." it is a name
        (``AS where``, ``u.from``, ``where.a``), as the engine reads keywords there."""
        toks = self.toks
        if i > 0 and (toks[i - 1].is_punct(".") or toks[i - 1].upper == "AS"):
            return False
        return not (i + 1 < len(toks) and toks[i + 1].is_punct("."))

    def _is_transformer(self, i: int) -> bool:
        """``* EXCEPT (a, b)`` drops columns; ``EXCEPT SELECT`` / ``EXCEPT (SELECT`` is a set operation."""
        toks = self.toks
        return i + 2 < len(toks) and toks[i + 1].is_punct("(") and toks[i + 2].upper not in ("SELECT", "WITH")

    # -- the walk ---------------------------------------------------------
    def run(self, start: int, expect_table: bool = False) -> None:
        toks, n = self.toks, len(self.toks)
        stack = self.stack = [_Frame("statement")]
        pending: str | None = None  # the call whose "(" comes next
        i = start
        while i < n:
            t = toks[i]
            frame = stack[-1]
            if expect_table:
                expect_table = False
                i = self._table_position(i)
                continue
            nxt = toks[i + 1] if i + 1 < n else None
            if t.kind == "punct":
                if t.text in "([":
                    kind = "call" if pending is not None else ("bracket" if t.text == "[" else "group")
                    stack.append(_Frame(kind, pending or ""))
                    pending = None
                elif t.text in ")]":
                    if len(stack) == 1 or stack[-1].closer != t.text:
                        raise StoreError(f"free SQL: unbalanced brackets (unexpected {t.text})")
                    stack.pop()
                elif t.text == "," and frame.in_from and not frame.using_list:
                    expect_table = True
                i += 1
                continue
            if t.kind == "word":
                u = t.upper if self._keyword_at(i) or t.upper in ("SETTINGS", "FORMAT", "INTO", "OUTFILE") else ""
                if u == "SETTINGS":
                    raise StoreError("free SQL: SETTINGS clauses are refused (limits come from the [sql] "
                                     "configuration)")
                if u == "FORMAT":
                    raise StoreError("FORMAT clauses are not supported: results come back as Arrow (use --format)")
                if u in ("INTO", "OUTFILE"):
                    raise StoreError("read-only store: INTO OUTFILE is refused")
                if u == "SELECT":
                    frame.has_select = True
                if u == "WITH":
                    frame.has_select = True
                elif u in _FROM_ENDERS:
                    frame.in_from = frame.using_list = False
                elif u == "FROM":
                    if frame.kind != "call" or frame.has_select:
                        expect_table = True
                        frame.in_from, frame.using_list = True, False
                elif u == "JOIN":
                    if i > 0 and toks[i - 1].upper == "ARRAY" and self._keyword_at(i - 1):
                        frame.in_from = False  # ARRAY JOIN takes expressions
                    else:
                        expect_table = True
                        frame.in_from, frame.using_list = True, False
                elif u == "USING":
                    if not (nxt is not None and nxt.is_punct("(")):
                        frame.using_list = True  # USING a, b: the commas list columns
                elif u == "IN":
                    if not (frame.kind == "call" and frame.name.lower() in _IN_CALLS and not frame.has_select):
                        self._in_operand(i)
                elif u == "APPLY":
                    self._apply(i)
                if u in ("UNION", "INTERSECT") or (u == "EXCEPT" and not self._is_transformer(i)):
                    frame.ctes.clear()  # the next SELECT of a set operation has WITH clauses of its own
            if t.is_name and nxt is not None and nxt.upper == "AS" and i + 3 < n and toks[i + 2].is_punct("(") \
                    and (toks[i + 3].upper in ("SELECT", "WITH") or toks[i + 3].is_punct("(")):
                frame.ctes.add(t.text)  # WITH name AS (SELECT ...): FROM name reads it from here on
            if t.is_name and nxt is not None and nxt.is_punct("("):
                pending = self._call(i)
            i += 1
        if expect_table:
            raise StoreError("free SQL: expected a table name at the end of the statement")
        if len(stack) != 1:
            raise StoreError("free SQL: unbalanced brackets (missing ')')")
