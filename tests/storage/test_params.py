"""Unit tests of SQL reading, the read-only check and parameter binding (no engine)."""
from __future__ import annotations

import datetime as dt

import pytest

from storage.errors import StoreError
from storage.params import ParamSpec, bind, bind_free, coerce, parse_cli_params, parse_time_ns
from storage.queries import NAMED_QUERIES
from storage.sqltext import check_read_only, external_params_sql, placeholders, segments


def test_placeholders_outside_strings_and_comments():
    sql = ("SELECT '{a:String}' AS lit, `{b:Int32}` -- {c:Int32}\n"
           "/* {d:Int32} */ FROM t WHERE x = {e:Int64} AND y = { f : Nullable(String) } AND z = {e:Int64}")
    assert placeholders(sql) == {"e": "Int64", "f": "Nullable(String)"}


def test_placeholder_with_two_types_is_refused():
    with pytest.raises(StoreError, match="used as Int64 and as String"):
        placeholders("SELECT {a:Int64}, {a:String}")


def test_segments_handle_escaped_quotes():
    segs = segments(r"SELECT 'it\'s {x:Int32}', 'a''b' , {y:Int32}")
    assert [s.name for s in segs if s.kind == "placeholder"] == ["y"]


@pytest.mark.parametrize("sql", [
    "SELECT 1", "  select 1 ;", "WITH 1 AS x SELECT x", "(SELECT 1)", "SHOW TABLES", "DESCRIBE TABLE windows",
    "EXISTS TABLE windows", "EXPLAIN SELECT 1", "SELECT 'drop table x; insert'", "-- c\nSELECT 1",
    "SELECT formatReadableSize(1)",
])
def test_read_only_accepts(sql):
    check_read_only(sql)


@pytest.mark.parametrize("sql, reason", [
    ("INSERT INTO windows VALUES (1)", "INSERT statements are refused"),
    ("insert into windows select * from windows", "INSERT statements are refused"),
    ("ALTER TABLE windows_data DELETE WHERE 1", "ALTER statements are refused"),
    ("DROP TABLE windows", "DROP statements are refused"),
    ("CREATE TABLE x (a Int8) ENGINE = Memory", "CREATE statements are refused"),
    ("TRUNCATE TABLE windows_data", "TRUNCATE statements are refused"),
    ("OPTIMIZE TABLE windows_data", "OPTIMIZE statements are refused"),
    ("RENAME TABLE a TO b", "RENAME statements are refused"),
    ("SET readonly = 0", "SET statements are refused"),
    ("SYSTEM STOP MERGES", "SYSTEM statements are refused"),
    ("/* SELECT */ DELETE FROM windows_data WHERE 1", "DELETE statements are refused"),
    ("SELECT 1; DROP TABLE windows", "only one statement"),
    ("SELECT 1 INTO OUTFILE '/tmp/x'", "INTO OUTFILE"),
    ("SELECT 1 FORMAT JSON", "FORMAT clauses"),
    ("EXPLAIN INSERT INTO t SELECT 1", "EXPLAIN of a writing statement"),
    ("", "empty query"),
    ("SELECT 'unterminated", "unterminated quote"),
])
def test_read_only_refuses(sql, reason):
    with pytest.raises(StoreError, match=reason):
        check_read_only(sql)


def test_external_params_rewrite_keeps_values_out_of_the_text():
    sql = "SELECT * FROM t WHERE a = {a:String} AND s = '{a:String}' ORDER BY x LIMIT {limit:UInt64}"
    out, limit = external_params_sql(sql)
    assert out == "SELECT * FROM t WHERE a = (SELECT `a` FROM _params) AND s = '{a:String}' ORDER BY x "
    assert limit == "limit"


@pytest.mark.parametrize("name, typ, value, want", [
    ("n", "Int32", "42", 42), ("n", "Int64", -7, -7), ("n", "UInt64", 3.0, 3), ("x", "Float64", "1.5", 1.5),
    ("s", "String", "it's'; DROP TABLE x --", "it's'; DROP TABLE x --"), ("s", "String", 12, "12"),
    ("d", "Date", "2024-05-01", dt.date(2024, 5, 1)), ("n", "Nullable(Int32)", "5", 5),
])
def test_coerce(name, typ, value, want):
    assert coerce(name, typ, value) == want


@pytest.mark.parametrize("typ, value, reason", [
    ("Int32", "1.5", "expected an integer"), ("Int32", "x", "expected an integer"),
    ("UInt8", -1, "out of range"), ("Int32", 2**31, "out of range"), ("Float64", "nan", "finite"),
    ("Float64", "abc", "expected a number"), ("Date", "May 1", "expected a date"), ("Map(String, String)", "x",
                                                                                     "not supported"),
    ("String", "a\x00b", "NUL"), ("Int32", None, "has no value"),
])
def test_coerce_refuses(typ, value, reason):
    with pytest.raises(StoreError, match=reason):
        coerce("p", typ, value)


@pytest.mark.parametrize("value, want", [
    (123, 123), ("1700000000000000000", 1_700_000_000_000_000_000), ("2024-01-01", 1_704_067_200_000_000_000),
    ("2024-01-01T00:00:01Z", 1_704_067_201_000_000_000), ("2024-01-01T02:00:00+02:00", 1_704_067_200_000_000_000),
    (dt.date(2024, 1, 1), 1_704_067_200_000_000_000),
    (dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc), 1_704_067_200_000_000_000),
])
def test_parse_time_ns(value, want):
    assert parse_time_ns(value) == want


def test_parse_time_ns_refuses_garbage():
    with pytest.raises(StoreError, match="ISO date"):
        parse_time_ns("yesterday", "since")


def test_bind_fills_defaults_and_refuses_unknown_names():
    specs = (ParamSpec("since", "Int64", 0, time=True), ParamSpec("team", "String", ""),
             ParamSpec("job_id", "String", None))
    assert bind(specs, {"since": "2024-01-01", "job_id": "j", "team": None}) == {
        "since": ("Int64", 1_704_067_200_000_000_000), "team": ("String", ""), "job_id": ("String", "j")}
    with pytest.raises(StoreError, match="unknown parameter 'tema' of q; known: since, team, job_id"):
        bind(specs, {"tema": "x", "job_id": "j"}, "q")
    with pytest.raises(StoreError, match="q: parameter 'job_id' \\(String\\) is required"):
        bind(specs, {}, "q")


def test_bind_free_needs_exactly_the_placeholders():
    assert bind_free({"a": "Int32"}, {"a": "3"}) == {"a": ("Int32", 3)}
    with pytest.raises(StoreError, match="'a' \\(Int32\\) has no value"):
        bind_free({"a": "Int32"}, {})
    with pytest.raises(StoreError, match="'b' is not used"):
        bind_free({}, {"b": 1})


def test_parse_cli_params():
    assert parse_cli_params(["team=llm", "q=a=b", "e="]) == {"team": "llm", "q": "a=b", "e": ""}
    for bad in (["team"], ["=x"], ["1a=x"]):
        with pytest.raises(StoreError, match="bad --param"):
            parse_cli_params(bad)
    with pytest.raises(StoreError, match="given twice"):
        parse_cli_params(["a=1", "a=2"])


@pytest.mark.parametrize("name", sorted(NAMED_QUERIES))
def test_named_queries_are_portable_and_declare_their_parameters(name):
    q = NAMED_QUERIES[name]
    used = placeholders(q.sql)
    declared = {p.name: p.type for p in q.params}
    assert used == declared, name
    check_read_only(q.sql)
    import re

    upper = q.sql.upper()
    for pattern in (r"\bWITH\b", r"\bOVER\s*\(", "DATETIME64", "JSONEXTRACT", r"\bMAP\(", r"\bFORMAT\b"):
        assert not re.search(pattern, upper), (name, pattern)
    assert q.description and "\n" not in q.description
    rewritten, _ = external_params_sql(q.sql)
    assert "{" not in rewritten.replace("{{", "")
