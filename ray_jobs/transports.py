"""What the shard needs from its two transports, as typed protocols.

The shard (``ray_jobs.shard.ShardWorker``) reads records from a ``RecordSource``
and hands results to a ``ResultSink``. In production they are
``ray_jobs.kafka_source.KafkaSource`` and ``ray_jobs.result_writer.ResultWriter``
(over the store); unit tests pass in-memory ones (``tests/fakes.py``). Both
are created by a factory inside the shard's ``setup()``, never before: Ray
pickles the shard, and clients do not pickle.

Every member here is called by the shard, its ``Checkpoint`` or its
``StateKeeper``; a transport implements all of them (a test checks the
production and the fake ones against these lists), so the shard never probes
what a transport can do.
"""
from __future__ import annotations

from typing import Callable, Iterable, Protocol, runtime_checkable

import pyarrow as pa

TopicPartition = tuple[str, int]


@runtime_checkable
class RecordSource(Protocol):
    """The input partitions of one shard: read in order, positions tracked by the shard's progress."""

    problems: list[str]
    """Partitions not read as they should be, one line each (the shard's status shows them)."""

    def seek(self, stored: dict[TopicPartition, int], stored_logs: dict[TopicPartition, str] | None = None,
             by: str = "shard") -> None:
        """Connect (the first time) and position each partition at its stored offset; ``stored_logs`` names
        the log each offset counts in."""

    def poll(self, timeout_ms: int) -> list:
        """The next messages (``topic``, ``partition``, ``offset``, ``key``, ``value``), possibly none."""

    def advance(self, tp: TopicPartition, next_offset: int) -> None:
        """Everything before ``next_offset`` on ``tp`` was handled."""

    def positions(self) -> dict[TopicPartition, int]:
        """What ``advance`` was told: the offsets the shard may store once the results below them are stored."""

    def log_ids(self) -> dict[TopicPartition, str]:
        """The identity of the log each position counts in (stored with the offset)."""

    def lag(self) -> int: ...

    def lost_logs(self) -> list[TopicPartition]:
        """Partitions whose log the broker lost, waiting to be rewound (``kafka.on_lost_log = rewind``)."""

    def rewind(self, tp: TopicPartition, by: str) -> int:
        """Read ``tp`` from its new log's start; returns that offset."""

    def take_resets(self) -> list[dict]:
        """The offset moves made since the last call, for the audit table."""

    def dead_letter(self, msg, reason: str) -> None:
        """Publish a copy of a refused message with its reason (the stored dead-letter row is the record)."""

    def alert_producer(self) -> Callable[[dict], None] | None:
        """A function that publishes an alert, or None where alerts are not published."""

    def close(self) -> None: ...


@runtime_checkable
class ResultSink(Protocol):
    """Where results, offsets, registrations and shard state are stored."""

    def setup(self) -> None: ...

    def write(self, kind: str, table: pa.Table) -> None:
        """Buffer a result table; nothing is stored before ``flush``."""

    def flush(self) -> None:
        """Store everything written; returns once stored, raises (and forgets the buffer) if not."""

    def window_stored(self, key) -> bool: ...

    def load_offsets(self, source_id: str, topics: Iterable[str],
                     partitions: Iterable[int]) -> dict[TopicPartition, int]: ...

    def store_offsets(self, source_id: str, offsets: dict[TopicPartition, int],
                      log_ids: dict[TopicPartition, str] | None = None) -> None: ...

    def load_offset_logs(self, source_id: str, topics: Iterable[str],
                         partitions: Iterable[int]) -> dict[TopicPartition, str]: ...

    def store_state(self, source_id: str, shard: str, fmt: int, state: bytes) -> None: ...

    def load_state(self, source_id: str, shard: str) -> tuple[int, bytes] | None: ...

    def load_jobs(self) -> list[dict]: ...

    def close(self) -> None: ...
