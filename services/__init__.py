"""The services stragglerscope starts for itself, each on 127.0.0.1: launchers only, no pipeline logic.

- ``broker``: ``LocalBroker``, the embedded Kafka-protocol broker (Tansu);
- ``topic_generations``: ``TopicGenerations``, which keeps the embedded broker's memory bounded (creates the
  next generation of the input topics, deletes the ones read to their end);
- ``clickhouse_server``: ``ClickHouseServer``, a loopback ClickHouse server for tests, demo, benchmarks,
  and ``ClickHouseCluster``, several of them as one cluster (shards, replicas);
- ``store_daemon``: ``StoreDaemon``, the store daemon (``python -m storage.daemon``) as a child process;
- ``ray_cluster``: ``LocalRayCluster``, a multi-node Ray whose nodes all listen on 127.0.0.1;
- ``zookeeper``: ``LocalZooKeeper``, for ``ClickHouseCluster``'s replicated shards;
- ``ports``: free loopback ports.
"""
