"""Topics checked at start, every partition read, lost broker data reported: the parts without a broker."""
import time

import pytest

from core.kafka_admin import BrokerError, check_partitions, offsets_ahead
from ray_jobs.errors import PipelineError
from ray_jobs.pipeline import shard_partitions
from ray_jobs.ray_connect import check_ray_reachable, ray_endpoint

INPUTS = ("ss.ops", "ss.ccl", "ss.jobs")


def test_fewer_partitions_than_configured_is_a_clear_error():
    with pytest.raises(BrokerError) as e:
        check_partitions({"ss.ops": 8, "ss.ccl": 3, "ss.jobs": 8}, INPUTS, 8)
    msg = str(e.value)
    assert "ss.ccl has 3 partitions, fewer than kafka.partitions = 8" in msg
    assert "--partitions 8" in msg and "kafka.partitions = 3" in msg  # how to fix it, both ways


def test_input_topics_must_share_one_count():
    with pytest.raises(BrokerError, match=r"different partition counts \(ss.ops 8, ss.ccl 12, ss.jobs 8\)"):
        check_partitions({"ss.ops": 8, "ss.ccl": 12, "ss.jobs": 8}, INPUTS, 8)
    with pytest.raises(BrokerError, match="input topic ss.jobs does not exist"):
        check_partitions({"ss.ops": 8, "ss.ccl": 8}, INPUTS, 8)


def test_more_partitions_than_configured_are_all_assigned():
    actual = check_partitions({t: 11 for t in INPUTS}, INPUTS, 8)
    assert actual == 11
    for shards in (1, 2, 3, 4, 11):
        owned = [shard_partitions(i, shards, actual) for i in range(shards)]
        flat = sorted(p for ps in owned for p in ps)
        assert flat == list(range(11)), "every partition is read, by exactly one shard"
        assert all(p % shards == i for i, ps in enumerate(owned) for p in ps)


def test_created_topics_get_the_configured_partitions_and_replication(monkeypatch):
    import core.kafka_admin as B

    monkeypatch.setattr(B, "KNOWN_ROUNDS", 1)  # one broker here: its first answer is the cluster's

    class Admin:
        created: list = []

        def describe_topics(self, topics):
            return [{"name": t, "error_code": 0, "partitions": [{}] * 4} for t in topics if t in
                    {n.name for n in self.created}] + [{"name": "ss.jobs", "error_code": 0, "partitions": [{}] * 4}]

        def create_topics(self, new):
            self.created.extend(new)

        def close(self):
            pass

    admin = Admin()
    monkeypatch.setattr(B, "_admin", lambda bootstrap, timeout_s: admin)
    counts = B.ensure_topics("h:9092", ["ss.ops", "ss.jobs"], 4, replication_factor=3)
    assert counts == {"ss.ops": 4, "ss.jobs": 4}
    assert [(n.name, n.num_partitions, n.replication_factor) for n in admin.created] == [("ss.ops", 4, 3)]


def test_offsets_beyond_the_end_are_found():
    stored = {("ss.ops", 0): 10, ("ss.ops", 1): 5, ("ss.ops", 2): 7, ("ss.ops", 3): 0}
    ends = {("ss.ops", 0): 10, ("ss.ops", 1): 2, ("ss.ops", 2): None, ("ss.ops", 3): None}
    assert offsets_ahead(stored, ends) == {("ss.ops", 1): (5, 2), ("ss.ops", 2): (7, 0)}


@pytest.mark.parametrize("address, want", [
    ("ray-head:6379", ("ray-head", 6379)), ("ray-head", ("ray-head", 6379)),
    ("ray://ray-head:10001", ("ray-head", 10001)), ("ray://ray-head", ("ray-head", 10001)),
    ("auto", None), ("[::1]:6379", ("::1", 6379)),
])
def test_ray_endpoint(address, want):
    assert ray_endpoint(address) == want


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_unreachable_ray_fails_fast_in_one_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=f"no Ray cluster reachable at 127.0.0.1:{port}"):
        check_ray_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 3
    with pytest.raises(PipelineError, match="bad ray.address"):
        ray_endpoint("host:port")


# -- KafkaSource with a stand-in consumer: what it does when partitions go away -------------------

class _KTP(tuple):
    def __new__(cls, topic, partition):
        return super().__new__(cls, (topic, partition))

    topic = property(lambda self: self[0])
    partition = property(lambda self: self[1])


class FakeConsumer:
    """The parts of kafka-python's KafkaConsumer the source uses; the broker's state is set by the test."""

    def __init__(self, partitions: dict[str, int], begin=0):
        self.partitions, self.begin = partitions, begin
        self.hw: dict = {}
        self.paused, self.seeks = set(), {}
        self.poll_error: Exception | None = None

    def partitions_for_topic(self, topic):
        return set(range(self.partitions.get(topic, 0)))

    def beginning_offsets(self, tps):
        for tp in tps:
            if tp.partition >= self.partitions.get(tp.topic, 0):
                raise KeyError(tp)  # what kafka-python does for a partition it has no metadata for
        return {tp: self.begin for tp in tps}

    def end_offsets(self, tps):
        return {tp: 0 for tp in tps}  # what Tansu may say (it undercounts): never a verdict

    def seek(self, tp, off):
        self.seeks[tp] = off

    def pause(self, *tps):
        self.paused.update(tps)

    def poll(self, timeout_ms):
        if self.poll_error is not None:
            raise self.poll_error
        return {}

    def highwater(self, tp):
        return self.hw.get(tp)

    def close(self):
        pass


def _source(consumer, partitions=range(4), topics=("ss.ops",), grace_s=0.0, clock=None):
    import time

    from ray_jobs.kafka_source import KafkaSource

    src = KafkaSource("127.0.0.1:1", topics, partitions, check_interval_s=0.0, lost_log_grace_s=grace_s,
                      clock=clock or time.monotonic)
    src._consumer, src._KTP = consumer, _KTP
    src._tps = [_KTP(t, p) for t in topics for p in partitions]
    return src


def test_a_vanished_partition_is_a_problem_not_a_keyerror():
    c = FakeConsumer({"ss.ops": 2})
    src = _source(c)
    src.seek({("ss.ops", 0): 3, ("ss.ops", 3): 9})
    # The partition that held records (position 9) first.
    assert src.problems == ["ss.ops[3]: the topic has only 2 partitions now",
                            "ss.ops[2]: the topic has only 2 partitions now"]
    assert c.paused == {_KTP("ss.ops", 2), _KTP("ss.ops", 3)}
    assert set(c.seeks) == set(src._tps), "every assigned partition has a position"
    assert src.positions()[("ss.ops", 3)] == 9, "the stored offset is kept, not reset"
    from kafka.errors import UnknownTopicOrPartitionError

    for err in (KeyError(_KTP("ss.ops", 3)), UnknownTopicOrPartitionError()):
        c.poll_error = err
        assert src.poll(10) == []
    c.poll_error = None
    assert src.lag() == 0
    c.partitions = {}  # the topic is gone
    src.lag()
    assert "ss.ops[0]: the topic does not exist on the broker any more" in src.problems


def test_an_end_behind_the_position_is_reported_once_and_paused(caplog):
    c = FakeConsumer({"ss.ops": 4})
    src = _source(c)
    src.seek({("ss.ops", p): 10 for p in range(4)})
    c.hw = {_KTP("ss.ops", 0): 12, _KTP("ss.ops", 1): 3, _KTP("ss.ops", 2): 10, _KTP("ss.ops", 3): 10}
    with caplog.at_level("WARNING"):
        assert src.lag() == 2
        assert src.lag() == 2
    assert src.problems == ["ss.ops[1]: its end 3 is behind the position 10: the broker lost records"]
    assert len([r for r in caplog.records if "not reading ss.ops[1]" in r.getMessage()]) == 1
    assert _KTP("ss.ops", 1) in c.paused


def test_an_end_behind_the_position_for_a_moment_is_a_failover_not_a_loss():
    """A real Kafka's new leader tells its high watermark late after a failover: the end falls behind the
    position read for a moment. Only an end that stays behind for the grace is a broker that lost records."""
    from kafka.errors import OffsetOutOfRangeError

    now = [0.0]
    c = FakeConsumer({"ss.ops": 2})
    src = _source(c, partitions=range(2), grace_s=15.0, clock=lambda: now[0])
    src.seek({("ss.ops", 0): 10, ("ss.ops", 1): 10})
    c.hw = {_KTP("ss.ops", 0): 8, _KTP("ss.ops", 1): 10}  # partition 0's new leader, behind by two
    for t in (0.0, 5.0, 14.9):
        now[0] = t
        assert src.lag() == 0 and src.problems == [] and not c.paused
    c.hw[_KTP("ss.ops", 0)] = 12  # it caught up
    now[0] = 16.0
    assert src.lag() == 2 and src.problems == []
    c.hw[_KTP("ss.ops", 0)] = 9  # behind again later: the grace starts again from here
    now[0] = 20.0
    assert src.lag() == 0 and src.problems == []
    now[0] = 35.0
    src.lag()
    assert src.problems == ["ss.ops[0]: its end 9 is behind the position 10: the broker lost records"]
    # A fetch refused as beyond the end is fetched again from the same position during the grace.
    c.poll_error = OffsetOutOfRangeError({_KTP("ss.ops", 1): 10})
    assert src.poll(10) == [] and c.seeks[_KTP("ss.ops", 1)] == 10 and len(src.problems) == 1
    now[0] = 51.0
    assert src.poll(10) == []
    assert src.problems[-1] == "ss.ops[1]: the position 10 is beyond its end: the broker lost records"


def test_out_of_range_beyond_the_end_is_a_problem_before_the_beginning_moves_on():
    from kafka.errors import OffsetOutOfRangeError

    c = FakeConsumer({"ss.ops": 2}, begin=5)
    src = _source(c, partitions=range(2))
    src.seek({("ss.ops", 0): 7, ("ss.ops", 1): 7})
    c.poll_error = OffsetOutOfRangeError({_KTP("ss.ops", 0): 7})
    assert src.poll(10) == []
    assert src.problems == ["ss.ops[0]: the position 7 is beyond its end: the broker lost records"]
    c.begin = 9  # retention removed records 7 and 8 of partition 1 before they were read
    c.poll_error = OffsetOutOfRangeError({_KTP("ss.ops", 1): 7})
    assert src.poll(10) == []
    assert c.seeks[_KTP("ss.ops", 1)] == 9 and src.positions()[("ss.ops", 1)] == 9
    assert len(src.problems) == 1


# -- replication settings of the topics stragglerscope creates -------------------------------------

def test_created_topics_carry_the_replication_settings(monkeypatch):
    """Tansu accepts min.insync.replicas but does not report it back, so what is sent is checked here."""
    import core.kafka_admin as ka

    monkeypatch.setattr(ka, "KNOWN_ROUNDS", 1)  # one broker here: its first answer is the cluster's

    created = []

    class Admin:
        def create_topics(self, new):
            created.extend(new)

        def close(self):
            pass

    monkeypatch.setattr(ka, "_admin", lambda bootstrap, timeout_s: Admin())
    monkeypatch.setattr(ka, "_describe", lambda admin, names: {t.name: t.num_partitions for t in created})
    ka.ensure_topics("127.0.0.1:1", ["a", "b"], 12, replication_factor=3, min_insync_replicas=2)
    assert [(t.name, t.num_partitions, t.replication_factor, t.topic_configs) for t in created] == [
        ("a", 12, 3, {"min.insync.replicas": "2"}), ("b", 12, 3, {"min.insync.replicas": "2"})]
    created.clear()
    ka.ensure_topics("127.0.0.1:1", ["c"], 4)  # 0: the broker's own default, nothing sent
    assert created[0].replication_factor == 1 and created[0].topic_configs == {}
    with pytest.raises(ka.BrokerError, match=r"min_insync_replicas \(3\) exceeds kafka.replication_factor \(2\)"):
        ka.ensure_topics("127.0.0.1:1", ["d"], 4, replication_factor=2, min_insync_replicas=3)


def test_after_a_data_loss_the_partitions_that_held_records_come_first_and_the_empty_ones_in_one_line():
    """Issue 50: after a broker lost its data the status was filled with empty partitions' lines and cut off
    (at 500 characters) before ss.ops and ss.jobs, the ones that held records."""
    c = FakeConsumer({"ss.ccl": 8, "ss.jobs": 8, "ss.ops": 8})
    src = _source(c, partitions=range(8), topics=("ss.ccl", "ss.jobs", "ss.ops"))
    src.seek({("ss.ops", 5): 40, ("ss.jobs", 5): 2})
    for t in ("ss.ccl", "ss.jobs", "ss.ops"):
        for p in range(8):
            src._problem((t, p), "its end 0 is behind the position: the broker lost records")
    lines = src.problems
    assert lines[:2] == ["ss.jobs[5]: its end 0 is behind the position: the broker lost records",
                         "ss.ops[5]: its end 0 is behind the position: the broker lost records"]
    assert lines[2].startswith("22 partitions that never held a record (ss.ccl[0], ss.ccl[1], ss.ccl[2], "
                               "ss.ccl[3], ...): its end 0"), lines
    assert len(lines) == 3
