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
