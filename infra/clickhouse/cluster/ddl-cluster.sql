-- The cluster pattern for one table; every table of storage/ddl.py follows it.
CREATE TABLE IF NOT EXISTS stragglerscope.windows_local ON CLUSTER stragglerscope
AS stragglerscope.windows  -- the single-node DDL, created first from storage/ddl.py
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/windows', '{replica}', stored_ns)
-- Monthly, as storage/ddl.py (partition_expr): daily only for tables whose retention drops whole days.
PARTITION BY toStartOfMonth(toDate(toDateTime(intDiv(analyzed_ns, 1000000000), 'UTC')))
ORDER BY (job_id, attempt, window_id);

CREATE TABLE IF NOT EXISTS stragglerscope.windows_all ON CLUSTER stragglerscope
AS stragglerscope.windows_local
ENGINE = Distributed(stragglerscope, stragglerscope, windows_local, cityHash64(job_id));
