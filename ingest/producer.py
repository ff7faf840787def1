"""The telemetry producer: Arrow IPC batches to Kafka, never in the training loop's way.

``TelemetryProducer.send(table)`` only encodes and enqueues; a background
thread owns the Kafka client and does the network I/O. The queue is bounded in
bytes: when it is full, the batch is dropped and counted rather than blocking
the caller (training must never wait for telemetry). ``send`` never raises for
transport problems; it raises only for programming errors (a table that is not
one of our record kinds).

Messages are keyed by job id so that every record of one job lands in the same
partition index of every topic (all input topics have the same partition
count), which is what makes shard actors partition-affine.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading

import pyarrow as pa

from ingest import schema as S

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ProducerStats:
    batches_sent: int = 0
    records_sent: int = 0
    bytes_sent: int = 0
    batches_dropped: int = 0
    records_dropped: int = 0
    send_errors: int = 0


def split_for_wire(table: pa.Table, max_bytes: int = S.MAX_MESSAGE_BYTES) -> list[bytes]:
    """Encode ``table`` as IPC payloads that each stay under ``max_bytes``.

    Row counts per chunk are estimated from a first encoding and halved until
    every payload fits, so a batch never exceeds the broker's message limit.
    """
    if table.num_rows == 0:
        return []
    payload = S.encode(table)
    if len(payload) <= max_bytes:
        return [payload]
    rows = max(1, int(table.num_rows * max_bytes / len(payload) * 0.9))
    out: list[bytes] = []
    start = 0
    while start < table.num_rows:
        chunk = table.slice(start, rows)
        p = S.encode(chunk)
        if len(p) > max_bytes and rows > 1:
            rows //= 2
            continue
        out.append(p)
        start += chunk.num_rows
    return out


class TelemetryProducer:
    """Non-blocking producer of our record kinds; a context manager.

    ``kafka_factory`` builds the client inside the sender thread (injected in
    unit tests); by default a ``kafka.KafkaProducer`` for ``bootstrap``.
    """

    def __init__(self, bootstrap: str, *, client_id: str = "stragglerscope", max_queue_bytes: int = 64 << 20,
                 kafka_factory=None, linger_ms: int = 20):
        self.bootstrap = bootstrap
        self.client_id = client_id
        self.max_queue_bytes = max_queue_bytes
        self.stats = ProducerStats()
        self._factory = kafka_factory or self._default_factory
        self._linger_ms = linger_ms
        self._q: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="ss-producer", daemon=True)
        self._thread.start()

    def _default_factory(self):
        from kafka import KafkaProducer

        return KafkaProducer(
            bootstrap_servers=self.bootstrap, client_id=self.client_id, acks=1, linger_ms=self._linger_ms,
            max_request_size=max(S.MAX_MESSAGE_BYTES + 65536, 1 << 20), retries=5,
        )

    def send(self, table: pa.Table, key: str | None = None) -> int:
        """Enqueue ``table`` (one of our input kinds); returns payloads queued (0 if dropped)."""
        kind = S.kind_of(table.schema)
        topic = S.TOPIC_OF_KIND.get(kind)
        if topic is None:
            raise ValueError(f"not an input record kind: {kind!r}")
        if table.num_rows == 0:
            return 0
        if key is None:
            key = table.column("job_id")[0].as_py()
        payloads = split_for_wire(table)
        size = sum(len(p) for p in payloads)
        with self._lock:
            if self._queued_bytes + size > self.max_queue_bytes:
                self.stats.batches_dropped += len(payloads)
                self.stats.records_dropped += table.num_rows
                return 0
            self._queued_bytes += size
            self._idle.clear()
        rows_each = table.num_rows / len(payloads)
        for p in payloads:
            self._q.put((topic, key.encode(), p, rows_each))
        return len(payloads)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until everything queued so far is acknowledged; True if it was."""
        self._q.put(("__flush__", None, None, 0))
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        self.flush(timeout_s)
        self._closed.set()
        self._q.put(None)
        self._thread.join(timeout_s)

    def __enter__(self) -> "TelemetryProducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sender thread ------------------------------------------------------
    def _run(self) -> None:
        client = None
        pending = []
        while True:
            item = self._q.get()
            if item is None:
                break
            topic, key, payload, rows = item
            if topic == "__flush__":
                self._drain(client, pending)
                pending = []
                if self._q.empty():
                    self._idle.set()
                continue
            if client is None:
                try:
                    client = self._factory()
                except Exception as e:  # broker down at start: count, drop, retry on next batch
                    log.warning("producer cannot connect: %s", e)
                    self._drop(len(payload), rows)
                    continue
            try:
                fut = client.send(topic, key=key, value=payload)
                pending.append((fut, len(payload), rows))
            except Exception as e:
                log.warning("producer send failed: %s", e)
                self.stats.send_errors += 1
                self._drop(len(payload), rows)
            if len(pending) >= 256:
                self._drain(client, pending)
                pending = []
        self._drain(client, pending)
        if client is not None:
            try:
                client.close(timeout=5)
            except Exception:
                pass
        self._idle.set()

    def _drain(self, client, pending) -> None:
        if client is not None and pending:
            try:
                client.flush(timeout=30)
            except Exception as e:
                log.warning("producer flush failed: %s", e)
        for fut, size, rows in pending:
            try:
                fut.get(timeout=30)
                self.stats.batches_sent += 1
                self.stats.records_sent += int(round(rows))
                self.stats.bytes_sent += size
                with self._lock:
                    self._queued_bytes -= size
            except Exception as e:
                self.stats.send_errors += 1
                log.warning("producer delivery failed: %s", e)
                self._drop(size, rows)

    def _drop(self, size: int, rows: float) -> None:
        with self._lock:
            self._queued_bytes -= size
        self.stats.batches_dropped += 1
        self.stats.records_dropped += int(round(rows))
