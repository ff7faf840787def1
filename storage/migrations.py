"""Forward migrations of the stored schema, applied in order by ``Store.setup()``.

The table ``schema_version`` holds one row per applied step (version,
description, when). ``migrate`` reads the highest version, applies every
later step of ``MIGRATIONS`` in order and records each, then reconciles:
any column the schema module has and a data table lacks is added (a field
added to ``core.schema`` reaches the tables without a hand-written step),
so is any table ``ddl.TABLES`` has and the store lacks, and the views
readers query are rebuilt from the columns the tables have.

Every step is idempotent (``CREATE ... IF NOT EXISTS``; a column is added
only if ``system.columns`` lacks it), so two processes that set up the same
store at once, or a step interrupted half-way, end in the same state. Steps
only add: no column is dropped or retyped, so old rows survive with the
type's default (0, '') in new columns.

To change the schema: append a ``Migration`` with the next version; list the
columns it adds in ``adds`` and the tables it creates in ``creates`` so that
version 1 (created from today's schema module) leaves them out and the step
adds them, exactly as on a store made before the change.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from storage import ddl
from storage.errors import StoreError


@dataclasses.dataclass(frozen=True)
class Migration:
    version: int
    description: str
    apply: Callable[["object"], None]
    adds: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (table, columns) this step adds
    creates: tuple[str, ...] = ()  # tables (ddl.TABLES names) this step creates


def _added_later(table: str, after: int) -> frozenset[str]:
    return frozenset(c for m in MIGRATIONS if m.version > after for t, cols in m.adds if t == table for c in cols)


def _v1_base_tables(store) -> None:
    later = {t for m in MIGRATIONS if m.version > 1 for t in m.creates}
    for spec in ddl.TABLES:
        if spec.name in later:
            continue
        store.run_ddl(store.create_table_sql(spec, exclude=_added_later(spec.name, 1)))


def _add_columns(store, table: str, names: tuple[str, ...]) -> None:
    spec = ddl.TABLE_BY_NAME[table]
    have = store.table_columns().get(spec.data, {})
    fields = {f.name: f for f in spec.fields}
    for name in names:
        if name in have:
            continue
        try:
            store.run_ddl(f"ALTER TABLE {ddl.quote(spec.data)} ADD COLUMN {ddl.column_sql(fields[name], store.caps)}")
        except StoreError:
            if name not in store.table_columns().get(spec.data, {}):  # not a concurrent setup() that won
                raise


def _v2_attribution(store) -> None:
    _add_columns(store, "windows", ("m_w", "m_s"))


def _v3_op_span_ttl(store) -> None:
    if store.caps.ttl:
        spec = ddl.TABLE_BY_NAME["op_spans"]
        store.run_ddl(f"ALTER TABLE {ddl.quote(spec.data)} MODIFY {ddl.ttl_clause(store.retention_days)}")
    # Engines without TTL: Store.enforce_retention drops old day partitions.


def _create_tables(*names: str) -> Callable[[object], None]:
    """A step that creates tables added to ``ddl.TABLES`` after version 1 (a no-op where they exist)."""
    def apply(store) -> None:
        for name in names:
            store.run_ddl(store.create_table_sql(ddl.TABLE_BY_NAME[name]))
    return apply


def _v5_accounting(store) -> None:
    _add_columns(store, "windows", ("mfu", "mfu_ideal"))
    _add_columns(store, "jobs", ("params", "seq_len", "num_layers"))
    _create_tables("downtime", "remedies")(store)


def _v6_control_step(store) -> None:
    _add_columns(store, "control_changes", ("from_step",))


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "base tables derived from ingest.schema", _v1_base_tables),
    Migration(2, "windows: M_W and M_S attribution columns", _v2_attribution, adds=(("windows", ("m_w", "m_s")),)),
    Migration(3, "op spans: retention by TTL where the engine has it", _v3_op_span_ttl),
    Migration(4, "alert acknowledgements", _create_tables("alert_acks"), creates=("alert_acks",)),
    Migration(5, "accounting and remedies: MFU per window, FLOPs facts per job, fault downtime, remedies",
              _v5_accounting, adds=(("windows", ("mfu", "mfu_ideal")), ("jobs", ("params", "seq_len", "num_layers"))),
              creates=("downtime", "remedies")),
    Migration(6, "run-time changes: the step a change starts from on every rank of its job", _v6_control_step,
              adds=(("control_changes", ("from_step",)),)),
)
LATEST = MIGRATIONS[-1].version


def migrate(store, target: int | None = None) -> list[int]:
    """Bring the store to ``target`` (default latest); returns the versions applied now."""
    target = LATEST if target is None else int(target)
    if not 1 <= target <= LATEST:
        raise StoreError(f"schema version {target} is unknown (1..{LATEST})")
    store.run_ddl(ddl.schema_version_sql())
    current = store.schema_version()
    if current > LATEST:
        raise StoreError(f"store schema version {current} is newer than this program ({LATEST}); upgrade it")
    applied = []
    for m in MIGRATIONS:
        if current < m.version <= target:
            m.apply(store)
            store.insert_bookkeeping(ddl.SCHEMA_VERSION_TABLE, _version_row(m))
            applied.append(m.version)
    changed = bool(applied)
    if target == LATEST:
        columns = store.table_columns()  # one catalogue read, not one per table (console start-up)
        absent = [spec for spec in ddl.TABLES if spec.data not in columns]
        for spec in absent:  # tables added to the schema module after this store's last step (link_cells was)
            store.run_ddl(store.create_table_sql(spec, retention_days=store.retention_days))
        if absent:
            changed = True
            columns = store.table_columns()
        for spec in ddl.TABLES:  # columns added to the schema module since the last step
            have = columns.get(spec.data, {})
            missing = tuple(f.name for f in spec.fields if f.name not in have)
            if missing:
                _add_columns(store, spec.name, missing)
                changed = True
    _ensure_views(store, rebuild=changed)
    return applied


def _version_row(m: Migration):
    import pyarrow as pa

    return pa.table({"version": pa.array([m.version], pa.uint32()), "description": [m.description],
                     "applied_ns": pa.array([time.time_ns()], pa.int64())})


def _ensure_views(store, rebuild: bool) -> None:
    import pyarrow as pa

    columns = store.table_columns()
    rebuild = store.prepare_reads(columns) or rebuild  # a cluster's Distributed tables, before the views
    names = store.table_names()
    for spec in ddl.TABLES:
        have = columns.get(spec.data, {})
        if not have:  # a table a later migration creates (store held at an older version)
            continue
        view_exists = spec.name in names
        if view_exists and not rebuild:
            continue
        present = pa.schema([f for f in spec.schema if f.name in have])
        view = dataclasses.replace(spec, schema=present)
        if view_exists:
            store.run_ddl(f"DROP TABLE IF EXISTS {ddl.quote(spec.name)}")
        store.run_ddl(ddl.view_sql(view, store.data_table(spec)))
