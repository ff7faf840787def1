"""The producer never blocks or raises into the caller, and counts what it sent and dropped."""
import threading
import time

import pyarrow as pa
import pytest

from core import codec, topics
from core import schema as S
from core.layout import JobLayout
from generators.fleetgen import JobSpec, generate_window
from ingest.producer import TelemetryProducer


class _Future:
    def __init__(self, fail=False):
        self.fail = fail

    def get(self, timeout=None):
        if self.fail:
            raise RuntimeError("broker said no")
        return None


class FakeKafka:
    def __init__(self, fail=False, gate: threading.Event | None = None):
        self.sent = []
        self.fail = fail
        self.gate = gate

    def send(self, topic, key=None, value=None):
        if self.gate is not None:
            self.gate.wait(10)
        self.sent.append((topic, key, value))
        return _Future(self.fail)

    def flush(self, timeout=None):
        pass

    def close(self, timeout=None):
        pass


def _ops():
    return generate_window(JobSpec("j", JobLayout(2, 2), 4), 0, 2, 0)


def test_sends_to_the_topic_of_the_kind_keyed_by_job():
    kafka = FakeKafka()
    with TelemetryProducer("x", kafka_factory=lambda: kafka) as p:
        p.send(_ops())
        p.send(JobSpec("j", JobLayout(2, 2), 4).registration(0, 2))
    assert [(t, k) for t, k, _ in kafka.sent] == [(topics.TOPIC_OPS, b"j"), (topics.TOPIC_JOBS, b"j")]
    assert p.stats.records_sent == _ops().num_rows + 1
    assert p.stats.records_dropped == 0


def test_with_topic_generations_each_message_goes_to_the_generation_of_the_moment_it_is_sent():
    from core.kafka_conn import KafkaConn

    kafka = FakeKafka()
    before = topics.generation(time.time(), 600)
    with TelemetryProducer(KafkaConn("x", topic_generation_s=600), kafka_factory=lambda: kafka) as p:
        p.send(_ops())
    after = topics.generation(time.time(), 600)
    ((topic, key, _),) = kafka.sent
    family, gen = topics.split_generation(topic)
    assert family == topics.TOPIC_OPS and before <= gen <= after and key == b"j"


def test_a_new_client_per_topic_generation_after_the_last_one_delivered_everything():
    from core.kafka_conn import KafkaConn

    clients = []

    def factory():
        clients.append(FakeKafka())
        return clients[-1]

    now = [6000.0]
    with TelemetryProducer(KafkaConn("x", topic_generation_s=600), kafka_factory=factory, clock=lambda: now[0]) as p:
        p.send(_ops())
        assert p.flush(10)
        now[0] = 6600.0  # the next generation
        p.send(_ops())
        p.send(_ops())
    # kafka-python's client keeps asking for the metadata of every topic it wrote to, deleted ones too
    assert [len(c.sent) for c in clients] == [1, 2]
    (first,), (second, third) = [[t for t, _, _ in c.sent] for c in clients]
    assert (first, second, third) == ("ss.ops.g10", "ss.ops.g11", "ss.ops.g11")
    assert p.stats.records_sent == 3 * _ops().num_rows


def test_full_queue_drops_instead_of_blocking():
    gate = threading.Event()
    kafka = FakeKafka(gate=gate)
    t = _ops()
    size = t.nbytes  # the queue holds tables (encoding happens on the sender thread)
    p = TelemetryProducer("x", kafka_factory=lambda: kafka, max_queue_bytes=size * 2 + 10)
    t0 = time.perf_counter()
    queued = [p.send(t) for _ in range(10)]
    elapsed = time.perf_counter() - t0
    gate.set()
    p.close()
    assert queued.count(0) >= 7, "the bounded queue dropped the overflow"
    assert p.stats.records_dropped >= 7 * t.num_rows
    assert elapsed < 2.0, "send() returned without waiting for the broker"


def test_broker_down_never_raises_into_the_caller():
    def factory():
        raise ConnectionError("no broker")
    p = TelemetryProducer("x", kafka_factory=factory)
    assert p.send(_ops()) == 1
    p.close(5)
    assert p.stats.records_dropped == _ops().num_rows


def test_failed_delivery_is_counted():
    p = TelemetryProducer("x", kafka_factory=lambda: FakeKafka(fail=True))
    p.send(_ops())
    p.close(5)
    assert p.stats.send_errors == 1 and p.stats.records_sent == 0


def test_rejects_what_is_not_an_input_record():
    p = TelemetryProducer("x", kafka_factory=FakeKafka)
    with pytest.raises(ValueError, match="not an input record kind"):
        p.send(codec.empty(S.WINDOW))
    p.close(5)


class FlakyKafka(FakeKafka):
    """Fails every delivery while ``down`` is set."""

    def __init__(self):
        super().__init__()
        self.down = threading.Event()

    def send(self, topic, key=None, value=None):
        if self.down.is_set():
            return _Future(fail=True)
        return super().send(topic, key, value)


def _numbered(i):
    t = _ops()
    return t.slice(0, 1).set_column(t.schema.get_field_index("step"), "step", pa.array([i], pa.int64()))


def test_outage_spools_and_replays_oldest_first_without_loss(tmp_path):
    kafka = FlakyKafka()
    p = TelemetryProducer("x", kafka_factory=lambda: kafka, spool_dir=str(tmp_path / "spool"), retry_s=0.05)
    p.send(_numbered(0))
    assert p.flush(5)
    kafka.down.set()
    for i in range(1, 6):
        p.send(_numbered(i))
    assert p.flush(5)
    assert p.spooled == 5 and p.stats.records_dropped == 0
    kafka.down.clear()
    assert p.flush(5) and p.spooled == 0, "a flush replays the spool once the broker is back"
    p.send(_numbered(6))
    p.close(5)
    steps = [codec.decode(v)[1]["step"][0].as_py() for _, _, v in kafka.sent]
    assert steps == list(range(7)), "nothing lost, nothing twice, in order"
    assert p.stats.batches_replayed == 5


def test_spool_is_bounded_and_survives_restart(tmp_path):
    kafka = FlakyKafka()
    kafka.down.set()
    one = len(codec.encode(_numbered(0)))
    spool = str(tmp_path / "spool")
    p = TelemetryProducer("x", kafka_factory=lambda: kafka, spool_dir=spool, max_spool_bytes=3 * (one + 200),
                          retry_s=10)
    for i in range(6):
        p.send(_numbered(i))
    p.flush(5)
    assert p.spooled == 3 and p.stats.records_dropped == 3
    p.close(1)
    # A new producer (a restarted training process) replays what the old one spooled.
    kafka.down.clear()
    p2 = TelemetryProducer("x", kafka_factory=lambda: kafka, spool_dir=spool, retry_s=0.05)
    p2.close(5)
    assert [codec.decode(v)[1]["step"][0].as_py() for _, _, v in kafka.sent] == [0, 1, 2]


class _OpenFuture:
    """A send the client never settles (kafka-python's producer after it lost its producer id)."""
    is_done = False

    def get(self, timeout=None):
        threading.Event().wait(timeout or 0)  # as a real future: waits its timeout, then gives up
        raise TimeoutError(f"Timeout after waiting for {timeout} secs.")


class WedgedKafka(FakeKafka):
    def send(self, topic, key=None, value=None):
        self.sent.append((topic, key, value))
        return _OpenFuture()


class CountingKafka(FakeKafka):
    """The replacement: says when it has sent ``want`` messages."""

    def __init__(self, want):
        super().__init__()
        self.want, self.all_sent = want, threading.Event()

    def send(self, topic, key=None, value=None):
        fut = super().send(topic, key, value)
        if len(self.sent) >= self.want:
            self.all_sent.set()
        return fut


def _wedged_then(want):
    clients = [WedgedKafka()]
    replacement = CountingKafka(want)

    def factory():
        if clients[-1] is not replacement and clients[-1].sent:
            clients.append(replacement)
        return clients[-1]
    return clients, replacement, factory


def test_a_client_that_settles_nothing_is_waited_on_once_then_replaced(tmp_path, monkeypatch):
    import ingest.producer as P

    monkeypatch.setattr(P, "_WEDGE_MARGIN_S", 0.3)
    clients, replacement, factory = _wedged_then(8)
    with TelemetryProducer("x", kafka_factory=factory, spool_dir=str(tmp_path), delivery_timeout_s=0.5,
                           retry_s=0.1) as p:
        for _ in range(8):
            p.send(_ops())
        t0 = time.monotonic()
        assert p.flush(30)
        took = time.monotonic() - t0
        assert replacement.all_sent.wait(10), "the spool was never sent through a new client"
    # One bounded wait for all eight (0.8 s), not 0.8 s each; then a new client sends them from the spool.
    assert took < 3.0, f"flush took {took:.1f} s"
    assert p.stats.clients_replaced == 1 and len(clients) == 2
    assert len(replacement.sent) == 8 and p.stats.records_dropped == 0


def test_an_overdue_send_is_noticed_without_a_flush(tmp_path, monkeypatch):
    import ingest.producer as P

    monkeypatch.setattr(P, "_WEDGE_MARGIN_S", 0.2)
    clients, replacement, factory = _wedged_then(1)
    p = TelemetryProducer("x", kafka_factory=factory, spool_dir=str(tmp_path), delivery_timeout_s=0.3, retry_s=0.1)
    try:
        p.send(_ops())
        assert replacement.all_sent.wait(10), "the overdue send was never noticed"
        assert p.stats.clients_replaced == 1
    finally:
        p.close(10)
