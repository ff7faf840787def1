"""The control topic on the wire: publish a checked change, read the changes back (``core.control``).

The topic has one partition (``core.kafka_admin.prepare_topics`` creates it with the pipeline's topics,
``publish`` where it is missing), so every reader sees every change in the order it was made. Readers
assign that partition and read it from its beginning, without a consumer group: a restarted exporter or
shard rebuilds what is in force from the records themselves, and nothing is kept anywhere else. The topic
is compacted (``cleanup.policy=compact``) and each record keyed by its scope and setting
(``core.control.records_of``), so what a reader reads from the start is bounded: one record per scope and
setting at most, once the broker has compacted it. Tansu, the embedded broker, takes the setting and reports no topic
configuration; readers never depend on compaction having run (the whole log and the compacted one give the
same settings).
"""
from __future__ import annotations

import logging

from core import topics
from core.control import ControlChange, ControlError, check, records_of
from core.kafka_conn import KafkaConn, as_conn

log = logging.getLogger(__name__)


def publish(bootstrap: KafkaConn | str, change: ControlChange, timeout_s: float = 15.0) -> None:
    """Send one change and wait until the broker has it (BrokerError when it cannot)."""
    from kafka import KafkaProducer
    from kafka.errors import KafkaError

    from core.kafka_admin import BrokerError, KeptClient, ensure_topics

    conn = as_conn(bootstrap)
    records = records_of(change)
    for _, part in records:
        check(part.to_json())  # what goes out is what every reader accepts
    ensure_topics(conn, [topics.TOPIC_CONTROL], 1, timeout_s, topic_configs=topics.CONTROL_TOPIC_CONFIGS)
    try:
        # linger: the parts of one change go out in one batch, so no other change lands between them
        producer = KafkaProducer(bootstrap_servers=conn.bootstrap, client_id="stragglerscope-control", acks="all",
                                 allow_auto_create_topics=False, kafka_client=KeptClient(KafkaProducer),
                                 linger_ms=50, max_in_flight_requests_per_connection=1,
                                 max_block_ms=int(timeout_s * 1000), **conn.client_options())
    except KafkaError as e:
        raise BrokerError(f"cannot reach Kafka at {conn.describe()}: {e}") from None
    try:
        sent = [producer.send(topics.TOPIC_CONTROL, key=key, value=part.to_json()) for key, part in records]
        for future in sent:
            future.get(timeout=timeout_s)
    except KafkaError as e:
        raise BrokerError(f"the change was not published to {topics.TOPIC_CONTROL} at {conn.describe()}: {e}") \
            from None
    finally:
        producer.close(timeout=5)


class ControlReader:
    """The control topic from its beginning, one ``poll`` at a time; each poll returns the records read since
    the last (bytes; ``core.control.check`` them). Created lazily: a missing topic is retried, not an error,
    since exporters may start before anyone made a change."""

    def __init__(self, bootstrap: KafkaConn | str, client_id: str = "stragglerscope-control-reader",
                 retry_s: float = 10.0):
        """``retry_s``: a missing topic or an unreachable broker is asked again at most this often (a shard
        polls every loop pass, and a metadata request may wait for seconds)."""
        self.conn = as_conn(bootstrap)
        self.client_id = client_id
        self.retry_s = retry_s
        self._consumer = None
        self._next_try = 0.0
        self.problem = ""

    def _connect(self) -> bool:
        from kafka import KafkaConsumer, TopicPartition
        from kafka.errors import KafkaError

        from core.kafka_admin import KeptClient

        try:
            consumer = KafkaConsumer(bootstrap_servers=self.conn.bootstrap, client_id=self.client_id, group_id=None,
                                     enable_auto_commit=False, auto_offset_reset="earliest",
                                     allow_auto_create_topics=False, kafka_client=KeptClient(KafkaConsumer),
                                     request_timeout_ms=10_000, **self.conn.client_options())
        except KafkaError as e:
            self.problem = f"cannot reach Kafka at {self.conn.describe()}: {e}"
            return False
        parts = consumer.partitions_for_topic(topics.TOPIC_CONTROL)
        if not parts:
            consumer.close()
            self.problem = f"no topic {topics.TOPIC_CONTROL} yet"
            return False
        tps = [TopicPartition(topics.TOPIC_CONTROL, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        self._consumer, self.problem = consumer, ""
        return True

    def poll(self, timeout_ms: int = 0) -> list[bytes]:
        """The records read since the last call (possibly none); never raises for the broker's sake."""
        from kafka.errors import KafkaError

        if self._consumer is None:
            import time

            if time.monotonic() < self._next_try:
                return []
            self._next_try = time.monotonic() + self.retry_s
            if not self._connect():
                return []
        try:
            got = self._consumer.poll(timeout_ms=timeout_ms)
        except KafkaError as e:
            self.problem = f"reading {topics.TOPIC_CONTROL}: {e}"
            return []
        return [m.value for part in sorted(got, key=lambda tp: tp.partition) for m in got[part]]

    def read_all(self, timeout_s: float = 10.0) -> list[bytes]:
        """Every record the topic holds now (for ``stragglerscope control status``): polls until the end."""
        import time

        from core.kafka_admin import end_offsets

        ends = end_offsets(self.conn, [(topics.TOPIC_CONTROL, 0)], timeout_s)
        end = ends.get((topics.TOPIC_CONTROL, 0))
        if not end:
            return []
        out: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out += self.poll(200)
            if self._consumer is not None and self._position() >= end:
                return out
        raise ControlError(f"read {len(out)} of the {end} records of {topics.TOPIC_CONTROL} in {timeout_s:g} s")

    def _position(self) -> int:
        from kafka import TopicPartition

        return self._consumer.position(TopicPartition(topics.TOPIC_CONTROL, 0))

    def close(self) -> None:
        if self._consumer is not None:
            try:
                self._consumer.close()
            except Exception as e:  # closing is best effort: the reader is done either way
                log.debug("control reader close: %s", e)
            self._consumer = None
