"""What the shard needs from its two transports, as small typed protocols, one per role.

The shard (``ray_jobs.shard.ShardWorker``) is given two objects: a reader of the
input partitions and a writer to the store. In production they are
``ray_jobs.kafka_source.KafkaSource`` and ``ray_jobs.result_writer.ResultWriter``
(over the store); unit tests pass in-memory ones (``tests/fakes.py``). Both
are created by a factory inside the shard's ``setup()``, never before: Ray
pickles the shard, and clients do not pickle.

Each object plays several roles, and each part of the shard holds it by the one
role it uses, so a reader sees at a glance what a part may do:

==================  ==========================================  ==============================
role                what for                                    used by
==================  ==========================================  ==============================
``RecordSource``    read the input in order, track positions    the shard loop, ``Checkpoint``
``LostLogs``        rewind partitions whose log the broker lost the shard loop
``Outbox``          dead letters and alerts back to the broker  the shard loop, ``AlertOutlet``
``ResultSink``      store result tables, exactly once           ``Checkpoint``, ``WindowReducer``
``OffsetStore``     the offsets those results cover             ``Checkpoint``, the shard's setup
``StateStore``      the reducers' state to resume from          ``StateKeeper``
``JobRegistry``     registrations stored before a restart       the shard's setup
``ControlFeed``     run-time changes (a third object)           the shard loop
==================  ==========================================  ==============================

Every member is called without probing: a transport implements every member of
each role it plays (a test checks the production and the fake ones).
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

    def close(self) -> None: ...


@runtime_checkable
class Backlog(Protocol):
    """Where the reading is behind: in a backlog the hang monitor judges a partition's jobs by what was read of
    that partition, not by the other partitions' newer records."""

    def unread(self) -> set[TopicPartition]:
        """The partitions with records not read yet, as of the last ``lag``."""

    def brokers(self) -> int:
        """Brokers the reader's metadata lists now (0: none known yet). A broker that stopped leaves it at
        the next metadata refresh and returns to it after it restarts: the status says which it is."""


@runtime_checkable
class LostLogs(Protocol):
    """Partitions whose log the broker lost (``kafka.on_lost_log = rewind``): found, rewound, audited."""

    def lost_logs(self) -> list[TopicPartition]:
        """Partitions whose log the broker lost, waiting to be rewound."""

    def rewind(self, tp: TopicPartition, by: str) -> int:
        """Read ``tp`` from its new log's start; returns that offset."""

    def take_resets(self) -> list[dict]:
        """The offset moves made since the last call, for the audit table."""


@runtime_checkable
class Outbox(Protocol):
    """What the shard publishes back to the broker."""

    def dead_letter(self, msg, reason: str) -> None:
        """Publish a copy of a refused message with its reason (the stored dead-letter row is the record)."""

    def alert_producer(self) -> Callable[[dict], None] | None:
        """A function that publishes an alert, or None where alerts are not published."""


@runtime_checkable
class ResultSink(Protocol):
    """Where result tables are stored: buffered, then stored together."""

    def setup(self) -> None: ...

    def write(self, kind: str, table: pa.Table) -> None:
        """Buffer a result table; nothing is stored before ``flush``."""

    def flush(self) -> None:
        """Store everything written; returns once stored, raises (and forgets the buffer) if not."""

    def window_stored(self, key) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class OffsetStore(Protocol):
    """The input offsets the stored results cover, with the log each counts in."""

    def load_offsets(self, source_id: str, topics: Iterable[str],
                     partitions: Iterable[int]) -> dict[TopicPartition, int]: ...

    def store_offsets(self, source_id: str, offsets: dict[TopicPartition, int],
                      log_ids: dict[TopicPartition, str] | None = None) -> None: ...

    def load_offset_logs(self, source_id: str, topics: Iterable[str],
                         partitions: Iterable[int]) -> dict[TopicPartition, str]: ...


@runtime_checkable
class StateStore(Protocol):
    """The shard's reducer state, one blob per shard, in a format the ``StateKeeper`` versions."""

    def store_state(self, source_id: str, shard: str, fmt: int, state: bytes) -> None: ...

    def load_state(self, source_id: str, shard: str) -> tuple[int, bytes] | None: ...


@runtime_checkable
class JobRegistry(Protocol):
    """Job registrations stored before (a restarted shard knows its jobs' layouts at once)."""

    def load_jobs(self) -> list[dict]: ...


@runtime_checkable
class ControlFeed(Protocol):
    """Run-time changes (``core.control`` records, bytes), from the control topic's start, in order. A third
    object beside the reader and the writer (``core.control_topic.ControlReader``): the control topic is
    read whole by every shard, not by partition."""

    def poll(self, timeout_ms: int) -> list: ...

    def close(self) -> None: ...


READER_ROLES = (RecordSource, Backlog, LostLogs, Outbox)
"""The roles of the object ``consumer_factory`` gives."""
WRITER_ROLES = (ResultSink, OffsetStore, StateStore, JobRegistry)
"""The roles of the object ``sink_factory`` gives."""
