"""Free SQL is a sandbox: attacks refused, limits enforced, analysts' queries intact, writes never held up.

Each attack runs through ``Store.query`` on chDB and on the real 18.16
server; refusals must come from the sandbox (before the engine) and name
what was refused. Limit attacks must fail with a limit error within a
bounded time, and the store must answer normally afterwards.
"""
from __future__ import annotations

import math
import re
import statistics
import threading
import time
from pathlib import Path

import pytest

from services.store_daemon import StoreDaemon
from storage import NAMED_QUERIES, StoreError, open_store
from storage.params import bind
from storage.sandbox import _PAREN_KEYWORDS, PROJECT_TABLES, SQLLimits, check_free_sql, tokens
from storage.sqlfuncs import FUNCTIONS, is_allowed_function
from storage.sqltext import placeholders
from tests.storage.conftest import BASE_NS, DAY_NS, optype_rows, registration, window_rows

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

FAST = SQLLimits(max_execution_time_s=2, max_memory_mb=256, max_result_rows=1000)


@pytest.fixture(scope="module", params=["chdb", "server"])
def sbx(request, tmp_path_factory, ch_server):
    """One store per backend for the whole module, with a small fleet stored."""
    if request.param == "chdb":
        url = f"chdb://{tmp_path_factory.mktemp('sandbox') / 'store'}"
    else:
        if ch_server is None:
            pytest.skip("clickhouse-server is not installed (apt-get install clickhouse-server)")
        url = ch_server.store_url("t_sandbox")
    s = open_store(url)
    s.setup()
    s.insert("window", window_rows(4, job="a", slowdown=1.5, gpu_hours=10.0, verdict="worker"))
    s.insert("window", window_rows(2, job="b", slowdown=1.05, gpu_hours=20.0, verdict=""))
    s.insert("window", window_rows(3, job="c", team="vision", model="vit", n_gpus=8, slowdown=1.2,
                                          gpu_hours=5.0, verdict="stage", analyzed_ns=BASE_NS + DAY_NS))
    s.insert("optype_slowdown", optype_rows("a", [0, 10]))
    for job in ("a", "b", "c"):
        s.insert("job", registration(job, team="vision" if job == "c" else "llm"))
    s.backend = request.param
    yield s
    if request.param == "server":
        s._execute(f"DROP DATABASE IF EXISTS `{s.database}`")
    s.close()


def _windows(store) -> int:
    return store.query("SELECT count() AS n FROM windows").column("n")[0].as_py()


# --------------------------------------------------------------------------
# attacks: refused by the sandbox, with the reason named
# --------------------------------------------------------------------------
FUNC = r"function {}\(\) is not allowed"
TFUNC = r"table function {}\(\) is refused"
TABLE = r"project's tables .*: {} is refused"

ATTACKS = [
    # files, URLs, processes, other servers: scalar and table functions
    ("SELECT file('/etc/shadow')", FUNC.format("file")),
    ("SELECT length(file('/etc/passwd')) AS n FROM windows", FUNC.format("file")),
    ("SELECT * FROM file('/etc/passwd', 'LineAsString')", TFUNC.format("file")),
    ("DESCRIBE file('/etc/passwd')", TFUNC.format("file")),
    ("DESCRIBE TABLE file('/etc/passwd', 'CSV')", TFUNC.format("file")),
    ("DESCRIBE url('http://127.0.0.1:9/x', 'CSV')", TFUNC.format("url")),
    ("SELECT * FROM url('http://127.0.0.1:9/', 'CSV', 'a String')", TFUNC.format("url")),
    ("SELECT * FROM s3('http://127.0.0.1:9/b/k', 'CSV')", TFUNC.format("s3")),
    ("SELECT * FROM remote('127.0.0.1', system.one)", TFUNC.format("remote")),
    ("SELECT * FROM remoteSecure('127.0.0.1:9440', system, one)", TFUNC.format("remoteSecure")),
    ("SELECT * FROM executable('id', 'TSV', 'a String')", TFUNC.format("executable")),
    ("SELECT * FROM input('a String')", TFUNC.format("input")),
    ("SELECT * FROM jdbc('jdbc:x', 'db', 't')", TFUNC.format("jdbc")),
    ("SELECT * FROM odbc('DSN=x', 'db', 't')", TFUNC.format("odbc")),
    ("SELECT * FROM hdfs('hdfs://127.0.0.1:9/f', 'TSV', 'a String')", TFUNC.format("hdfs")),
    ("SELECT * FROM mysql('127.0.0.1:9', 'db', 't', 'u', 'p')", TFUNC.format("mysql")),
    ("SELECT * FROM postgresql('127.0.0.1:9', 'db', 't', 'u', 'p')", TFUNC.format("postgresql")),
    ("SELECT count() FROM numbers(1000000000000)", TFUNC.format("numbers")),
    ("SELECT * FROM merge(currentDatabase(), '.*')", TFUNC.format("merge")),
    ("SELECT * FROM view(SELECT * FROM system.one)", TFUNC.format("view")),
    ("SELECT * FROM cluster('default', system.one)", TFUNC.format("cluster")),
    ("SELECT * FROM Python(args)", TFUNC.format("Python")),
    ("SELECT * FROM generateRandom('a Int64')", TFUNC.format("generateRandom")),
    ("SELECT * FROM windows AS w JOIN url('http://127.0.0.1:9/', 'CSV', 'job_id String') AS u USING (job_id)",
     TFUNC.format("url")),
    ("SELECT * FROM '/etc/passwd'", r"tables by name, not files or URLs"),
    ("SELECT * FROM windows, '/etc/passwd'", r"tables by name, not files or URLs"),
    ("SELECT * FROM `/etc/passwd`", TABLE.format("/etc/passwd")),
    # other tables: system, information_schema, other databases, however written
    ("SELECT * FROM system.tables", TABLE.format(r"system\.tables")),
    ("SELECT query FROM system.processes", TABLE.format(r"system\.processes")),
    ("SELECT name, value FROM system.settings", TABLE.format(r"system\.settings")),
    ("SELECT * FROM INFORMATION_SCHEMA.TABLES", TABLE.format(r"INFORMATION_SCHEMA\.TABLES")),
    ("SELECT * FROM `system`.`users`", TABLE.format(r"system\.users")),
    ('SELECT * FROM "system"."one"', TABLE.format(r"system\.one")),
    ("SELECT * FROM system . one", TABLE.format(r"system\.one")),
    ("SELECT * FROM system/* a comment */.one", TABLE.format(r"system\.one")),
    ("SELECT * FROM default.windows", TABLE.format(r"default\.windows")),
    ("SELECT * FROM windows, system.one", TABLE.format(r"system\.one")),
    ("SELECT * FROM windows AS w ALL INNER JOIN system.one AS o ON 1 = 1", TABLE.format(r"system\.one")),
    ("SELECT * FROM windows w JOIN jobs j ON w.job_id = j.job_id, system.one", TABLE.format(r"system\.one")),
    ("SELECT * FROM windows JOIN jobs USING (job_id), system.one", TABLE.format(r"system\.one")),
    ("SELECT count() FROM windows WHERE 0 IN system.one", TABLE.format(r"system\.one")),
    ("SELECT 0 IN (system.one)", TABLE.format(r"system\.one")),
    ("SELECT 0 GLOBAL NOT IN ((system.one AS o))", TABLE.format(r"system\.one")),
    ("SELECT in(0, system.one)", TABLE.format(r"system\.one")),
    ("SELECT notIn(0, system.one)", FUNC.format("notIn")),
    ("SELECT (SELECT name FROM system.users LIMIT 1) AS u", TABLE.format(r"system\.users")),
    ("SELECT * FROM (SELECT * FROM (SELECT * FROM system.one))", TABLE.format(r"system\.one")),
    ("WITH x AS (SELECT * FROM system.one) SELECT * FROM x", TABLE.format(r"system\.one")),
    ("SELECT job_id FROM windows WHERE job_id IN (SELECT name FROM system.tables)", TABLE.format(r"system\.tables")),
    ("SELECT * FROM {t:Identifier}", r"a table cannot be a parameter"),
    ("SELECT * FROM (system.one)", TABLE.format(r"system\.one")),
    # keywords the engine reads as names (aliases, compound names) do not end a FROM list
    ("SELECT * FROM windows AS where, system.one", TABLE.format(r"system\.one")),
    ("SELECT * FROM windows select, system.one", TABLE.format(r"system\.one")),
    ("SELECT * FROM windows SAMPLE 1 / 2 OFFSET 1 / 2, system.one", TABLE.format(r"system\.one")),
    ("SELECT * FROM windows AS array JOIN jobs USING (job_id), system.one", TABLE.format(r"system\.one")),
    ("SELECT * FROM windows AS w JOIN (SELECT job_id AS where FROM jobs) AS u ON w.job_id = u.where, system.one",
     TABLE.format(r"system\.one")),
    # a CTE counts only where it is defined: outside, its name would reach a table of the database
    ("SELECT * FROM (WITH s AS (SELECT 1) SELECT 1) AS x, s", TABLE.format("s")),
    ("WITH a AS (WITH b AS (SELECT 1) SELECT * FROM b) SELECT * FROM b", TABLE.format("b")),
    # functions that read files, settings, dictionaries, other tables or server state, in any position
    ("SELECT arrayMap(x -> file(x), ['/etc/passwd'])", FUNC.format("file")),
    ("SELECT * APPLY(file) FROM (SELECT '/etc/passwd' AS p)", r"APPLY\(file\) is refused"),
    ("SELECT COLUMNS('p') APPLY file FROM (SELECT '/etc/passwd' AS p)", r"APPLY\(file\) is refused"),
    ("SELECT x FROM windows ARRAY JOIN [file('/etc/hostname')] AS x", FUNC.format("file")),
    ("SELECT count() FROM windows WHERE job_id IN (SELECT file('/etc/hostname'))", FUNC.format("file")),
    ("SELECT dictGet('d', 'a', toUInt64(1))", FUNC.format("dictGet")),
    ("SELECT joinGet('j', 'v', 1)", FUNC.format("joinGet")),
    ("SELECT getSetting('max_memory_usage')", FUNC.format("getSetting")),
    ("SELECT hasColumnInTable('system', 'users', 'name')", FUNC.format("hasColumnInTable")),
    ("SELECT hostName()", FUNC.format("hostName")),
    ("SELECT currentUser()", FUNC.format("currentUser")),
    ("SELECT sleep(3)", FUNC.format("sleep")),
    ("SELECT addressToSymbol(1)", FUNC.format("addressToSymbol")),
    ("SELECT format('{}', 'x')", r"FORMAT clauses are not supported"),
    ("SELECT system.file('/etc/passwd')", r"qualified function system\.file\(\) is refused"),
    # text the engine could read differently from the sandbox's tokenizer
    ("SELECT `file`('/etc/passwd')", FUNC.format("file")),
    ("SELECT `fil\\x65`('/etc/passwd')", r"backslashes in quoted names are refused"),
    ("SELECT file /* c */ ('/etc/passwd')", FUNC.format("file")),
    ("SELECT file\n('/etc/passwd')", FUNC.format("file")),
    ("SELECT $$ x $$, file('/etc/passwd')", r"'\$' is refused"),
    ("SELECT $a$ ' $a$, file('/etc/passwd') --'", r"'\$' is refused"),
    ("SELECT\u00a0file('/etc/passwd')", r"character 'U\+00A0' is refused"),
    ("SELECT 1 --\n, file('/etc/passwd')", FUNC.format("file")),
    # raising limits, writing, other statements
    ("SELECT * FROM windows SETTINGS max_execution_time = 0", r"SETTINGS clauses are refused"),
    ("SELECT * FROM (SELECT 1 SETTINGS readonly = 0)", r"SETTINGS clauses are refused"),
    ("SET max_execution_time = 0", r"SET statements are refused"),
    ("SELECT 1 FORMAT TSV", r"FORMAT clauses are not supported"),
    ("SELECT 1 INTO OUTFILE '/tmp/x'", r"INTO OUTFILE is refused"),
    ("SELECT 1; SELECT file('/etc/passwd')", r"only one statement"),
    ("SYSTEM SHUTDOWN", r"SYSTEM statements are refused"),
    ("KILL QUERY WHERE 1", r"KILL statements are refused"),
    ("INSERT INTO windows_data (job_id) SELECT file('/etc/passwd')", r"INSERT statements are refused"),
    ("SHOW PROCESSLIST", r"SHOW PROCESSLIST is refused"),
    ("SHOW DATABASES", r"SHOW DATABASES is refused"),
    ("SHOW TABLES FROM system", r"SHOW TABLES lists the project's tables only"),
    ("SHOW CREATE TABLE system.users", TABLE.format(r"system\.users")),
    ("EXISTS DATABASE system", r"EXISTS DATABASE is refused"),
    ("EXISTS TABLE system.one", TABLE.format(r"system\.one")),
    ("DESC system.one", TABLE.format(r"system\.one")),
    ("DESCRIBE (SELECT file('/etc/passwd'))", FUNC.format("file")),
    ("EXPLAIN SELECT * FROM system.one", TABLE.format(r"system\.one")),
    ("EXPLAIN SYNTAX SELECT file('/etc/passwd')", FUNC.format("file")),
    ("EXPLAIN AST INSERT INTO windows_data SELECT * FROM windows_data", r"EXPLAIN of a writing statement"),
    ("EXPLAIN TABLE OVERRIDE mysql('x', 'y', 'z', 'u', 'p')", r"EXPLAIN runs on a SELECT only"),
]


def test_the_attack_table_is_large():
    assert len(ATTACKS) >= 50
    assert len({sql for sql, _ in ATTACKS}) == len(ATTACKS)


@pytest.mark.parametrize("sql, reason", ATTACKS, ids=[f"a{i:02d}" for i in range(len(ATTACKS))])
def test_attack_is_refused(sbx, sql, reason):
    with pytest.raises(StoreError, match=reason) as e:
        sbx.query(sql, limits=FAST)
    assert "\n" not in str(e.value)


def test_refusals_come_before_the_engine():
    """Every attack is refused by the sandbox alone (no engine was asked)."""
    for sql, reason in ATTACKS:
        with pytest.raises(StoreError, match=reason):
            check_free_sql(sql)


def test_identifier_parameters_are_refused(sbx):
    with pytest.raises(StoreError, match="type Identifier is not supported"):
        sbx.query("SELECT count() AS n FROM windows WHERE job_id = {t:Identifier}", {"t": "system.one"})


# --------------------------------------------------------------------------
# limits: a limit error within bounded time, and the store answers afterwards
# --------------------------------------------------------------------------
LIMIT_ATTACKS = [
    ("cross join", "SELECT count() AS n FROM (SELECT arrayJoin(range(100000)) AS a) AS x "
                   "CROSS JOIN (SELECT arrayJoin(range(100000)) AS b) AS y WHERE cityHash64(a, b) % 7 = 1",
     r"max_(execution_time_s|memory_mb)"),
    ("big array", "SELECT length(range(90000000)) AS n", r"max_memory_mb"),
    ("groupArray", "SELECT length(groupArray(a)) AS n FROM (SELECT arrayJoin(range(50000000)) AS a)",
     r"max_memory_mb"),
    ("uniqExact", "SELECT uniqExact(a) AS n FROM (SELECT arrayJoin(range(60000000)) AS a)", r"max_memory_mb"),
    ("long strings", "SELECT length(arrayStringConcat(arrayMap(x -> concat(toString(x), "
                     "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'), range(10000000)))) AS n",
     r"max_memory_mb"),
    ("many rows", "SELECT arrayJoin(range(5000)) AS a", r"more than 1000 rows .*max_result_rows"),
    ("many rows of a table", "SELECT w.job_id FROM windows AS w ARRAY JOIN range(200) AS k",
     r"more than 1000 rows .*max_result_rows"),
]


@pytest.mark.parametrize("name, sql, reason", LIMIT_ATTACKS, ids=[a[0] for a in LIMIT_ATTACKS])
def test_limit_attack_fails_within_its_limit(sbx, name, sql, reason):
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=reason) as e:
        sbx.query(sql, limits=FAST)
    elapsed = time.monotonic() - t0
    # The limit fires on time (the error reports ~2,000 ms); chDB then tears the query down, which took
    # 6.6 s more once in a loaded CI run. Without the limit these queries run for minutes.
    assert elapsed < FAST.max_execution_time_s + 10.0, (name, elapsed, str(e.value))
    assert "\n" not in str(e.value)
    assert _windows(sbx) == 9  # the store answers normally afterwards


# chDB checks the time limit while a block is computed; 18.16 between blocks (one block may overrun).
TIME_ATTACK = {
    "chdb": "SELECT count() AS n FROM (SELECT arrayJoin(range(100000)) AS a) AS x "
            "CROSS JOIN (SELECT arrayJoin(range(100000)) AS b) AS y WHERE cityHash64(a, b) % 7 = 1",
    "server": "SELECT count() AS n FROM (SELECT arrayJoin(range(30000000)) AS a) "
              "WHERE match(toString(cityHash64(a)), '(1|2|3)*(4|5)*[0-9]{3,}7$')",
}


def test_time_limit(sbx):
    limits = SQLLimits(max_execution_time_s=1, max_memory_mb=2048, max_result_rows=1000)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"ran past the \[sql\] max_execution_time_s limit \(1 s\)"):
        sbx.query(TIME_ATTACK[sbx.backend], limits=limits)
    assert time.monotonic() - t0 < (3.0 if sbx.backend == "chdb" else 15.0)
    assert _windows(sbx) == 9


def test_limits_default_to_the_store_and_then_the_config(sbx):
    from core.config import SQLConfig

    assert SQLLimits.of(SQLConfig()) == SQLLimits() == SQLLimits.of(None)
    assert sbx.sql_limits == SQLLimits()
    small = SQLLimits.of({"max_result_rows": 3})
    assert small == SQLLimits(30.0, 2048, 3)
    with pytest.raises(StoreError, match="more than 3 rows"):
        sbx.query("SELECT job_id FROM windows", limits=small)
    assert sbx.query("SELECT job_id FROM windows LIMIT 3", limits=small).num_rows == 3
    # A parameterised LIMIT that keeps the result within the limit is fine on both engines.
    assert sbx.query("SELECT job_id FROM windows ORDER BY job_id LIMIT {n:UInt64}", {"n": 2},
                     limits=small).column("job_id").to_pylist() == ["a", "a"]
    saved = sbx.sql_limits
    sbx.sql_limits = small
    try:
        with pytest.raises(StoreError, match="more than 3 rows"):
            sbx.query("SELECT job_id FROM windows")
    finally:
        sbx.sql_limits = saved
    assert SQLLimits(5, 100, 10).capped(SQLLimits(2, 200, 5)) == SQLLimits(2, 100, 5)
    for bad in ({"max_memory_mb": 0}, {"max_execution_time_s": -1}, {"max_result_rows": "many"}):
        with pytest.raises(StoreError, match="SQL limit|bad SQL limits"):
            SQLLimits.of(bad)


def test_the_engine_holds_the_limits_and_refuses_writes_too(sbx):
    """Under the sandbox: a statement that got past it still cannot raise its limits or write."""
    limits = SQLLimits(max_execution_time_s=5, max_memory_mb=256, max_result_rows=10)
    with pytest.raises(StoreError, match=r"max_memory_mb|readonly|Code: 164"):
        sbx._free_select("SELECT length(range(90000000)) AS n SETTINGS max_memory_usage = 0", {}, "SELECT", limits)
    with pytest.raises(StoreError, match=r"readonly|READONLY|Code: 164"):
        sbx._free_select("INSERT INTO schema_version VALUES (99, 'x', 0)", {}, "INSERT", limits)
    with pytest.raises(StoreError, match=r"readonly|READONLY|Code: 164"):
        sbx._free_select("SET max_memory_usage = 0", {}, "SET", limits)
    assert sbx.schema_version() < 99 and _windows(sbx) == 9


# --------------------------------------------------------------------------
# analysts' queries still work
# --------------------------------------------------------------------------
def _console_example() -> str:
    """The free SQL the console's SQL tab shows as its example."""
    text = (ROOT / "ui" / "pages" / "sql.py").read_text()
    return re.search(r'st\.text_area\("SQL",\s*"([^"]+)"', text).group(1)


LEGIT = [
    # (sql, params, rows expected or None, engines: None for both)
    (_console_example(), None, 9, None),
    ("SELECT team, count() AS n, avg(slowdown) AS s, quantileExact(0.9)(slowdown) AS p90, "
     "sumIf(wasted_gpu_hours, slowdown > 1.1) AS w, uniqExact(job_id) AS jobs FROM windows GROUP BY team "
     "ORDER BY team", None, 2, None),
    ("SELECT w.job_id, j.gpu_type, sum(w.gpu_hours) AS gh FROM windows AS w ALL INNER JOIN jobs AS j "
     "USING (job_id, attempt) GROUP BY w.job_id, j.gpu_type ORDER BY w.job_id", None, 3, None),
    ("SELECT job_id, gh, n FROM (SELECT job_id, sum(gpu_hours) AS gh FROM windows GROUP BY job_id) AS g "
     "ALL LEFT JOIN (SELECT job_id, count() AS n FROM optype_waste GROUP BY job_id) AS o USING (job_id) "
     "ORDER BY job_id", None, 3, None),
    ("SELECT count() AS n FROM windows WHERE job_id IN (SELECT job_id FROM jobs WHERE team = 'llm')", None, 1, None),
    ("SELECT count() AS n FROM windows WHERE (job_id, attempt) IN (SELECT job_id, attempt FROM jobs)", None, 1,
     None),
    ("SELECT job_id, slowdown FROM windows WHERE slowdown > {s:Float64} AND team = {t:String} "
     "ORDER BY job_id, window_id LIMIT {n:UInt64}", {"s": 1.1, "t": "llm", "n": 3}, 3, None),
    ("SELECT job_id, groupArray(window_id) AS ws, arrayCumSum(groupArray(gpu_hours)) AS cum, "
     "arrayDifference(groupArray(slowdown)) AS d FROM (SELECT * FROM windows ORDER BY window_id) GROUP BY job_id "
     "ORDER BY job_id", None, 3, None),
    ("SELECT arrayMap(x -> x * 2, [1, 2, 3]) AS a, arrayFilter(x -> x > 1, [1, 2, 3]) AS b, "
     "arrayReduce('sum', [1, 2]) AS c, tupleElement((1, 'x'), 2) AS d", None, 1, None),
    ("SELECT toDate(toDateTime(intDiv(analyzed_ns, 1000000000), 'UTC')) AS day, count() AS n, "
     "formatReadableSize(sum(n_ops)) AS ops FROM windows GROUP BY day ORDER BY day", None, 2, None),
    ("SELECT lower(team) AS t, concat(job_id, '-', toString(window_id)) AS k, CAST(n_gpus AS Nullable(Float64)) "
     "AS g, if(slowdown > 1.2, 'slow', 'ok') AS v, multiIf(slowdown > 1.4, 2, slowdown > 1.1, 1, 0) AS lvl "
     "FROM windows ORDER BY k LIMIT 3", None, 3, None),
    ("SELECT job_id, x FROM windows ARRAY JOIN [1, 2] AS x WHERE window_id = 0 ORDER BY job_id, x", None, 6, None),
    ("SELECT count() AS n FROM windows_data", None, 1, None),
    ("SELECT max(version) AS v FROM schema_version", None, 1, None),
    ("SELECT t.team, t.n FROM (SELECT team, count() AS n FROM windows GROUP BY team) AS t ORDER BY t.team",
     None, 2, None),
    ("SELECT optype, round(avg(slowdown), 3) AS s, topK(2)(job_id) AS jobs, "
     "extract(optype, '^[a-z]+') AS family FROM optype_slowdown WHERE step = -1 GROUP BY optype ORDER BY optype",
     None, 2, None),
    ("SELECT job_id, position(job_id, 'a') AS p, toStartOfDay(toDateTime(intDiv(analyzed_ns, 1000000000))) AS d, "
     "greatest(slowdown, 1.3) AS g, coalesce(NULL, slowdown) AS c FROM windows WHERE job_id NOT IN ('zz', 'yy') "
     "AND job_id LIKE '%' ORDER BY job_id LIMIT 2", None, 2, None),
    ("SHOW TABLES", None, None, None),
    ("SHOW TABLES LIKE 'windows%'", None, 2, None),
    ("DESCRIBE TABLE windows", None, None, None),
    ("EXISTS TABLE windows", None, 1, None),
    ("SHOW CREATE TABLE windows", None, 1, None),
    # engines newer than 18.16: window functions, CTEs, EXPLAIN, SQL-standard forms
    ("SELECT job_id, window_id, row_number() OVER (PARTITION BY job_id ORDER BY window_id) AS k, "
     "lagInFrame(slowdown) OVER (PARTITION BY job_id ORDER BY window_id) AS prev FROM windows "
     "ORDER BY job_id, window_id", None, 9, "chdb"),
    ("WITH t AS (SELECT job_id, sum(gpu_hours) AS gh FROM windows GROUP BY job_id) SELECT * FROM t ORDER BY gh DESC",
     None, 3, "chdb"),
    ("EXPLAIN SELECT count() FROM windows", None, None, "chdb"),
    ("SELECT extract(DAY FROM toDate('2024-02-29')) AS d, position('stragglers' IN 'gg') AS p, "
     "trim(BOTH ' ' FROM '  x ') AS t, count() FILTER (WHERE team = 'llm') AS c FROM windows",
     None, 1, "chdb"),
    ("SELECT w.job_id, count() AS n FROM windows AS w, jobs AS j WHERE w.job_id = j.job_id GROUP BY w.job_id "
     "ORDER BY w.job_id", None, 3, "chdb"),
]


@pytest.mark.parametrize("sql, params, rows, engine", LEGIT, ids=[f"q{i:02d}" for i in range(len(LEGIT))])
def test_analyst_query_works(sbx, sql, params, rows, engine):
    if engine and engine != sbx.backend:
        pytest.skip(f"{engine} only")
    got = sbx.query(sql, params)
    assert got.num_rows > 0
    if rows is not None:
        assert got.num_rows == rows


def test_show_tables_lists_project_tables_only(sbx):
    names = set(sbx.query("SHOW TABLES").column(0).to_pylist())
    assert names <= PROJECT_TABLES and {"windows", "windows_data", "jobs", "schema_version"} <= names


def _no_nan(rows: list[dict]) -> list[dict]:
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]


@pytest.mark.parametrize("name", sorted(NAMED_QUERIES))
def test_every_named_query_runs_as_free_sql(sbx, name):
    """The library's queries pass the sandbox and answer as free SQL what run_named answers."""
    q = NAMED_QUERIES[name]
    given = {p.name: ("a" if p.type == "String" else 0) for p in q.params if p.default is None}
    bound = bind(q.params, given, name)
    used = placeholders(q.sql)
    free = sbx.query(q.sql, {n: v for n, (_t, v) in bound.items() if n in used})
    assert _no_nan(free.to_pylist()) == _no_nan(sbx.run_named(name, given).to_pylist())


# --------------------------------------------------------------------------
# the allowlist against the engine's own catalogue
# --------------------------------------------------------------------------
DENIED = ("file", "url", "s3", "remote", "remoteSecure", "executable", "input", "jdbc", "odbc", "hdfs", "mysql",
          "postgresql", "numbers", "merge", "view", "cluster", "dictionary", "Python", "generateRandom", "values",
          "format", "dictGet", "dictGetString", "dictHas", "joinGet", "getSetting", "getSettingOrDefault",
          "getServerSetting", "getMergeTreeSetting", "getMacro", "hasColumnInTable", "hostName", "FQDN",
          "currentUser", "currentDatabase", "version", "uptime", "sleep", "sleepEachRow", "filesystemAvailable",
          "addressToSymbol", "demangle", "logTrace", "showCertificate", "globalVariable", "getClientHTTPHeader",
          "queryID", "serverUUID", "tcpPort", "evalMLMethod", "in", "notIn", "globalIn", "nullIn")


def _chdb_catalogue():
    chdb = pytest.importorskip("chdb")
    funcs = [line.split("\t") for line in str(chdb.query(
        "SELECT name, alias_to FROM system.functions", "TSV")).strip().splitlines()]
    table_funcs = str(chdb.query("SELECT name FROM system.table_functions", "TSV")).split()
    types = set(str(chdb.query("SELECT name FROM system.data_type_families", "TSV")).split())
    return funcs, table_funcs, types


def test_allowlist_refuses_the_dangerous_and_every_table_function():
    funcs, table_funcs, _types = _chdb_catalogue()
    assert not [f for f in DENIED if is_allowed_function(f)]
    assert not [t for t in table_funcs if is_allowed_function(t)]
    # Keywords the sandbox lets stand before "(" name no engine function it would refuse (``in`` is
    # checked as the IN operator: its right side is a table position).
    keyword_named = [n for n in [f for f, _a in funcs] + table_funcs if n.upper() in _PAREN_KEYWORDS]
    assert [n for n in keyword_named if not is_allowed_function(n)] == ["in"]
    # A name allowed because of its case-insensitive spelling or a combinator suffix is one of ours or an
    # alias of one of ours: no engine function outside the list slips in.
    slipped = [(name, alias) for name, alias in funcs
               if is_allowed_function(name) and name not in FUNCTIONS and alias not in FUNCTIONS]
    assert slipped == []


def test_allowlist_names_exist():
    """Every listed name is a function or type of the engine (no typos), but for 18.16 and parser forms."""
    funcs, _table_funcs, types = _chdb_catalogue()
    known = {name.lower() for name, _alias in funcs} | {t.lower() for t in types}
    older_or_syntax = {"COLUMNS", "untuple", "sumMap", "minMap", "maxMap"}
    assert sorted(f for f in FUNCTIONS if f.lower() not in known and f not in older_or_syntax) == []
    assert is_allowed_function("sumIf") and is_allowed_function("uniqExactArrayIf")
    assert is_allowed_function("COUNT") and not is_allowed_function("fileIf")


def test_tokens_keep_strings_and_names_apart():
    toks = tokens("SELECT 'file(' AS `x y`, \"q\"\"n\" FROM t -- file(\n WHERE a = {p:String}")
    assert [(t.kind, t.text) for t in toks] == [
        ("word", "SELECT"), ("string", "'file('"), ("word", "AS"), ("ident", "x y"), ("punct", ","),
        ("ident", 'q"n'), ("word", "FROM"), ("word", "t"), ("word", "WHERE"), ("word", "a"), ("punct", "="),
        ("placeholder", "{p:String}")]


# --------------------------------------------------------------------------
# free SQL runs beside writes
# --------------------------------------------------------------------------
# A query of several seconds on each engine, bounded by the limits below.
LONG_QUERY = TIME_ATTACK
LONG_LIMITS = SQLLimits(max_execution_time_s=4, max_memory_mb=2048, max_result_rows=1000)


def _writes_beside(store, query: str, limits: SQLLimits, n_writes: int = 5) -> tuple[list[float], float, str]:
    """Run ``query`` in a thread and time ``n_writes`` inserts and offset commits meanwhile.

    Returns the write latencies (s), how long the query ran and its error.
    """
    out: dict = {}

    def long_query():
        t0 = time.monotonic()
        try:
            store.query(query, limits=limits)
            out["error"] = ""
        except StoreError as e:
            out["error"] = str(e)
        out["ran"] = time.monotonic() - t0
        out["end"] = time.monotonic()

    th = threading.Thread(target=long_query)
    th.start()
    time.sleep(1.0)  # the query is running now
    latencies, last_write = [], 0.0
    for i in range(n_writes):
        t0 = time.monotonic()
        store.insert("window", window_rows(2, job=f"beside-{i}-{time.time_ns()}"))
        store.store_offsets("beside", {("ss.results", 0): i})
        last_write = time.monotonic()
        latencies.append(last_write - t0)
    th.join(60)
    assert not th.is_alive()
    assert last_write < out["end"], "the writes ended after the query: they did not run beside it"
    return latencies, out["ran"], out["error"]


def test_free_sql_runs_beside_writes(sbx):
    latencies, ran, error = _writes_beside(sbx, LONG_QUERY[sbx.backend], LONG_LIMITS)
    assert error == "" or "max_execution_time_s" in error, error  # a fast machine may finish the query
    assert max(latencies) < 1.0, latencies
    print(f"\n{sbx.backend}: write latency during a {ran:.1f} s free query: median "
          f"{statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")


def test_daemon_serves_writes_during_a_long_free_query(tmp_path):
    """Through the store daemon: inserts and offset commits during a free query that runs into its limit.

    The client asks for a longer limit than the daemon's; the daemon's holds.
    """
    daemon_limits = SQLLimits(max_execution_time_s=5, max_memory_mb=1024, max_result_rows=1000)
    with StoreDaemon(f"chdb://{tmp_path / 'store'}", sql_limits=daemon_limits) as d:
        store = open_store(d.url)
        store.setup()
        store.insert("window", window_rows(4, job="warm"))
        greedy = SQLLimits(max_execution_time_s=600, max_memory_mb=100_000, max_result_rows=10_000_000)
        latencies, ran, error = _writes_beside(store, TIME_ATTACK["chdb"], greedy, n_writes=8)
        assert "max_execution_time_s limit (5 s)" in error
        assert ran < 5 + 3
        assert max(latencies) < 1.0, latencies
        print(f"\ndaemon: write latency during a {ran:.1f} s free query: median "
              f"{statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
        # The limits of a client below the daemon's apply.
        with pytest.raises(StoreError, match="more than 2 rows"):
            store.query("SELECT job_id FROM windows", limits=SQLLimits(max_result_rows=2))
        assert store.query("SELECT count() AS n FROM windows").column("n")[0].as_py() == 4 + 8 * 2
        store.close()
