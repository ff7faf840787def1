"""ClickHouse tables derived from the record schemas of ``core.schema``.

One pure function, ``clickhouse_type``, maps an Arrow type to a ClickHouse
type; every table below is built from the Arrow fields of a schema (plus a few
storage-only columns), so a field added to the schema module becomes a column
here. ``arrow_type`` is the inverse used to read results of a server.

Layout (the same DDL on chDB 26.x and the Debian 18.16 server):

- Each stored kind has a data table ``<name>_data`` (MergeTree family,
  partitioned by UTC month of a nanosecond column, or by day where old data
  is dropped by retention, ordered by its natural key)
  and a view ``<name>`` that readers query: the view removes duplicates
  (``FINAL`` over a ReplacingMergeTree, or the latest row per key), so
  nothing a reader sees is counted twice.
- Every data table has ``stored_ns``: when the store wrote the row (wall
  clock, ns). It is the ReplacingMergeTree version and the partition column
  of tables without a time of their own.
- Modern-only features are applied only where ``Capabilities`` says the
  engine has them: ``LowCardinality`` (18.16 needs an experimental setting),
  ``TTL`` for op-span retention (18.16 has none: the store drops old
  partitions instead).
"""
from __future__ import annotations

import dataclasses
import re

import pyarrow as pa

from core import schema as S
from core.schema import ALERT_ACK, CONTROL_CHANGE, OFFSET_RESET, OFFSETS, OPTYPE_WASTE, SHARD_STATE

# --------------------------------------------------------------------------
# Engine capabilities
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What the connected ClickHouse supports, from ``SELECT version()``."""

    version: tuple[int, ...]
    embedded: bool = False

    @classmethod
    def from_version(cls, version: str, embedded: bool = False) -> "Capabilities":
        nums = tuple(int(x) for x in re.findall(r"\d+", version)[:4]) or (0,)
        return cls(nums, embedded)

    @property
    def low_cardinality(self) -> bool:
        """LowCardinality without ``allow_experimental_low_cardinality_type`` (19.x+)."""
        return self.version >= (19, 6)

    @property
    def ttl(self) -> bool:
        """Table TTL expressions (19.6+; we require 20.1 to stay clear of early bugs)."""
        return self.version >= (20, 1)

    @property
    def partition_local_final(self) -> bool:
        """``do_not_merge_across_partitions_select_final`` exists (20.11+)."""
        return self.version >= (20, 11)

    @property
    def skip_insert_merge(self) -> bool:
        """``optimize_on_insert`` exists (20.12+); before it, inserts did not collapse a block's duplicates."""
        return self.version >= (20, 12)

    def insert_settings(self) -> dict[str, int]:
        """Settings for our inserts.

        ``optimize_on_insert = 0``: a ReplacingMergeTree insert otherwise collapses duplicate keys inside
        the block, row by row, which made the engine's insert 3.7x slower (1M window rows: 3.7 s vs
        1.0 s on chDB). It would find nothing: ``Store.insert`` drops in-batch duplicates first, and
        reads deduplicate with FINAL anyway.
        """
        return {"optimize_on_insert": 0} if self.skip_insert_merge else {}

    @property
    def label(self) -> str:
        return ("chDB " if self.embedded else "server ") + ".".join(map(str, self.version))


MODERN = Capabilities((26, 1), embedded=True)
LEGACY = Capabilities((18, 16, 1))

# --------------------------------------------------------------------------
# Arrow <-> ClickHouse types
# --------------------------------------------------------------------------
_INTS = {
    pa.int8(): "Int8", pa.int16(): "Int16", pa.int32(): "Int32", pa.int64(): "Int64",
    pa.uint8(): "UInt8", pa.uint16(): "UInt16", pa.uint32(): "UInt32", pa.uint64(): "UInt64",
    pa.float32(): "Float32", pa.float64(): "Float64",
}


def clickhouse_type(
    typ: pa.DataType,
    *,
    nullable: bool = False,
    low_cardinality: bool = False,
    caps: Capabilities = MODERN,
) -> str:
    """The ClickHouse column type for an Arrow type.

    Pure and total over the types our schemas use; anything else raises
    TypeError naming the type. Booleans are ``UInt8`` (18.16 has no Bool, and
    both backends then return the same result types); binary is ``String``;
    ``low_cardinality`` wraps strings in ``LowCardinality`` where the engine
    supports it without a setting.
    """
    if typ in _INTS:
        inner = _INTS[typ]
    elif pa.types.is_boolean(typ):
        inner = "UInt8"
    elif pa.types.is_string(typ) or pa.types.is_large_string(typ):
        inner = "String"
    elif pa.types.is_binary(typ) or pa.types.is_large_binary(typ) or pa.types.is_fixed_size_binary(typ):
        inner = "String"
        low_cardinality = False
    elif pa.types.is_date32(typ) or pa.types.is_date64(typ):
        inner = "Date"
    elif pa.types.is_timestamp(typ):
        inner = "Int64"  # ns since the epoch, like every time in our schemas (18.16 has no DateTime64)
    elif pa.types.is_dictionary(typ):
        return clickhouse_type(typ.value_type, nullable=nullable, low_cardinality=True, caps=caps)
    elif pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        # ClickHouse arrays cannot be Nullable; their elements carry the nullability.
        return f"Array({clickhouse_type(typ.value_type, nullable=typ.value_field.nullable, caps=caps)})"
    else:
        raise TypeError(f"no ClickHouse type for Arrow type {typ}")
    if nullable:
        inner = f"Nullable({inner})"
    if low_cardinality and inner in ("String", "Nullable(String)") and caps.low_cardinality:
        inner = f"LowCardinality({inner})"
    return inner


_CH_TO_ARROW = {v: k for k, v in _INTS.items()}
_CH_TO_ARROW.update({"String": pa.string(), "Date": pa.date32(), "Date32": pa.date32(), "Bool": pa.bool_(),
                     "UUID": pa.string(), "IPv4": pa.string(), "IPv6": pa.string()})


def arrow_type(ch_type: str) -> pa.DataType:
    """The Arrow type that holds values of a ClickHouse result column (server results).

    Wrappers are unwrapped (``Nullable``, ``LowCardinality``), ``DateTime`` is
    seconds since the epoch as ``uint32`` (as chDB returns it), arrays become
    lists; unknown types (Decimal, Enum, Tuple, Map) are returned as strings.
    """
    t = ch_type.strip()
    m = re.fullmatch(r"(Nullable|LowCardinality)\((.*)\)", t)
    if m:
        return arrow_type(m.group(2))
    m = re.fullmatch(r"Array\((.*)\)", t)
    if m:
        return pa.list_(arrow_type(m.group(1)))
    if t.startswith("DateTime64"):
        return pa.int64()
    if t.startswith("DateTime"):
        return pa.uint32()
    if t.startswith("FixedString"):
        return pa.string()
    return _CH_TO_ARROW.get(t, pa.string())


def quote(name: str) -> str:
    """A backquoted identifier (``group`` and ``partition`` are keywords)."""
    return "`" + name.replace("`", "") + "`"


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------
STORED_NS = pa.field("stored_ns", pa.int64(), nullable=False,
                     metadata={"unit": "ns", "doc": "when the store wrote the row, wall clock"})

LOW_CARDINALITY = frozenset({
    "team", "model", "verdict", "optype", "kind", "rule", "severity", "gpu_type", "source_topic", "topic",
    "op", "group", "algorithm", "host", "device",
})

@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One stored table: its fields, natural key, partition column and duplicate rule.

    ``mode``: ``first`` - a row whose key is stored already is dropped at
    insert (a replay writes nothing) and the view reads ``FINAL``;
    ``latest`` - the view shows the latest row per key (``latest_by``, then
    ``stored_ns``); ``replace`` - ReplacingMergeTree and ``FINAL`` only (raw
    high-volume data).
    """

    name: str
    schema: pa.Schema
    key: tuple[str, ...]
    mode: str
    kind: str | None = None
    partition_ns: str = "stored_ns"
    latest_by: tuple[str, ...] = ()
    view_exprs: tuple[tuple[str, str], ...] = ()
    retention: bool = False

    @property
    def data(self) -> str:
        return f"{self.name}_data"

    @property
    def fields(self) -> list[pa.Field]:
        return list(self.schema) + [STORED_NS]

    @property
    def columns(self) -> list[str]:
        return [f.name for f in self.fields]


TABLES: tuple[TableSpec, ...] = (
    TableSpec("jobs", S.JOB, ("job_id", "attempt"), "latest", kind="job", latest_by=("ts_ns",)),
    TableSpec("windows", S.WINDOW, ("job_id", "attempt", "window_id"), "first", kind="window",
              partition_ns="analyzed_ns"),
    TableSpec("optype_slowdown", S.OPTYPE_SLOWDOWN, ("job_id", "attempt", "window_id", "step", "optype"), "first",
              kind="optype_slowdown"),
    TableSpec("worker_slowdown", S.WORKER_SLOWDOWN,
              ("job_id", "attempt", "window_id", "step", "dp_rank", "pp_rank"), "first", kind="worker_slowdown"),
    TableSpec("step_slowdown", S.STEP_SLOWDOWN, ("job_id", "attempt", "window_id", "step"), "first",
              kind="step_slowdown"),
    TableSpec("hangs", S.HANG, ("job_id", "attempt", "hang_id"), "first", kind="hang", partition_ns="hang_id"),
    TableSpec("link_faults", S.LINK_FAULT, ("job_id", "attempt", "window_id", "group", "kind", "src", "dst"),
              "first", kind="link_fault"),
    TableSpec("link_cells", S.LINK_CELL, ("job_id", "attempt", "window_id", "group", "src", "dst"), "first",
              kind="link_cell"),
    TableSpec("alerts", S.ALERT, ("alert_id",), "first", kind="alert", partition_ns="ts_ns"),
    TableSpec("dead_letters", S.DEAD_LETTER, ("source_topic", "source_partition", "source_offset", "reason"),
              "first", kind="dead_letter", partition_ns="ts_ns",
              view_exprs=(("payload", "hex(payload) AS payload_hex"),)),
    TableSpec("op_spans", S.OP_SPAN,
              ("job_id", "attempt", "window_id", "rank", "step", "optype", "seq_id", "mc", "mb_id"), "replace",
              kind="op_span", retention=True),
    TableSpec("optype_waste", OPTYPE_WASTE, ("job_id", "attempt", "window_id", "optype"), "first",
              kind="optype_waste", partition_ns="analyzed_ns"),
    TableSpec("offsets", OFFSETS, ("source_id", "topic", "partition"), "latest"),
    TableSpec("gpu_samples", S.GPU_SAMPLE, ("job_id", "attempt", "rank", "ts_ns"), "first", kind="gpu_sample",
              partition_ns="ts_ns", retention=True),
    TableSpec("port_counters", S.PORT_COUNTER, ("job_id", "attempt", "host", "device", "port", "ts_ns"), "first",
              kind="port_counter", partition_ns="ts_ns", retention=True),
    TableSpec("window_profiles", S.WINDOW_PROFILE, ("job_id", "attempt", "window_id", "dp_rank", "pp_rank", "optype"),
              "first", kind="window_profile", partition_ns="end_ns", retention=True),
    TableSpec("regressions", S.REGRESSION, ("job_id", "kind", "attempt", "window_id", "scope"), "first",
              kind="regression", partition_ns="found_ns"),
    TableSpec("rank_hosts", S.RANK_HOST, ("job_id", "attempt", "rank", "host"), "first", kind="rank_host",
              partition_ns="seen_ns"),
    TableSpec("lemon_hosts", S.LEMON_HOST, ("scored_ns", "host"), "first", kind="lemon_host",
              partition_ns="scored_ns"),
    TableSpec("offset_resets", OFFSET_RESET, ("source_id", "topic", "partition", "reset_ns"), "first",
              kind="offset_reset", partition_ns="reset_ns"),
    TableSpec("shard_state", SHARD_STATE, ("source_id", "shard"), "latest"),
    TableSpec("control_changes", CONTROL_CHANGE, ("change_id",), "first", kind="control_change",
              partition_ns="when_ns"),
    TableSpec("alert_acks", ALERT_ACK, ("alert_id",), "latest", kind="alert_ack", latest_by=("acked_ns",)),
    TableSpec("downtime", S.DOWNTIME, ("job_id", "attempt", "incident_id"), "first", kind="downtime",
              partition_ns="incident_id"),
    TableSpec("remedies", S.REMEDY, ("job_id", "attempt", "window_id", "advised_ns", "priority"), "first",
              kind="remedy", partition_ns="advised_ns"),
)
TABLE_BY_NAME = {t.name: t for t in TABLES}
TABLE_OF_KIND = {t.kind: t for t in TABLES if t.kind}
SCHEMA_VERSION_TABLE = "schema_version"


def day_expr(ns_column: str) -> str:
    """UTC day of a nanosecond column (both engines; 18.16 has no DateTime64)."""
    return f"toDate(toDateTime(intDiv({quote(ns_column)}, 1000000000), 'UTC'))"


def partition_expr(spec: "TableSpec") -> str:
    """UTC day for tables with retention (old days are dropped whole), else UTC month.

    A year of daily partitions left the windows table in 368 parts, and every
    fleet query paid for opening them: the console's Fleet queries took 1.1-1.2 s
    on 300,000 windows, 0.5 s with monthly partitions (the ClickHouse default
    advice). Duplicates never straddle partitions ("first" tables drop them at
    insert), so FINAL stays exact within each partition.
    """
    day = day_expr(spec.partition_ns)
    return day if spec.retention else f"toStartOfMonth({day})"


def column_sql(field: pa.Field, caps: Capabilities) -> str:
    typ = clickhouse_type(field.type, nullable=field.nullable, low_cardinality=field.name in LOW_CARDINALITY,
                          caps=caps)
    return f"{quote(field.name)} {typ}"


def create_table_sql(spec: TableSpec, caps: Capabilities, *, exclude: frozenset[str] = frozenset(),
                     retention_days: int | None = None, replicated_in: str | None = None) -> str:
    """``CREATE TABLE IF NOT EXISTS`` of a data table; ``exclude`` leaves out columns added by later migrations.

    ``replicated_in``: the database, for a replicated table on a cluster whose
    servers define the ``shard`` and ``replica`` macros; the replicas of a
    shard meet in ZooKeeper at ``/clickhouse/tables/{shard}/DATABASE/TABLE``.
    """
    cols = ",\n    ".join(column_sql(f, caps) for f in spec.fields if f.name not in exclude)
    engine = "ReplacingMergeTree(`stored_ns`)"
    if replicated_in:
        engine = (f"ReplicatedReplacingMergeTree('/clickhouse/tables/{{shard}}/{replicated_in}/{spec.data}', "
                  "'{replica}', `stored_ns`)")
    order = ", ".join(quote(k) for k in spec.key)
    sql = (f"CREATE TABLE IF NOT EXISTS {quote(spec.data)} (\n    {cols}\n) ENGINE = {engine}\n"
           f"PARTITION BY {partition_expr(spec)}\nORDER BY ({order})")
    if spec.retention and retention_days and caps.ttl:
        sql += "\n" + ttl_clause(retention_days)
    return sql


def ttl_clause(retention_days: int) -> str:
    return f"TTL toDateTime(intDiv(`stored_ns`, 1000000000)) + INTERVAL {int(retention_days)} DAY"


def view_sql(spec: TableSpec, source: str | None = None) -> str:
    """``CREATE VIEW IF NOT EXISTS`` of the deduplicating view readers query.

    ``source``: the table it reads, by default the data table; on a cluster
    the Distributed table over every shard's data table (``distributed_sql``).
    """
    exprs = dict(spec.view_exprs)
    cols = ", ".join(exprs.get(f.name, quote(f.name)) for f in spec.schema)
    if spec.mode == "latest":
        key = ", ".join(quote(k) for k in spec.key)
        order = ", ".join([key] + [f"{quote(c)} DESC" for c in spec.latest_by] + ["`stored_ns` DESC"])
        body = f"SELECT {cols} FROM {quote(source or spec.data)} ORDER BY {order} LIMIT 1 BY {key}"
    else:
        body = f"SELECT {cols} FROM {quote(source or spec.data)} FINAL"
    return f"CREATE VIEW IF NOT EXISTS {quote(spec.name)} AS {body}"


# --------------------------------------------------------------------------
# A ClickHouse cluster: every server holds its shard of each data table
# --------------------------------------------------------------------------
def distributed_name(spec: TableSpec) -> str:
    """The Distributed table in front of every shard's ``<name>_data``: writes and reads go through it."""
    return f"{spec.data}_all"


def shard_key(spec: TableSpec) -> str:
    """Which shard holds a row: by job where the key has one, else by the whole key.

    Every row of a key lands on one shard, so FINAL and LIMIT 1 BY, which run
    on each shard, still see every duplicate of a key together; by job, a
    job's drill-down reads one shard's rows of each table.
    """
    cols = ["job_id"] if "job_id" in spec.key else list(spec.key)
    return f"cityHash64({', '.join(quote(c) for c in cols)})"


def distributed_sql(spec: TableSpec, cluster: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` of the Distributed table over ``cluster``'s data tables (same columns)."""
    return (f"CREATE TABLE IF NOT EXISTS {quote(distributed_name(spec))} AS {quote(spec.data)} "
            f"ENGINE = Distributed({quote(cluster)}, currentDatabase(), {quote(spec.data)}, {shard_key(spec)})")


def schema_version_sql() -> str:
    return (f"CREATE TABLE IF NOT EXISTS {quote(SCHEMA_VERSION_TABLE)} "
            "(`version` UInt32, `description` String, `applied_ns` Int64) ENGINE = MergeTree ORDER BY `version`")


def storage_schema(spec: TableSpec) -> pa.Schema:
    """The Arrow schema of rows as inserted into the data table (booleans as uint8, plus stored_ns)."""
    fields = []
    for f in spec.fields:
        fields.append(f.with_type(pa.uint8()) if pa.types.is_boolean(f.type) else f)
    return pa.schema(fields)
