"""`stragglerscope sql` helpers: formats, named queries and free SQL through run_sql."""
from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import StoreError, open_store
from storage.cli import format_result, list_queries, run_sql
from tests.storage.conftest import window_rows

TABLE = pa.table({"name": ["a", "b"], "x": [1.5, float("nan")], "n": [1, None]})


def test_format_json():
    assert json.loads(format_result(TABLE, "json")) == [{"name": "a", "x": 1.5, "n": 1},
                                                        {"name": "b", "x": None, "n": None}]


def test_format_csv_and_table():
    assert format_result(TABLE, "csv") == "name,x,n\na,1.5,1\nb,,\n"
    text = format_result(TABLE, "table")
    assert text.splitlines()[0].split() == ["name", "x", "n"] and text.rstrip().endswith("(2 rows)")


def test_format_parquet():
    data = format_result(TABLE, "parquet")
    assert isinstance(data, bytes) and pq.read_table(io.BytesIO(data)).num_rows == 2
    with pytest.raises(StoreError, match="unknown format"):
        format_result(TABLE, "xml")


def test_list_queries_names_every_query_and_parameter():
    text = list_queries()
    assert "fleet_summary:" in text and "threshold (Float64, default 1.1)" in text
    assert "job_id (String, required)" in text


@pytest.mark.integration
def test_run_sql(tmp_path):
    url = f"chdb://{tmp_path / 's'}"
    s = open_store(url)
    s.setup()
    s.insert("window", window_rows(3, job="j"))
    s.close()
    rows = json.loads(run_sql(url, name="fleet_summary", params=[], fmt="json"))
    assert rows[0]["jobs"] == 1 and rows[0]["windows"] == 3
    out = run_sql(url, name="job_windows", params=["job_id=j", "limit=2"], fmt="csv")
    assert len(out.splitlines()) == 3
    out = run_sql(url, query="SELECT job_id FROM windows WHERE window_id > {w:Int64}", params=["w=5"], fmt="csv")
    assert out == "job_id\nj\nj\n"
    assert "(1 row)" in run_sql(url, name="fleet_summary", params=["team=llm"], fmt="table")
    for kw, msg in ((dict(name="nope"), "unknown query 'nope'; known: alert_history"),
                    (dict(name="fleet_summary", params=["tema=x"]), "unknown parameter 'tema'"),
                    (dict(name="fleet_summary", params=["min_gpus=lots"]), "expected an integer"),
                    (dict(name="fleet_summary", params=["oops"]), "bad --param"),
                    (dict(query="DROP TABLE windows"), "DROP statements are refused"),
                    (dict(), "give either a query name or --query")):
        with pytest.raises(StoreError, match=msg):
            run_sql(url, fmt="json", **kw)


@pytest.mark.integration
def test_waiting_on_a_server_store_without_tables_says_so_in_words(ch_server, tmp_path, capsys):
    """Issue 49: `replay --publish-only --wait` against a store `run` never set up printed ClickHouse's "Code: 60.
    DB::Exception: Unknown table expression identifier 'windows_data'" (`run` had failed at its start)."""
    from stragglerscope.replay import wait_windows
    from storage.errors import missing_table, no_tables_yet

    if ch_server is None:
        pytest.skip("clickhouse-server is not installed (make setup-test installs it)")
    import uuid

    db = f"never_set_up_{uuid.uuid4().hex[:8]}"
    with open_store(ch_server.store_url("default")) as admin:
        admin._execute(f"CREATE DATABASE IF NOT EXISTS {db}")  # a database, without the project's tables
    url = ch_server.store_url(db)
    store = open_store(url)
    try:
        with pytest.raises(Exception) as e:
            store.window_stored(("job", 0, 0))
        assert missing_table(e.value) is not None, e.value
    finally:
        store.close()
    assert wait_windows(lambda: open_store(url), [("job", 0, 0)], 1.0, poll_s=0.2) == {("job", 0, 0)}
    said = capsys.readouterr().err
    assert "the store has no tables yet: waiting for `stragglerscope run` to create them" in said, said
    assert "Code: 60" not in said
    assert no_tables_yet(url, "windows_data").endswith("start `stragglerscope run` on it first (it creates them), "
                                                       "or the store URL is wrong")
