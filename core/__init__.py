"""The core every layer depends on, downward: records, their codec, layouts, op types, configuration.

- ``schema``: every record schema (input, result, storage-only), versions, kinds, units;
- ``codec``: Arrow IPC encode/decode, ``conform``, the validators, table builders;
- ``layout``: ``JobLayout`` and ``fold_ranks``; ``registration``: a job's registration row, typed;
- ``optypes``: op type names; ``topics``: Kafka topics and message limits;
- ``golden``: the golden-trace file format (parquet + meta YAML) read as op spans;
- ``jsonutil``: JSON for evidence columns; ``memory``: freed memory back to the OS;
- ``config``: the configuration file; ``kafka_conn`` and ``kafka_admin``: how to reach Kafka and
  check its topics; ``redact``: secrets out of every message; ``logs``: log formats.

The analyzers import only ``schema``, ``codec``, ``layout``, ``optypes``, ``jsonutil``,
``golden`` and ``memory`` (with numpy, pyarrow and pyyaml): nothing here that they import
pulls in Kafka, Ray, ClickHouse or Streamlit.
"""
