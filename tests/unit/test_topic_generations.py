"""Topic generations of the embedded broker (issue 23, item 3): names, which to create, which may go."""
import pytest

from core import topics
from core.config import ConfigError, load
from core.kafka_conn import KafkaConn
from services.topic_generations import LATE_WRITES_S, read_to_end, retirable, wanted_generations


def test_generation_names_round_trip_and_plain_topics_have_none():
    t = topics.generation_topic(topics.TOPIC_OPS, 2941)
    assert t == "ss.ops.g2941"
    assert topics.split_generation(t) == ("ss.ops", 2941)
    assert topics.family_of(t) == topics.TOPIC_OPS
    assert topics.split_generation("ss.ops") == ("ss.ops", None)
    assert topics.split_generation("ss.dead-letter") == ("ss.dead-letter", None)
    assert topics.split_generation("x.gx") == ("x.gx", None)


def test_topic_now_is_the_family_without_generations_and_the_clock_generation_with():
    assert topics.topic_now(topics.TOPIC_CCL, 0) == topics.TOPIC_CCL
    assert topics.topic_now(topics.TOPIC_CCL, 600, now_s=1_200_000) == "ss.ccl.g2000"
    assert topics.topic_now(topics.TOPIC_CCL, 600, now_s=1_200_599.9) == "ss.ccl.g2000"
    assert topics.topic_now(topics.TOPIC_CCL, 600, now_s=1_200_600) == "ss.ccl.g2001"


def test_the_current_and_next_generation_of_every_input_topic_are_wanted():
    got = wanted_generations(topics.INPUT_TOPICS, 10, 1005)
    assert got == [f"{f}.g100" for f in topics.INPUT_TOPICS] + [f"{f}.g101" for f in topics.INPUT_TOPICS]


def test_only_generations_past_their_end_by_the_late_writes_grace_may_go():
    existing = ["ss.ops.g97", "ss.ops.g98", "ss.ops.g99", "ss.ops.g100", "ss.ops", "ss.alerts",
                "other.g1", "ss.ccl.g3"]
    # 10-s generations, now 1005 s (generation 100): 99 ended 5 s ago, less than its grace (one period here)
    assert retirable(existing, 10, 1005) == ["ss.ccl.g3", "ss.ops.g97", "ss.ops.g98"]
    assert retirable(existing, 10, 1010) == ["ss.ccl.g3", "ss.ops.g97", "ss.ops.g98", "ss.ops.g99"]
    # 600-s generations: the grace is LATE_WRITES_S, not a whole period
    assert retirable(["ss.ops.g1"], 600, 1200 + LATE_WRITES_S - 1) == []
    assert retirable(["ss.ops.g1"], 600, 1200 + LATE_WRITES_S) == ["ss.ops.g1"]


def test_a_generation_goes_only_when_every_partition_is_read_to_its_exact_end():
    ends = {("t", 0): 5, ("t", 1): 0, ("t", 2): 7}
    assert read_to_end("t", 3, ends, {("t", 0): 5, ("t", 2): 7})  # empty partition 1 needs no offset
    assert not read_to_end("t", 3, ends, {("t", 0): 5, ("t", 2): 6})  # one record of partition 2 unread
    assert not read_to_end("t", 3, ends, {("t", 0): 5})
    assert not read_to_end("t", 4, ends, {("t", 0): 5, ("t", 2): 7})  # partition 3's end unknown


def test_stored_offsets_of_generations_belong_to_their_input_topic():
    from storage.store import filter_offsets

    rows = [{"topic": "ss.ops.g7", "partition": 0, "next_offset": 3},
            {"topic": "ss.ops", "partition": 1, "next_offset": 4},
            {"topic": "ss.ccl.g7", "partition": 0, "next_offset": 5}]
    assert filter_offsets(rows, [topics.TOPIC_OPS], None) == {("ss.ops.g7", 0): 3, ("ss.ops", 1): 4}


def test_the_setting_is_checked_and_a_configured_kafka_keeps_whole_topics():
    assert load(env={}).kafka.conn().topic_generation_s == 0  # -1 = automatic: resolved where the broker starts
    assert load(env={"STRAGGLERSCOPE_KAFKA_TOPIC_GENERATION_S": "30"}).kafka.conn().topic_generation_s == 30
    with pytest.raises(ConfigError, match="topic_generation_s"):
        load(env={"STRAGGLERSCOPE_KAFKA_TOPIC_GENERATION_S": "1"})


def test_the_generation_setting_travels_to_traced_ranks():
    conn = KafkaConn(bootstrap="127.0.0.1:9092", topic_generation_s=600)
    assert KafkaConn.from_json(conn.bootstrap, conn.to_json()).topic_generation_s == 600


def test_a_past_generation_is_one_whose_period_is_over():
    assert topics.past_generation("ss.ops.g99", 10, 1005)
    assert not topics.past_generation("ss.ops.g100", 10, 1005)
    assert not topics.past_generation("ss.ops", 10, 1005)  # a plain topic never is
    assert not topics.past_generation("ss.ops.g99", 0, 1005)  # nor anything without generations
