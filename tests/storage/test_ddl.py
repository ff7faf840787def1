"""Unit tests of the Arrow -> ClickHouse mapping and the DDL built from the schema module (no engine)."""
from __future__ import annotations

import pyarrow as pa
import pytest

from core import schema as S
from storage import ddl
from storage.ddl import LEGACY, MODERN, Capabilities, arrow_type, clickhouse_type


@pytest.mark.parametrize("typ, kw, want", [
    (pa.int8(), {}, "Int8"),
    (pa.int16(), {}, "Int16"),
    (pa.int32(), {}, "Int32"),
    (pa.int64(), {}, "Int64"),
    (pa.uint8(), {}, "UInt8"),
    (pa.uint64(), {}, "UInt64"),
    (pa.float32(), {}, "Float32"),
    (pa.float64(), {}, "Float64"),
    (pa.bool_(), {}, "UInt8"),
    (pa.string(), {}, "String"),
    (pa.large_string(), {}, "String"),
    (pa.binary(), {}, "String"),
    (pa.date32(), {}, "Date"),
    (pa.timestamp("ns"), {}, "Int64"),
    (pa.list_(pa.int32()), {}, "Array(Nullable(Int32))"),
    (pa.list_(pa.field("x", pa.int64(), nullable=False)), {}, "Array(Int64)"),
    (pa.int64(), {"nullable": True}, "Nullable(Int64)"),
    (pa.string(), {"low_cardinality": True}, "LowCardinality(String)"),
    (pa.string(), {"low_cardinality": True, "caps": LEGACY}, "String"),
    (pa.string(), {"low_cardinality": True, "nullable": True}, "LowCardinality(Nullable(String))"),
    (pa.binary(), {"low_cardinality": True}, "String"),
    (pa.dictionary(pa.int32(), pa.string()), {}, "LowCardinality(String)"),
])
def test_clickhouse_type(typ, kw, want):
    assert clickhouse_type(typ, **kw) == want


def test_clickhouse_type_refuses_unknown_types():
    with pytest.raises(TypeError, match="no ClickHouse type"):
        clickhouse_type(pa.struct([("a", pa.int32())]))


@pytest.mark.parametrize("ch, want", [
    ("Int32", pa.int32()), ("UInt64", pa.uint64()), ("Float64", pa.float64()), ("String", pa.string()),
    ("Nullable(Float64)", pa.float64()), ("LowCardinality(String)", pa.string()), ("Date", pa.date32()),
    ("DateTime", pa.uint32()), ("DateTime('UTC')", pa.uint32()), ("Array(Int64)", pa.list_(pa.int64())),
    ("Decimal(10, 2)", pa.string()),
])
def test_arrow_type(ch, want):
    assert arrow_type(ch) == want


@pytest.mark.parametrize("version, embedded, lc, ttl, local_final", [
    ("18.16.1", False, False, False, False),
    ("20.3.5.21", False, True, True, False),
    ("24.8.1", False, True, True, True),
    ("26.9.2.1", True, True, True, True),
])
def test_capabilities_from_version(version, embedded, lc, ttl, local_final):
    caps = Capabilities.from_version(version, embedded)
    assert (caps.low_cardinality, caps.ttl, caps.partition_local_final) == (lc, ttl, local_final)


def test_insert_settings_only_where_the_engine_has_them():
    assert Capabilities.from_version("26.9.2.1", True).insert_settings() == {"optimize_on_insert": 0}
    assert Capabilities.from_version("20.12.1").insert_settings() == {"optimize_on_insert": 0}
    assert Capabilities.from_version("18.16.1").insert_settings() == {}  # unknown setting there: an error


def test_every_stored_kind_has_a_table():
    wanted = set(S.RESULT_SCHEMAS) | {"job", "op_span"}
    assert wanted <= set(ddl.TABLE_OF_KIND)


@pytest.mark.parametrize("spec", ddl.TABLES, ids=lambda s: s.name)
def test_table_columns_follow_the_schema(spec):
    sql = ddl.create_table_sql(spec, MODERN)
    for f in spec.schema:
        assert f"`{f.name}` " in sql
    assert "`stored_ns` Int64" in sql
    assert "ReplacingMergeTree(`stored_ns`)" in sql
    day = f"toDate(toDateTime(intDiv(`{spec.partition_ns}`, 1000000000), 'UTC'))"
    # Daily where retention drops whole days, monthly elsewhere (few parts for fleet scans).
    assert f"PARTITION BY {day if spec.retention else f'toStartOfMonth({day})'}\n" in sql
    assert all(k in spec.schema.names for k in spec.key)


def test_legacy_ddl_has_no_modern_only_features():
    for spec in ddl.TABLES:
        sql = ddl.create_table_sql(spec, LEGACY, retention_days=7)
        for word in ("LowCardinality", "TTL", "CODEC", "DateTime64", "Map(", "Bool"):
            assert word not in sql, (spec.name, word)


def test_op_span_ttl_only_where_supported():
    spec = ddl.TABLE_BY_NAME["op_spans"]
    assert "TTL toDateTime(intDiv(`stored_ns`, 1000000000)) + INTERVAL 7 DAY" in ddl.create_table_sql(
        spec, MODERN, retention_days=7)
    assert "LowCardinality(String)" in ddl.create_table_sql(spec, MODERN)


def test_windows_table_has_the_fleet_columns():
    cols = ddl.TABLE_BY_NAME["windows"].columns
    for c in ("slowdown", "waste_fraction", "step_time_sim", "step_time_ideal", "launch_slowdown", "gpu_hours",
              "wasted_gpu_hours", "verdict", "complete"):
        assert c in cols


def test_exclude_leaves_out_columns():
    sql = ddl.create_table_sql(ddl.TABLE_BY_NAME["windows"], MODERN, exclude=frozenset({"m_w"}))
    assert "`m_w`" not in sql and "`m_s`" in sql


def test_views():
    assert ddl.view_sql(ddl.TABLE_BY_NAME["windows"]).endswith("FROM `windows_data` FINAL")
    jobs = ddl.view_sql(ddl.TABLE_BY_NAME["jobs"])
    assert "ORDER BY `job_id`, `attempt`, `ts_ns` DESC, `stored_ns` DESC LIMIT 1 BY `job_id`, `attempt`" in jobs
    assert "hex(payload) AS payload_hex" in ddl.view_sql(ddl.TABLE_BY_NAME["dead_letters"])


def test_storage_schema_stores_booleans_as_uint8():
    schema = ddl.storage_schema(ddl.TABLE_BY_NAME["windows"])
    assert schema.field("complete").type == pa.uint8()
    assert schema.names[-1] == "stored_ns"
