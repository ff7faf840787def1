"""In-memory stand-ins for the shard's transports (unit tests only; integration tests use the real ones).

They implement ``ray_jobs.transports``' protocols, as the real ones do (``tests/unit/test_transports.py``)."""
from __future__ import annotations

import pyarrow as pa

from core import codec, topics
from core import schema as S
from ray_jobs.kafka_source import Message


class FakeSource:
    """A Kafka source over a list of messages; remembers dead letters and what it was asked to seek."""

    def __init__(self, messages: list[Message], batch: int = 3):
        self.messages = messages
        self.batch = batch
        self._pos: dict[tuple[str, int], int] = {}
        self._i = 0
        self.dead = []
        self.alerts = []
        self.problems: list[str] = []  # partitions not read, and why (KafkaSource.problems)

    def seek(self, stored, stored_logs=None, by="shard"):
        self._pos = dict(stored)
        # Replay from the smallest stored offset of each partition, as Kafka would.
        self._pending = [m for m in self.messages if m.offset >= stored.get((m.topic, m.partition), 0)]
        self._i = 0

    def poll(self, timeout_ms):
        out = self._pending[self._i:self._i + self.batch]
        self._i += len(out)
        return out

    def advance(self, tp, next_offset):
        self._pos[tp] = max(self._pos.get(tp, 0), next_offset)

    def positions(self):
        return dict(self._pos)

    def log_ids(self):
        return {}

    def lost_logs(self):
        return []  # a fake broker never loses its log

    def rewind(self, tp, by):
        raise AssertionError("rewind of a log that lost_logs never reported")

    def take_resets(self):
        return []

    def lag(self):
        return len(self._pending) - self._i

    def unread(self):
        return {(m.topic, m.partition) for m in self._pending[self._i:]}

    def brokers(self):
        return 1

    def dead_letter(self, msg, reason):
        self.dead.append((msg, reason))

    def alert_producer(self):
        return self.alerts.append

    def close(self):
        pass


class FakeSink:
    """The ResultWriter API over dicts; counts every insert so tests can see duplicates."""

    def __init__(self):
        self.rows: dict[str, list[dict]] = {}
        self.offsets: dict[str, dict] = {}
        self.logs: dict[str, dict] = {}
        self.states: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.flushes = 0
        self._buf: dict[str, list[pa.Table]] = {}

    def setup(self):
        pass

    def write(self, kind, table):
        self._buf.setdefault(kind, []).append(table)

    def flush(self):
        for kind, tables in self._buf.items():
            for t in tables:
                self.rows.setdefault(kind, []).extend(t.to_pylist())
        self._buf = {}
        self.flushes += 1

    def window_stored(self, key):
        return any((r["job_id"], r["attempt"], r["window_id"]) == tuple(key) for r in self.rows.get("window", []))

    def load_offsets(self, source_id, topics, partitions):
        return dict(self.offsets.get(source_id, {}))

    def store_offsets(self, source_id, offsets, log_ids=None):
        self.offsets.setdefault(source_id, {}).update(offsets)
        self.logs.setdefault(source_id, {}).update({tp: (log_ids or {}).get(tp, "") for tp in offsets})

    def load_offset_logs(self, source_id, topics, partitions):
        return dict(self.logs.get(source_id, {}))

    def store_state(self, source_id, shard, fmt, state):
        self.states[(source_id, shard)] = (fmt, bytes(state))

    def load_state(self, source_id, shard):
        return self.states.get((source_id, shard))

    def load_jobs(self):
        return list({(r["job_id"], r["attempt"]): r for r in self.rows.get("job", [])}.values())

    def close(self):
        pass


def messages_for(tables: list[pa.Table], partition: int = 0) -> list[Message]:
    """One message per table on the table's topic; offsets count per topic."""
    offsets: dict[str, int] = {}
    out = []
    for t in tables:
        topic = topics.TOPIC_OF_KIND[S.kind_of(t.schema)]
        off = offsets.get(topic, 0)
        offsets[topic] = off + 1
        out.append(Message(topic, partition, off, t.column("job_id")[0].as_py().encode(), codec.encode(t)))
    return out


class ManualClock:
    """The shard's ``Clock`` for unit tests: monotonic time is ``t``, set by the test.

    Wall time (the job clock) is ``wall`` when given (a function, for tests that
    pin it), else it moves with ``t`` from the moment the clock was made.
    """

    def __init__(self, t: float = 0.0, wall=None):
        import time

        self.t = t
        self.wall = wall
        self._wall0 = time.time_ns()

    def monotonic(self) -> float:
        return self.t

    def wall_ns(self) -> int:
        return self.wall() if self.wall is not None else self._wall0 + int(self.t * 1e9)


class FakeControls:
    """The control topic as the shard reads it: what the test appends, once."""

    def __init__(self):
        self.records: list[bytes] = []
        self.closed = False

    def poll(self, timeout_ms: int) -> list[bytes]:
        out, self.records = self.records, []
        return out

    def close(self) -> None:
        self.closed = True
