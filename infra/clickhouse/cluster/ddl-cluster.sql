-- The cluster pattern for one table; every table of storage/ddl.py follows it.
CREATE TABLE IF NOT EXISTS stragglerscope.windows_local ON CLUSTER stragglerscope
AS stragglerscope.windows  -- the single-node DDL, created first from storage/ddl.py
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/windows', '{replica}', analyzed_ns)
PARTITION BY toYYYYMMDD(toDateTime(intDiv(end_ns, 1000000000)))
ORDER BY (job_id, attempt, window_id);

CREATE TABLE IF NOT EXISTS stragglerscope.windows_all ON CLUSTER stragglerscope
AS stragglerscope.windows_local
ENGINE = Distributed(stragglerscope, stragglerscope, windows_local, cityHash64(job_id));
