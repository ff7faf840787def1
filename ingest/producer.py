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
import time
from typing import TYPE_CHECKING, Callable

import pyarrow as pa

from core import codec, topics
from core import schema as S
from ingest.spool import Spool

if TYPE_CHECKING:
    from core.kafka_conn import KafkaConn

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ProducerStats:
    batches_sent: int = 0
    records_sent: int = 0
    bytes_sent: int = 0
    batches_dropped: int = 0
    records_dropped: int = 0
    batches_spooled: int = 0
    records_spooled: int = 0
    batches_replayed: int = 0
    send_errors: int = 0
    clients_replaced: int = 0  # Kafka clients that stopped delivering (``TelemetryProducer._drain``)


def split_for_wire(table: pa.Table, max_bytes: int = topics.MAX_MESSAGE_BYTES) -> list[bytes]:
    """Encode ``table`` as IPC payloads that each stay under ``max_bytes``.

    Row counts per chunk are estimated from a first encoding and halved until
    every payload fits, so a batch never exceeds the broker's message limit.
    """
    if table.num_rows == 0:
        return []
    payload = codec.encode(table)
    if len(payload) <= max_bytes:
        return [payload]
    rows = max(1, int(table.num_rows * max_bytes / len(payload) * 0.9))
    out: list[bytes] = []
    start = 0
    while start < table.num_rows:
        chunk = table.slice(start, rows)
        p = codec.encode(chunk)
        if len(p) > max_bytes and rows > 1:
            rows //= 2
            continue
        out.append(p)
        start += chunk.num_rows
    return out


_WEDGE_MARGIN_S = 5.0  # past the client's delivery timeout, a send still open means the client stopped (_drain)
_SEQ_BLOCK = 4096  # sequence numbers reserved per table: more parts than any table splits into


class TelemetryProducer:
    """Non-blocking producer of our record kinds; a context manager.

    ``kafka_factory`` builds the client inside the sender thread (injected in
    unit tests); by default a ``kafka.KafkaProducer`` for ``bootstrap``.

    With ``spool_dir``, a message that cannot be delivered (broker down,
    delivery failed or timed out) is written to a bounded on-disk spool
    instead of being dropped; while the spool holds anything, new messages go
    behind it, and every ``retry_s`` the sender replays it oldest first. So a
    broker outage shorter than the spool's capacity loses nothing and keeps
    order. Without ``spool_dir`` undeliverable messages are dropped and counted.
    """

    def __init__(self, bootstrap: KafkaConn | str, *, client_id: str = "stragglerscope", max_queue_bytes: int = 64 << 20,
                 kafka_factory=None, linger_ms: int = 20, spool_dir: str | None = None,
                 max_spool_bytes: int = 256 << 20, retry_s: float = 2.0, delivery_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.time):
        from core.kafka_conn import as_conn

        self.conn = as_conn(bootstrap)
        self.bootstrap = self.conn.bootstrap
        self.client_id = client_id
        self.max_queue_bytes = max_queue_bytes
        self.stats = ProducerStats()
        self._factory = kafka_factory or self._default_factory
        self._linger_ms = linger_ms
        self._delivery_timeout_s = delivery_timeout_s
        self._retry_s = retry_s
        self._spool = Spool(spool_dir, max_spool_bytes) if spool_dir else None
        self._last_warn, self._failed_since_warn = float("-inf"), 0
        self._q: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._client = None
        self._client_generation: int | None = None
        self._clock = clock  # wall clock: it picks the topic generation
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="ss-producer", daemon=True)
        self._thread.start()

    def _default_factory(self):
        from kafka import KafkaProducer

        from core.kafka_admin import KeptClient

        timeout_ms = int(self._delivery_timeout_s * 1000)
        # Idempotent: the broker drops a batch the client retries after a lost acknowledgement.
        # No auto-created topics: one the broker made up (its default partition count) would hide that
        # the real one is missing; until it is created, sends fail and are spooled (or dropped).
        client = KafkaProducer(
            bootstrap_servers=self.bootstrap, client_id=self.client_id, acks="all", enable_idempotence=True,
            linger_ms=self._linger_ms,
            max_request_size=max(topics.MAX_MESSAGE_BYTES + 65536, 1 << 20), retries=3,
            request_timeout_ms=min(timeout_ms, 5000), delivery_timeout_ms=max(timeout_ms, 5000 + self._linger_ms),
            max_block_ms=5000, allow_auto_create_topics=False, kafka_client=KeptClient(KafkaProducer),
            **self.conn.client_options(),
        )
        return client

    @property
    def spooled(self) -> int:
        """Messages waiting in the spool."""
        return len(self._spool) if self._spool is not None else 0

    def send(self, table: pa.Table, key: str | None = None) -> int:
        """Enqueue ``table`` (one of our input kinds); returns 1 if queued, 0 if dropped (queue full).

        Never blocks on the network and never raises for transport problems.
        """
        kind = S.kind_of(table.schema)
        topic = topics.TOPIC_OF_KIND.get(kind)
        if topic is None:
            raise ValueError(f"not an input record kind: {kind!r}")
        if table.num_rows == 0:
            return 0
        if key is None:
            key = table.column("job_id")[0].as_py()
        # Encoding (Arrow IPC + zstd, about half a millisecond per step's batch) happens on
        # the sender thread, not here: the caller is the training loop. The queue bound
        # counts the tables' in-memory bytes, which is what the queue holds.
        size = table.nbytes
        with self._lock:
            if self._queued_bytes + size > self.max_queue_bytes:
                self.stats.batches_dropped += 1
                self.stats.records_dropped += table.num_rows
                return 0
            self._queued_bytes += size
        self._q.put((topic, key.encode(), table, size, self._next_seq(block=_SEQ_BLOCK)))
        return 1

    def _next_seq(self, block: int = 1) -> int:
        """Increasing message numbers that keep increasing across restarts (spool file order).

        ``block`` numbers are reserved: the payloads a table is split into take
        ``seq``, ``seq + 1``, ... so they stay in order with the tables around it.
        """
        with self._lock:
            seq = max(self._seq + 1, time.time_ns())
            self._seq = seq + block - 1
            return seq

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until everything queued so far is acknowledged or spooled, and the spool was tried once;
        True if it was."""
        # Each flush waits on its own event, set when the sender reaches it: a shared "idle" flag
        # let a flush return at once, set by the end of an earlier flush before this one was seen.
        done = threading.Event()
        if not self._thread.is_alive():
            return self._q.empty()
        self._q.put(("__flush__", None, done, 0, 0))
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        self.flush(timeout_s)
        self._q.put(None)
        self._thread.join(timeout_s)

    def __enter__(self) -> "TelemetryProducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sender thread ------------------------------------------------------
    def _run(self) -> None:
        pending: list = []
        while True:
            waiting = bool(self.spooled or pending)
            try:
                item = self._q.get(timeout=min(self._retry_s, 0.2) if waiting else None)
            except queue.Empty:
                item = ()
            pending = self._reap(pending)
            if item == ():  # a tick: retry the spool once the in-flight sends are settled
                if not pending:
                    self._replay()
                continue
            if item is None:
                break
            topic, key, table, size, seq0 = item
            if topic == "__flush__":
                self._drain(pending)
                pending = []
                self._replay()
                table.set()  # the flush's own event
                continue
            with self._lock:
                self._queued_bytes -= size
            try:
                payloads = split_for_wire(table)
            except Exception as e:  # never into the training loop: count it as dropped
                log.warning("producer could not encode a %s batch: %s", topic, e)
                self.stats.batches_dropped += 1
                self.stats.records_dropped += table.num_rows
                continue
            rows = table.num_rows / len(payloads)
            if self._generation_ended():
                self._drain(pending)  # settled before the client that sent them goes
                pending = []
                self._reset_client()
            for part, payload in enumerate(payloads[:_SEQ_BLOCK]):
                seq = seq0 + part
                if self.spooled:  # keep order: behind what is already waiting
                    self._spool_or_drop(topic, key, payload, rows, seq)
                    continue
                fut = self._try_send(topic, key, payload)
                if fut is None:
                    self._spool_or_drop(topic, key, payload, rows, seq)
                else:
                    pending.append((fut, topic, key, payload, rows, seq, time.monotonic()))
            if len(pending) >= 256:
                self._drain(pending)
                pending = []
        self._drain(pending)
        self._replay()
        if self._client is not None:
            try:
                self._client.close(timeout=5)
            except Exception:
                pass

    def _reap(self, pending: list) -> list:
        """Settle the sends that finished, in order: count the delivered, spool the failed.

        Stops at the first send still in flight, so nothing in flight is ever spooled
        (it could still succeed, and its replay would then be a duplicate).
        """
        for i, (fut, topic, key, payload, rows, seq, sent_at) in enumerate(pending):
            if not getattr(fut, "is_done", True):
                if time.monotonic() - sent_at > self._delivery_timeout_s + _WEDGE_MARGIN_S:
                    self._drain(pending[i:])  # overdue: the client may have stopped (no flush may come soon)
                    return []
                return pending[i:]
            try:
                fut.get(timeout=0)
                self._count_sent(len(payload), rows)
            except Exception as e:
                self._warn_failed(e)
                self.stats.send_errors += 1
                self._spool_or_drop(topic, key, payload, rows, seq)
        return []

    def _warn_failed(self, e: Exception) -> None:
        """One warning per outage and then one per 30 s with the count, not one per batch."""
        now = time.monotonic()
        self._failed_since_warn += 1
        if now - self._last_warn >= 30.0:
            more = f" ({self._failed_since_warn - 1} more since the last warning)" if self._failed_since_warn > 1 else ""
            log.warning("producer delivery failed: %s%s; spooling" if self._spool is not None else
                        "producer delivery failed: %s%s; dropping", e, more)
            self._last_warn, self._failed_since_warn = now, 0

    def _generation_ended(self) -> bool:
        """Whether the client wrote to a topic generation that is over (core.topics); remembers the current one.

        kafka-python's producer asks for the metadata of every topic it ever wrote to, and logs an error
        for each one that is gone: once old generations are deleted, a training job's log would fill with
        them. So a new client is made per generation (a connection every ``topic_generation_s``).
        """
        if not self.conn.topic_generation_s:
            return False
        gen = topics.generation(self._clock(), self.conn.topic_generation_s)
        ended = self._client is not None and self._client_generation not in (None, gen)
        if self._client is None or ended:
            self._client_generation = gen
        return ended

    def _reset_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close(timeout=0)
            except Exception:
                # kafka-python's close flushes first and raises when batches are still incomplete, before it
                # stops its I/O thread: that thread and its connections would outlive the client. Stop it.
                sender = getattr(client, "_sender", None)
                if sender is not None:
                    try:
                        sender.force_close()  # fails what it still holds; those are spooled already
                    except Exception:
                        pass

    def _connect(self):
        if self._client is None:
            try:
                self._client = self._factory()
            except Exception as e:  # broker down: the caller spools or drops
                from core.redact import redact

                log.warning("producer cannot connect to %s: %s", redact(self.bootstrap), redact(e))
                return None
        return self._client

    def _try_send(self, topic, key, payload):
        client = self._connect()
        if client is None:
            return None
        try:
            # The queue and the spool hold the input topic; the generation is the one of the moment the
            # message leaves (core.topics), so a message spooled through an outage goes to a live one.
            return client.send(topics.topic_now(topic, self.conn.topic_generation_s, self._clock()),
                               key=key, value=payload)
        except Exception as e:
            log.warning("producer send failed: %s", e)
            self.stats.send_errors += 1
            return None

    def _drain(self, pending) -> None:
        """Wait for the acknowledgements of ``pending``; failures are spooled or dropped.

        The wait is bounded as a whole, not per send: the client settles every send within its delivery
        timeout (delivered, failed or expired), so one still open ``_WEDGE_MARGIN_S`` after that means the
        client stopped working. kafka-python 3.0.12's idempotent producer does: when a batch it had retried
        expires (a leader killed with kill -9, the brokers left holding acks=all writes for the dead
        follower), it forgets its producer id and never asks for a new one, and sends nothing more; waited
        on per send, 8 batches held a flush 120 s. Such a client is replaced by a new one (a new producer
        id) and what it held goes to the spool: sent again, perhaps twice, which the analysis drops (exact
        duplicate ops), rather than never.
        """
        deadline = time.monotonic() + self._delivery_timeout_s + _WEDGE_MARGIN_S
        if self._client is not None and pending:
            try:
                self._client.flush(timeout=self._delivery_timeout_s + _WEDGE_MARGIN_S)
            except Exception as e:
                log.warning("producer flush failed: %s", e)
        wedged = 0
        for fut, topic, key, payload, rows, seq, _ in pending:
            try:
                fut.get(timeout=max(0.0, deadline - time.monotonic()))
                self._count_sent(len(payload), rows)
            except Exception as e:
                wedged += not getattr(fut, "is_done", True)
                self.stats.send_errors += 1
                self._warn_failed(e)
                self._spool_or_drop(topic, key, payload, rows, seq)
        if wedged and self._client is not None:
            log.warning("the Kafka client settled none of %d sends within its delivery timeout (%.0f s) and "
                        "%.0f s more: replaced by a new one; what it held is in the spool and is sent again",
                        wedged, self._delivery_timeout_s, _WEDGE_MARGIN_S)
            self.stats.clients_replaced += 1
            self._reset_client()

    def _replay(self) -> None:
        """Send the spool oldest first; stop at the first failure (the broker is still away)."""
        if not self.spooled:
            return
        if self._generation_ended():  # nothing is in flight here
            self._reset_client()
        while True:
            batch = self._spool.oldest(64)
            if not batch:
                return
            for path, topic, key, payload, rows in batch:
                fut = self._try_send(topic, key, payload)
                try:
                    if fut is None:
                        raise ConnectionError("no connection")
                    fut.get(timeout=self._delivery_timeout_s + 5)
                except Exception as e:
                    log.info("spool replay paused: %s", e)
                    # A restarted broker does not know this client's producer id: start afresh.
                    self._reset_client()
                    return
                self._spool.remove(path)
                self.stats.batches_replayed += 1
                self._count_sent(len(payload), rows)

    def _count_sent(self, size: int, rows: float) -> None:
        self.stats.batches_sent += 1
        self.stats.records_sent += int(round(rows))
        self.stats.bytes_sent += size

    def _spool_or_drop(self, topic, key, payload, rows, seq) -> None:
        if self._spool is not None and self._spool.put(topic, key, payload, rows, seq):
            self.stats.batches_spooled += 1
            self.stats.records_spooled += int(round(rows))
            return
        self.stats.batches_dropped += 1
        self.stats.records_dropped += int(round(rows))
