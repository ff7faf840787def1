"""The Store API against real engines: the same test functions on chDB and on the 18.16 server."""
from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from actions.alerts import acknowledge
from core import codec
from core import schema as S
from storage import NAMED_QUERIES, StoreError, ddl, open_store
from storage.migrations import LATEST
from tests.storage.conftest import BASE_NS, DAY_NS, optype_rows, registration, window_rows

pytestmark = pytest.mark.integration


def _fleet(store):
    """Three jobs: a is slow (S 1.5), b mildly (1.05), c on another team and day (1.2)."""
    store.insert("window", window_rows(4, job="a", slowdown=1.5, gpu_hours=10.0, verdict="worker"))
    store.insert("window", window_rows(2, job="b", slowdown=1.05, gpu_hours=20.0, verdict=""))
    store.insert("window", window_rows(3, job="c", team="vision", model="vit", n_gpus=8, slowdown=1.2,
                                              gpu_hours=5.0, verdict="stage", analyzed_ns=BASE_NS + DAY_NS))


def _summary(store, **params):
    return store.run_named("fleet_summary", params).to_pylist()[0]


def test_insert_and_window_stored(store):
    assert not store.window_stored(("a", 0, 0))
    store.insert("window", window_rows(3, job="a"))
    assert store.window_stored(("a", 0, 0)) and store.window_stored(("a", 0, 20))
    assert not store.window_stored(("a", 0, 30)) and not store.window_stored(("a", 1, 0))


def test_reinserting_never_double_counts(store):
    _fleet(store)
    before = _summary(store)
    # A crash replays: the same windows again, a batch overlapping stored and new ones, duplicates in one batch.
    _fleet(store)
    store.insert("window", window_rows(6, job="a", slowdown=1.5, gpu_hours=10.0))
    dup = window_rows(1, job="d", first_window=0)
    store.insert("window", pa.concat_tables([dup, dup, dup]))
    after = _summary(store)
    assert after["windows"] == before["windows"] + 2 + 1
    assert after["jobs"] == before["jobs"] + 1
    n = store.query(f"SELECT count() AS n FROM {store._data('windows')}").column("n")[0].as_py()
    assert n == after["windows"]  # nothing duplicated on disk either
    ops = optype_rows("a", [0, 10])
    store.insert("optype_slowdown", ops)
    store.insert("optype_slowdown", ops)
    for table in ("optype_slowdown", "optype_slowdown_data"):  # a LowCardinality key column (optype) too
        assert store.query(f"SELECT count() AS n FROM {table}").column("n")[0].as_py() == ops.num_rows


def test_engine_inserts_without_its_own_merge_and_views_still_read_once(store):
    """``optimize_on_insert = 0`` reaches the engine (where it has it): a block's duplicate keys are kept.

    ``Store.insert`` drops them before the engine sees them (above); this goes under it to check that
    the setting is applied and that the views' FINAL still counts such a key once.
    """
    rows = window_rows(1, job="dup")
    spec = ddl.TABLE_OF_KIND["window"]
    twice = store._with_stored_ns(spec, pa.concat_tables([rows, rows]))
    store._insert(spec.data, twice)
    raw = store.query(f"SELECT count() AS n FROM {store._data('windows')} WHERE job_id = 'dup'").column("n")[0].as_py()
    assert raw == 2  # with the engine's default (optimize_on_insert = 1) modern engines store 1
    assert store.query("SELECT count() AS n FROM windows WHERE job_id = 'dup'").column("n")[0].as_py() == 1


def test_fleet_queries(store):
    _fleet(store)
    s = _summary(store)
    assert (s["jobs"], s["windows"]) == (3, 9)
    assert s["gpu_hours"] == pytest.approx(4 * 10 + 2 * 20 + 3 * 5)
    wasted = 40 * (1 - 1 / 1.5) + 40 * (1 - 1 / 1.05) + 15 * (1 - 1 / 1.2)
    assert s["wasted_gpu_hours"] == pytest.approx(wasted)
    assert s["mean_slowdown"] == pytest.approx((1.5 + 1.05 + 1.2) / 3)
    share = store.run_named("straggling_share").to_pylist()[0]
    assert (share["jobs"], share["straggling_jobs"], share["threshold"]) == (3, 2, 1.1)
    assert share["share"] == pytest.approx(2 / 3)
    assert store.run_named("straggling_share", {"threshold": "1.3"}).to_pylist()[0]["straggling_jobs"] == 1
    assert store.run_named("waste_share").to_pylist()[0]["share"] == pytest.approx(wasted / 95)
    # The console's headline comes from fleet_summary alone: the same shares in one scan.
    assert (s["straggling_share"], s["waste_share"]) == pytest.approx((2 / 3, wasted / 95))
    cdf = store.run_named("slowdown_cdf").to_pylist()
    assert [r["slowdown"] for r in cdf] == pytest.approx([1.05, 1.2, 1.5])
    assert [r["share"] for r in cdf] == pytest.approx([1 / 3, 2 / 3, 1.0])
    # Fewer points than jobs: the minimum, then evenly spaced ranks up to the maximum.
    one = store.run_named("slowdown_cdf", {"points": 1}).to_pylist()
    assert [v for r in one for v in (r["slowdown"], r["share"])] == pytest.approx([1.05, 1 / 3, 1.5, 1.0])
    by_team = {r["team"]: r for r in store.run_named("wasted_by_team").to_pylist()}
    assert set(by_team) == {"llm", "vision"} and by_team["vision"]["windows"] == 3
    by_cause = {r["cause"]: r["windows"] for r in store.run_named("wasted_by_cause").to_pylist()}
    assert by_cause == {"worker": 4, "none": 2, "stage": 3}
    days = store.run_named("wasted_by_day").to_pylist()
    assert [str(r["day"]) for r in days] == ["2023-11-14", "2023-11-15"]
    top = store.run_named("top_wasting_jobs", {"limit": 2}).to_pylist()
    assert [r["job_id"] for r in top] == ["a", "c"] and top[0]["slowdown"] == pytest.approx(1.5)
    assert store.run_named("wasted_by_model", {"model": "vit"}).column("model").to_pylist() == ["vit"]


@pytest.mark.parametrize("params, jobs, windows", [
    ({"team": "vision"}, 1, 3),
    ({"model": "gpt-7b"}, 2, 6),
    ({"min_gpus": 64}, 2, 6),
    ({"job_id": "b"}, 1, 2),
    ({"since": BASE_NS + DAY_NS}, 1, 3),
    ({"until": "2023-11-15"}, 2, 6),
    ({"since": "2023-11-15T00:00:00Z", "until": "2023-11-16"}, 1, 3),
    ({"team": "nobody"}, 0, 0),
])
def test_fleet_filters(store, params, jobs, windows):
    _fleet(store)
    s = _summary(store, **params)
    assert (s["jobs"], s["windows"]) == (jobs, windows)
    if not jobs:
        assert math.isnan(s["mean_slowdown"]) and math.isnan(s["p90_slowdown"])


def test_job_drilldown_queries(store):
    _fleet(store)
    rows = store.run_named("job_windows", {"job_id": "a"}).to_pylist()
    assert [r["window_id"] for r in rows] == [0, 10, 20, 30]
    assert rows[0]["complete"] == 1 and rows[0]["verdicts_json"] == '[{"kind": "worker"}]'
    cells = codec.from_rows(S.WORKER_SLOWDOWN, [
        dict(job_id="a", attempt=0, window_id=10, step=-1, dp_rank=d, pp_rank=p, s_dp=1.0 + d, s_pp=1.0 + p,
             s_w=1.0 + min(d, p)) for d in range(4) for p in range(2)])
    store.insert("worker_slowdown", cells)
    got = store.run_named("job_workers", {"job_id": "a", "window_id": 10}).to_pylist()
    assert len(got) == 8 and got[0]["dp_rank"] == 0 and got[-1]["s_w"] == 2.0
    steps = codec.from_rows(S.STEP_SLOWDOWN, [dict(job_id="a", attempt=0, window_id=10, step=st, actual_s=1.1,
                                                   sim_s=1.0, ideal_s=0.8, slowdown=1.25) for st in range(10, 20)])
    store.insert("step_slowdown", steps)
    trend = store.run_named("job_step_trend", {"job_id": "a"})
    assert trend.column("step").to_pylist() == list(range(10, 20))
    assert store.run_named("job_step_trend", {"job_id": "a", "window_id": 0}).num_rows == 0
    with pytest.raises(StoreError, match="parameter 'job_id' \\(String\\) is required"):
        store.run_named("job_windows")


def _waste_rows(windows: pa.Table, optypes: pa.Table) -> pa.Table:
    """The OPTYPE_WASTE rows the analysis writes with each window (``analyzers.window.optype_waste``)."""
    from analyzers.window import optype_waste

    return pa.concat_tables([
        optype_waste(w, optypes.filter(pc.equal(optypes["window_id"], w["window_id"])))
        for w in windows.to_pylist()])


def test_wasted_by_optype_reads_the_rows_written_with_the_windows(store):
    a_win, a_opt = window_rows(2, job="a", gpu_hours=10.0), optype_rows("a", [0, 10])
    b_win, b_opt = window_rows(1, job="b", gpu_hours=20.0), optype_rows("b", [0])
    for win, opt in ((a_win, a_opt), (b_win, b_opt), (b_win, b_opt)):  # b's unit twice: a replay
        store.insert("optype_slowdown", opt)
        store.insert("optype_waste", _waste_rows(win, opt))
        store.insert("window", win)
    rows = {r["optype"]: r for r in store.run_named("wasted_by_optype").to_pylist()}
    assert set(rows) == {"forward-compute", "gc"}
    assert rows["gc"]["windows"] == 3
    assert rows["gc"]["wasted_gpu_hours"] == pytest.approx(40 * (1 - 1 / 1.3))
    assert rows["forward-compute"]["mean_slowdown"] == pytest.approx(1.1)
    assert store.run_named("wasted_by_optype", {"team": "nobody"}).num_rows == 0
    assert store.query(f"SELECT count() AS n FROM {store.data_table('optype_waste')}").column("n")[0].as_py() == 6


def test_an_insert_that_failed_part_way_is_replayed_without_duplicates(store, monkeypatch):
    """The engine wrote the rows and then failed (as when a later block of a large insert fails): the
    replay must find them stored, high-water marks or not."""
    store.insert("window", window_rows(2, job="a"))
    real = store._insert

    def stored_then_failed(table, rows):
        real(table, rows)
        raise StoreError("connection lost after the write")

    monkeypatch.setattr(store, "_insert", stored_then_failed)
    with pytest.raises(StoreError):
        store.insert("window", window_rows(3, job="a", first_window=20))
    monkeypatch.undo()
    store.insert("window", window_rows(3, job="a", first_window=20))
    assert store.query(f"SELECT count() AS n FROM {store._data('windows')} WHERE job_id = 'a'"
                       ).column("n")[0].as_py() == 5


def test_alerts(store):
    alerts = codec.from_rows(S.ALERT, [
        dict(alert_id=f"a:{i}", job_id="a" if i % 2 else "b", attempt=0, ts_ns=BASE_NS + i, rule="slowdown",
             severity="critical" if i == 3 else "warning", summary=f"alert {i}", details_json="{}")
        for i in range(5)])
    store.insert("alert", alerts)
    store.insert("alert", alerts)
    got = store.run_named("alert_history").column("alert_id").to_pylist()
    assert got == ["a:4", "a:3", "a:2", "a:1", "a:0"]
    assert store.run_named("alert_history", {"limit": 2}).column("alert_id").to_pylist() == ["a:4", "a:3"]
    assert store.run_named("alert_history", {"job_id": "a"}).column("alert_id").to_pylist() == ["a:3", "a:1"]
    assert store.run_named("alert_history", {"severity": "critical"}).num_rows == 1


def test_acknowledgements_are_stored_and_can_be_undone(store):
    store.insert("alert", codec.from_rows(S.ALERT, [
        dict(alert_id=f"a:{i}", job_id="a", attempt=0, ts_ns=BASE_NS + i, rule="hang", severity="critical",
             summary=f"alert {i}", details_json="{}") for i in range(3)]))
    assert store.run_named("alert_history", {"acked": 0}).num_rows == 3
    assert acknowledge(store, ["a:0", "a:2", "a:2", ""], by="alice", note="drained host-7", now_ns=BASE_NS + 10) == 2
    rows = {r["alert_id"]: r for r in store.run_named("alert_history").to_pylist()}
    assert (rows["a:2"]["acked"], rows["a:2"]["acked_by"], rows["a:2"]["ack_note"]) == (1, "alice", "drained host-7")
    assert rows["a:1"]["acked"] == 0
    assert store.run_named("alert_history", {"acked": 0}).column("alert_id").to_pylist() == ["a:1"]
    acknowledge(store, ["a:2"], by="bob", acked=False, now_ns=BASE_NS + 20)  # the latest row wins
    assert store.run_named("alert_history", {"acked": 1}).column("alert_id").to_pylist() == ["a:0"]
    assert acknowledge(store, []) == 0


def test_offsets_latest_stored_value_wins(store):
    assert store.load_offsets("src", ["t1"], [0, 1]) == {}
    store.store_offsets("src", {("t1", 0): 10, ("t1", 1): 5, ("t2", 0): 7})
    store.store_offsets("src", {("t1", 0): 3})  # a lower value stored later still wins
    store.store_offsets("other", {("t1", 0): 99})
    assert store.load_offsets("src", ["t1", "t2"], [0, 1]) == {("t1", 0): 3, ("t1", 1): 5, ("t2", 0): 7}
    assert store.load_offsets("src", ["t1"], [1, 2]) == {("t1", 1): 5}


def test_offsets_keep_the_log_they_were_read_from(store):
    """The log id stored with an offset is what tells a partition's new log from the one it was read in."""
    store.store_offsets("src", {("t1", 0): 10, ("t1", 1): 5}, {("t1", 0): "uuid-a", ("t1", 1): "uuid-a"})
    store.store_offsets("src", {("t1", 0): 2}, {("t1", 0): "uuid-b"})
    store.store_offsets("src", {("t2", 0): 7})  # stored without one: unknown
    assert store.load_offset_logs("src", ["t1", "t2"], [0, 1]) == {("t1", 0): "uuid-b", ("t1", 1): "uuid-a",
                                                                    ("t2", 0): ""}
    assert store.load_offset_logs("src", ["t1"], [1]) == {("t1", 1): "uuid-a"}
    assert store.load_offsets("src", ["t1"], [0]) == {("t1", 0): 2}


def test_shard_state_round_trips_any_bytes_and_the_latest_wins(store):
    assert store.load_state("src", "p0/2") is None
    blob = bytes(range(256)) * 40 + b"\x00\xff"
    store.store_state("src", "p0/2", 1, b"old")
    store.store_state("src", "p0/2", 2, blob)
    store.store_state("src", "p1/2", 1, b"other shard")
    assert store.load_state("src", "p0/2") == (2, blob)
    assert store.load_state("src", "p1/2") == (1, b"other shard")
    assert store.load_state("other", "p0/2") is None


def test_load_jobs_latest_registration(store):
    store.insert("job", registration("a", ts_ns=1, team="old"))
    store.insert("job", registration("a", ts_ns=5, team="new"))
    store.insert("job", registration("a", ts_ns=2, team="stale"))
    store.insert("job", registration("a", attempt=1, ts_ns=9))
    store.insert("job", registration("b"))
    jobs = store.load_jobs()
    assert [(j["job_id"], j["attempt"], j["team"]) for j in jobs] == [("a", 0, "new"), ("a", 1, "llm"),
                                                                      ("b", 0, "llm")]
    assert set(jobs[0]) == set(S.JOB.names)


@pytest.mark.parametrize("sql", [
    "INSERT INTO windows_data (job_id) VALUES ('x')",
    "ALTER TABLE windows_data DELETE WHERE 1 = 1",
    "DROP TABLE windows",
    "TRUNCATE TABLE windows_data",
    "SELECT 1; DROP TABLE windows",
    "CREATE TABLE x (a Int8) ENGINE = Memory",
    "SELECT * FROM file('/etc/passwd', 'LineAsString')",
])
def test_free_sql_is_read_only(store, sql):
    store.insert("window", window_rows(2, job="a"))
    with pytest.raises(StoreError):
        store.query(sql)
    assert store.query("SELECT count() AS n FROM windows").column("n")[0].as_py() == 2


def test_parameters_are_bound_not_spliced(store):
    store.insert("window", window_rows(2, job="a"))
    evil = "a' OR '1'='1"
    assert store.query("SELECT count() AS n FROM windows WHERE job_id = {j:String}", {"j": evil}) \
        .column("n")[0].as_py() == 0
    assert store.run_named("fleet_summary", {"job_id": evil}).column("jobs")[0].as_py() == 0
    got = store.query("SELECT {s:String} AS s, {n:Int64} AS n, {x:Float64} AS x, {d:Date} AS d",
                      {"s": "it's \\ {x}", "n": "-5", "x": 0.25, "d": "2024-02-29"}).to_pylist()[0]
    assert got == {"s": "it's \\ {x}", "n": -5, "x": 0.25, "d": __import__("datetime").date(2024, 2, 29)}
    with pytest.raises(StoreError, match="expected an integer"):
        store.query("SELECT {n:Int64} AS n", {"n": "1 OR 1"})


def test_errors_are_one_line_store_errors(store):
    with pytest.raises(StoreError, match="unknown query 'nope'; known: alert_history"):
        store.run_named("nope")
    with pytest.raises(StoreError, match="unknown parameter 'tema'"):
        store.run_named("fleet_summary", {"tema": "x"})
    with pytest.raises(StoreError, match="unknown record kind 'windows'"):
        store.insert("windows", window_rows(1))
    with pytest.raises(StoreError, match="missing column 'slowdown'"):
        store.insert("window", window_rows(1).drop_columns(["slowdown"]))
    with pytest.raises(StoreError) as e:
        store.query("SELECT no_such_column FROM windows")
    assert "\n" not in str(e.value)


def test_every_kind_round_trips(store):
    dead = codec.from_rows(S.DEAD_LETTER, [dict(ts_ns=BASE_NS, source_topic="ss.ops", source_partition=1,
                                                source_offset=7, key="a", reason="bad", payload=b"\x00\xffxy")])
    hang = codec.from_rows(S.HANG, [dict(job_id="a", attempt=0, hang_id=BASE_NS, kind="comm_hang", group="dp:pp=0",
                                         seq=3, op="all_reduce", stuck_ranks="0-3", missing_ranks="5",
                                         suspect_hosts="h5", since_ns=BASE_NS - 10, duration_s=30.0,
                                         evidence_json="{}")])
    link = codec.from_rows(S.LINK_FAULT, [dict(job_id="a", attempt=0, window_id=0, group="dp:pp=0", kind="link", src=1,
                                               dst=2, confidence=0.9, slowdown=3.0, evidence_json="{}")])
    span = codec.from_rows(S.OP_SPAN, [dict(job_id="a", attempt=0, rank=r, dp_rank=r, pp_rank=0, window_id=0, step=1,
                                            optype="forward-compute", start_ns=BASE_NS, duration_ns=5, seq_id=0, mc=0,
                                            gmc=0, mb_id=0) for r in range(4)])
    for kind, table, view in (("dead_letter", dead, "dead_letters"), ("hang", hang, "hangs"),
                              ("link_fault", link, "link_faults"), ("op_span", span, "op_spans")):
        store.insert(kind, table)
        store.insert(kind, table)
        # Kinds stored "first" are key-checked: the second copy never reaches the disk. Op spans are
        # "replace": the view's FINAL keeps one.
        first = ddl.TABLE_OF_KIND[kind].mode == "first"
        for t in (view, store._data(view)) if first else (view,):
            assert store.query(f"SELECT count() AS n FROM {t}").column("n")[0].as_py() == table.num_rows, (kind, t)
    assert store.query("SELECT payload_hex FROM dead_letters").column(0).to_pylist() == ["00FF7879"]
    assert store.query("SELECT `group` FROM link_faults").column(0).to_pylist() == ["dp:pp=0"]


def test_op_span_retention(store):
    span = codec.from_rows(S.OP_SPAN, [dict(job_id="a", attempt=0, rank=0, dp_rank=0, pp_rank=0, window_id=0, step=1,
                                            optype="gc", start_ns=BASE_NS, duration_ns=5, seq_id=0, mc=0, gmc=0,
                                            mb_id=-1)])
    store.insert("op_span", span)
    today = __import__("time").time_ns()
    assert store.enforce_retention(today) == []
    dropped = store.enforce_retention(today + (store.retention_days + 1) * DAY_NS)
    assert len(dropped) == 1
    assert store.query("SELECT count() AS n FROM op_spans").column("n")[0].as_py() == 0


def test_windows_with_kept_spans(store):
    def span(attempt, window_id, rank):
        return dict(job_id="a", attempt=attempt, rank=rank, dp_rank=rank, pp_rank=0, window_id=window_id, step=1,
                    optype="forward-compute", start_ns=BASE_NS, duration_ns=5, seq_id=0, mc=0, gmc=0, mb_id=0)

    store.insert("op_span", codec.from_rows(S.OP_SPAN, [span(a, w, r) for a, w in ((0, 30), (0, 10), (1, 50))
                                                        for r in range(3)]))
    store.insert("op_span", codec.from_rows(S.OP_SPAN, [dict(span(0, 70, 0), job_id="b")]))
    got = store.run_named("job_span_windows", {"job_id": "a"}).to_pylist()
    assert got == [{"attempt": 0, "window_id": 10}, {"attempt": 0, "window_id": 30}, {"attempt": 1, "window_id": 50}]
    assert store.run_named("job_span_windows", {"job_id": "a", "attempt": 1}).column("window_id").to_pylist() == [50]


def test_setup_is_idempotent(store):
    store.insert("window", window_rows(2))
    store.setup()
    store.setup()
    assert store.query("SELECT count() AS n FROM windows").column("n")[0].as_py() == 2
    versions = store.query("SELECT version FROM schema_version ORDER BY version").column(0).to_pylist()
    assert versions == list(range(1, LATEST + 1))


@pytest.mark.parametrize("store_url", ["chdb", "server", "cluster"], indirect=True)
def test_migration_from_version_1_keeps_data(store_url):
    from storage.migrations import LATEST

    st = open_store(store_url)
    try:
        st.setup(target_version=1)
        cols = st.table_columns()["windows_data"]
        assert "m_w" not in cols and "m_s" not in cols
        assert "alert_acks_data" not in st.table_columns()
        old = window_rows(3, job="old")
        from storage.migrations import _added_later

        later = sorted(_added_later("windows", 1))
        assert {"m_w", "m_s", "mfu", "mfu_ideal"} <= set(later)
        old_rows = st._with_stored_ns(ddl.TABLE_BY_NAME["windows"], old).drop_columns(later)
        st._insert("windows_data", old_rows)
        assert st.query("SELECT count() AS n FROM windows").column("n")[0].as_py() == 3
        st.setup()
        assert st.schema_version() == LATEST
        assert acknowledge(st, ["x:1"], by="oncall") == 1  # a table a later step created
        got = st.run_named("job_windows", {"job_id": "old"}).to_pylist()
        assert [r["window_id"] for r in got] == [0, 10, 20]
        assert [(r["m_w"], r["m_s"], r["slowdown"]) for r in got] == [(0.0, 0.0, 1.25)] * 3
        st.insert("window", window_rows(1, job="new"))
        assert st.run_named("job_windows", {"job_id": "new"}).column("m_w").to_pylist() == [0.5]
        # A column the schema module has but the table lost is added back by setup().
        st._execute("ALTER TABLE windows_data DROP COLUMN note")
        st._execute("DROP TABLE windows")
        st.setup()
        assert "note" in st.table_columns()["windows_data"]
        assert st.query("SELECT count() AS n FROM windows").column("n")[0].as_py() == 4
    finally:
        if hasattr(st, "database"):
            st._execute(f"DROP DATABASE IF EXISTS `{st.database}`")
        st.close()


@pytest.mark.parametrize("store_url", ["chdb", "server", "cluster"], indirect=True)
def test_the_run_time_changes_of_a_store_from_before_the_agreed_step_gain_it(store_url):
    """Version 6 adds control_changes.from_step: a change stored before it reads as one without a step (0: each
    rank's next step end), and one stored after it keeps its step, which the job page's query returns."""
    from core.control import make_change
    from storage.migrations import LATEST

    st = open_store(store_url)
    try:
        st.setup(target_version=5)
        assert "from_step" not in st.table_columns()["control_changes_data"]
        old = make_change("bob", 10**18, "j1", {"sample": "5/10"})
        rows = codec.from_rows(S.CONTROL_CHANGE, [old.row()])
        st._insert("control_changes_data", st._with_stored_ns(ddl.TABLE_BY_NAME["control_changes"], rows)
                   .drop_columns(["from_step"]))
        st.setup()
        assert st.schema_version() == LATEST >= 6 and "from_step" in st.table_columns()["control_changes_data"]
        new = make_change("alice", 10**18 + 10**9, "j1", {"sample": "1/1"}, from_step=1017)
        st.insert("control_change", codec.from_rows(S.CONTROL_CHANGE, [new.row()]))
        got = st.run_named("job_controls", {"job_id": "j1"}).to_pylist()
        assert [(r["change_id"], r["from_step"]) for r in got] == [(new.change_id, 1017), (old.change_id, 0)]
    finally:
        if hasattr(st, "database"):
            st._execute(f"DROP DATABASE IF EXISTS `{st.database}`")
        st.close()


@pytest.mark.parametrize("store_url", ["chdb", "server", "cluster"], indirect=True)
def test_a_store_made_before_a_table_existed_gains_it(store_url):
    """link_cells came to ddl.TABLES with no migration step: a store set up before it (version 5, no
    link_cells_data) failed every later setup() with UNKNOWN_TABLE, so `trace` and `demo` would not start on
    a user's existing .stragglerscope/store (found on this machine's own)."""
    st = open_store(store_url)
    try:
        st.setup()
        st.insert("window", window_rows(2, job="old"))
        st._execute("DROP TABLE link_cells")
        st._execute("DROP TABLE link_cells_data")
        assert "link_cells_data" not in st.table_columns()
        st.setup()
        assert "link_cells_data" in st.table_columns()
        assert st.query("SELECT count() AS n FROM link_cells").column("n")[0].as_py() == 0
        assert st.query("SELECT count() AS n FROM windows").column("n")[0].as_py() == 2
    finally:
        if hasattr(st, "database"):
            st._execute(f"DROP DATABASE IF EXISTS `{st.database}`")
        st.close()


def test_same_results_on_both_backends(tmp_path, server_store):
    """Every named query gives the same answer on chDB 26.x and on the 18.16 server."""
    chdb_store = open_store(f"chdb://{tmp_path / 'both'}")
    try:
        for st in (chdb_store, server_store):
            st.setup()
            _fleet(st)
            st.insert("optype_slowdown", optype_rows("a", [0, 10]))
            st.insert("worker_slowdown", codec.from_rows(S.WORKER_SLOWDOWN, [
                dict(job_id="a", attempt=0, window_id=0, step=-1, dp_rank=d, pp_rank=0, s_dp=1.0, s_pp=1.0, s_w=1.0)
                for d in range(3)]))
        assert_same_named_results(chdb_store, server_store)
    finally:
        chdb_store.close()


def assert_same_named_results(one, other, job_id: str = "a") -> None:
    """Every named query (required parameters: ``job_id``, else 0) answers alike on both stores."""
    for name, q in sorted(NAMED_QUERIES.items()):
        params = {p.name: (job_id if p.name == "job_id" else 0) for p in q.params if p.default is None}
        a, b = one.run_named(name, params), other.run_named(name, params)
        assert a.column_names == b.column_names, name
        assert a.schema.types == b.schema.types, name
        ra, rb = a.to_pylist(), b.to_pylist()
        assert len(ra) == len(rb), name
        for x, y in zip(ra, rb):
            for k in x:
                if isinstance(x[k], float):
                    assert x[k] == pytest.approx(y[k], nan_ok=True), (name, k)
                else:
                    assert x[k] == y[k], (name, k)


def test_bad_urls_and_unreachable_servers():
    for url, msg in (("", "empty store URL"), ("mysql://x", "unsupported store URL"),
                     ("chdb://", "needs a path"), ("clickhouse://", "bad ClickHouse URL"),
                     ("clickhouse://u@127.0.0.1:9/bad-db", "bad database name"),
                     ("http://127.0.0.1", "needs a port")):
        with pytest.raises(StoreError, match=msg):
            open_store(url)
    from services.clickhouse_server import free_port

    port = free_port()
    with pytest.raises(StoreError, match=f"127.0.0.1:{port} is unreachable"):
        open_store(f"clickhouse://default:@127.0.0.1:{port}/default")
    with pytest.raises(StoreError, match=f"http://127.0.0.1:{port} is unreachable"):
        open_store(f"http://127.0.0.1:{port}")


def test_one_chdb_path_per_process(tmp_path):
    a = open_store(f"chdb://{tmp_path / 'a'}")
    try:
        b = open_store(f"chdb://{tmp_path / 'a'}")  # the same path again: shares the session
        b.close()
        with pytest.raises(StoreError, match="one data path per process"):
            open_store(f"chdb://{tmp_path / 'b'}")
    finally:
        a.close()


def test_where_the_gpu_hours_went_stragglers_and_faults_together(store):
    """One query answers the week's bill: straggler waste and every C4 downtime category, matching truth."""
    from analyzers.downtime import account_downtime, to_tables
    from generators.downtimegen import generate_downtime_fleet

    fleet = generate_downtime_fleet(n_jobs=4, days=3.0, seed=2)
    rows = account_downtime(fleet.tables())
    store.insert("downtime", to_tables(rows)["downtime"])
    store.insert("downtime", to_tables(rows)["downtime"])  # idempotent per incident
    windows = window_rows(4)
    store.insert("window", windows)
    got = store.run_named("gpu_hours_lost").to_pylist()
    by_cause: dict[str, float] = {}
    for r in got:
        by_cause[r["cause"]] = by_cause.get(r["cause"], 0.0) + r["gpu_hours"]
    truth = {c: sum(t[f"{c}_gpu_hours"] for t in fleet.truth)
             for c in ("detect", "diagnose", "isolate", "lost_progress", "reinit")}
    names = {"detect": "fault: detection", "diagnose": "fault: diagnosis", "isolate": "fault: isolation",
             "lost_progress": "fault: lost progress", "reinit": "fault: re-initialisation"}
    for c, want in truth.items():
        assert by_cause[names[c]] == pytest.approx(want, rel=0.01), c
    assert by_cause["stragglers"] == pytest.approx(sum(windows.column("wasted_gpu_hours").to_pylist()), rel=1e-9)
    summary = store.run_named("downtime_summary").to_pylist()[0]
    assert summary["incidents"] == len(fleet.truth)
    assert summary["gpu_hours"] == pytest.approx(sum(t["total_gpu_hours"] for t in fleet.truth), rel=0.01)
    assert 0 < summary["detection_share"] < 1
    job = fleet.truth[0]["job_id"]
    assert store.run_named("job_downtime", {"job_id": job}).num_rows == sum(t["job_id"] == job for t in fleet.truth)


def test_mfu_distribution_weights_windows_by_time(store):
    w = window_rows(2, job="m")
    w = w.set_column(w.schema.get_field_index("mfu"), "mfu", pa.array([0.2, 0.4]))
    w = w.set_column(w.schema.get_field_index("mfu_ideal"), "mfu_ideal", pa.array([0.5, 0.5]))
    store.insert("window", w)
    (row,) = store.run_named("mfu_distribution").to_pylist()
    t = [a * n for a, n in zip(w.column("step_time_actual").to_pylist(), w.column("n_steps").to_pylist())]
    assert row["mfu"] == pytest.approx((0.2 * t[0] + 0.4 * t[1]) / sum(t))
    assert row["mfu_ideal"] == pytest.approx(0.5)
