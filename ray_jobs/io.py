"""The shard's adapters at the edges: the Kafka source and the result writer.

Both follow one small lifecycle (STYLE.md, 4): clients are created in
``setup()`` (never in ``__init__``: Ray pickles the shard before it runs),
then poll/write, then flush/commit, then close.

``KafkaSource`` assigns its partitions by hand and never uses a consumer
group: Tansu's group joins take seconds and can wedge (ARCHITECTURE.md), and
our offsets live in the store beside the results they cover, which is what
makes a crash replay exactly the records whose results were not stored.

``ResultWriter`` batches result tables per kind and writes them through the
storage API; ``flush()`` returns only once everything written is stored.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Iterable

import pyarrow as pa

from ingest import schema as S

log = logging.getLogger(__name__)

# A flush longer than this holds up the shard loop (hang checks included): it is logged per table.
SLOW_FLUSH_S = 1.0

TopicPartition = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class Message:
    """One Kafka record as the shard sees it (kafka-python's ConsumerRecord, trimmed)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


class KafkaSource:
    """Reads a fixed set of partitions of the input topics; tracks what was handled.

    ``seek(stored)`` positions each partition at its stored offset (or the
    beginning). ``advance(tp, next_offset)`` records that everything before
    ``next_offset`` was handled; ``positions()`` returns those, which the shard
    turns into committable offsets once results are stored.
    """

    def __init__(self, bootstrap: str, topics: Iterable[str], partitions: Iterable[int],
                 client_id: str = "stragglerscope-shard", max_poll_records: int = 500):
        self.bootstrap = bootstrap
        self.topics = tuple(topics)
        self.partitions = tuple(partitions)
        self.client_id = client_id
        self.max_poll_records = max_poll_records
        self._consumer = None
        self._producer = None
        self._positions: dict[TopicPartition, int] = {}
        self._end: dict[TopicPartition, int] = {}
        self._end_checked = 0.0

    def setup(self) -> None:
        from kafka import KafkaConsumer, TopicPartition as KTP

        self._KTP = KTP
        self._consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap, client_id=self.client_id, group_id=None,
            enable_auto_commit=False, auto_offset_reset="earliest",
            max_poll_records=self.max_poll_records, fetch_max_bytes=16 << 20,
            max_partition_fetch_bytes=4 << 20,
        )
        self._tps = [KTP(t, p) for t in self.topics for p in self.partitions]
        self._consumer.assign(self._tps)

    def seek(self, stored: dict[TopicPartition, int]) -> None:
        if self._consumer is None:
            self.setup()
        begin = self._consumer.beginning_offsets(self._tps)
        for ktp in self._tps:
            tp = (ktp.topic, ktp.partition)
            off = max(stored.get(tp, 0), begin.get(ktp, 0) or 0)
            self._consumer.seek(ktp, off)
            self._positions[tp] = off

    def poll(self, timeout_ms: int) -> list[Message]:
        got = self._consumer.poll(timeout_ms=timeout_ms)
        out = []
        for ktp, records in got.items():
            for r in records:
                out.append(Message(ktp.topic, ktp.partition, r.offset, r.key, r.value))
        # Registrations first: a window can then see its job's layout in the same batch.
        out.sort(key=lambda m: m.topic != S.TOPIC_JOBS)
        return out

    def advance(self, tp: TopicPartition, next_offset: int) -> None:
        if next_offset > self._positions.get(tp, -1):
            self._positions[tp] = next_offset

    def positions(self) -> dict[TopicPartition, int]:
        return dict(self._positions)

    def lag(self) -> int:
        """Records not yet handled, from the latest end offsets (refreshed every 2 s)."""
        now = time.monotonic()
        if now - self._end_checked > 2.0:
            self._end_checked = now
            try:
                ends = self._consumer.end_offsets(self._tps)
                self._end = {(k.topic, k.partition): v for k, v in ends.items()}
            except Exception as e:  # a lag figure is not worth failing the loop for
                log.debug("end_offsets failed: %s", e)
        return sum(max(0, end - self._positions.get(tp, 0)) for tp, end in self._end.items())

    def _producer_client(self):
        if self._producer is None:
            from kafka import KafkaProducer

            self._producer = KafkaProducer(bootstrap_servers=self.bootstrap, client_id=self.client_id + "-out",
                                           acks=1, linger_ms=5)
        return self._producer

    def dead_letter(self, msg: Message, reason: str) -> None:
        """Forward the rejected bytes to the dead-letter topic with the reason in a header."""
        try:
            self._producer_client().send(
                S.TOPIC_DEAD_LETTER, key=msg.key, value=msg.value,
                headers=[("reason", reason.encode()[:1000]), ("source", f"{msg.topic}/{msg.partition}/{msg.offset}".encode())],
            )
        except Exception as e:  # the store keeps the dead letter too; the topic copy is best effort
            log.warning("dead-letter publish failed: %s", e)

    def alert_producer(self):
        def publish(alert: dict) -> None:
            try:
                self._producer_client().send(S.TOPIC_ALERTS, key=alert["job_id"].encode(),
                                             value=json.dumps(alert).encode())
            except Exception as e:
                log.warning("alert publish failed: %s", e)
        return publish

    def close(self) -> None:
        for c in (self._consumer, self._producer):
            if c is not None:
                try:
                    c.close()
                except Exception:
                    pass
        self._consumer = self._producer = None


class ResultWriter:
    """Batches result tables per kind and writes them through ``storage``.

    ``write`` only buffers; ``flush`` writes every buffered kind (one insert
    each) and returns once the store has them. Offsets and job registrations
    go straight through: they are small and their order matters.
    """

    def __init__(self, store_url: str, store=None):
        self.store_url = store_url
        self._store = store
        self._buf: dict[str, list[pa.Table]] = {}

    def setup(self) -> None:
        if self._store is None:
            from storage import open_store

            self._store = open_store(self.store_url)
        self._store.setup()

    @property
    def store(self):
        return self._store

    def write(self, kind: str, table: pa.Table) -> None:
        if table.num_rows:
            self._buf.setdefault(kind, []).append(table)

    def flush(self) -> None:
        """Insert everything buffered. On failure the buffer is discarded and the error raised:
        the caller retries the whole window, and the store's idempotent keys absorb what was
        already inserted."""
        buf, self._buf = self._buf, {}
        # The window row goes last: once it is stored the window counts as done
        # (``window_stored``), so a crash mid-flush re-analyses the window.
        took = []
        for kind in sorted(buf, key=lambda k: k == "window_result"):
            tables = buf[kind]
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
            t0 = time.perf_counter()
            self._store.insert(kind, table)
            took.append((kind, table.num_rows, time.perf_counter() - t0))
        if sum(t for _, _, t in took) > SLOW_FLUSH_S:
            log.warning("slow store flush: %s", ", ".join(f"{k} {n} rows {t:.2f} s" for k, n, t in took))

    def window_stored(self, key) -> bool:
        return self._store.window_stored(key)

    def load_offsets(self, source_id: str, topics, partitions) -> dict[TopicPartition, int]:
        return self._store.load_offsets(source_id, topics, partitions)

    def store_offsets(self, source_id: str, offsets: dict[TopicPartition, int]) -> None:
        self._store.store_offsets(source_id, offsets)

    def load_jobs(self) -> list[dict]:
        return self._store.load_jobs()

    def close(self) -> None:
        self.flush()
        if self._store is not None:
            self._store.close()


def resolve_ready(inflight: list[tuple[Any, Any, float]], timeout_s: float):
    """Split in-flight analyses into (done, pending).

    Each entry is (handle, window, t0). A handle is either a Ray ObjectRef or
    an already computed result (the shard ran the analysis inline). Done
    entries come back as ((tables, error), window, t0); ``tables`` is None when
    the task failed for good.
    """
    refs = [h for h, _, _ in inflight if _is_ref(h)]
    ready_ids: set = set()
    if refs:
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ready_ids = {r.hex() for r in ready}
    done, pending = [], []
    for entry in inflight:
        h, win, t0 = entry
        if not _is_ref(h):
            done.append(((h, None), win, t0))
        elif h.hex() in ready_ids:
            import ray

            try:
                done.append(((ray.get(h), None), win, t0))
            except Exception as e:  # task died after its retries (killed worker, OOM)
                done.append(((None, f"{type(e).__name__}: {str(e)[:300]}"), win, t0))
        else:
            pending.append(entry)
    return done, pending


def _is_ref(h: Any) -> bool:
    return type(h).__name__ == "ObjectRef"
