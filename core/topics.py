"""Kafka topic names, which record kind goes to which, and the message size limit."""
from __future__ import annotations

import time

TOPIC_OPS = "ss.ops"
TOPIC_CCL = "ss.ccl"
TOPIC_HEARTBEATS = "ss.heartbeats"
TOPIC_JOBS = "ss.jobs"
TOPIC_CHECKPOINTS = "ss.checkpoints"
TOPIC_DEAD_LETTER = "ss.dead-letter"
TOPIC_ALERTS = "ss.alerts"
TOPIC_CONTROL = "ss.control"
"""Run-time changes of sampling and thresholds (core/control.py): one partition, so every reader sees them in
the order they were made; read whole by every exporter and shard, never split by job."""
CONTROL_TOPIC_CONFIGS = {"cleanup.policy": "compact"}
"""The control topic's configuration: compaction keeps the newest record of each key (a scope and a setting,
``core.control.records_of``), which is all a reader needs to rebuild what is in force."""
INPUT_TOPICS = (TOPIC_JOBS, TOPIC_OPS, TOPIC_CCL, TOPIC_HEARTBEATS, TOPIC_CHECKPOINTS)

MAX_MESSAGE_BYTES = 900_000
"""One Arrow IPC batch per Kafka message stays under Kafka's 1 MB default."""

TOPIC_OF_KIND = {
    "op_span": TOPIC_OPS,
    "ccl_record": TOPIC_CCL,
    "tcp_flow": TOPIC_CCL,  # travels with the collectives it explains, so a window waits for both
    "heartbeat": TOPIC_HEARTBEATS,
    "port_counter": TOPIC_HEARTBEATS,  # sampled with the heartbeats, read by the same shard loop at their pace
    "job": TOPIC_JOBS,
    "checkpoint": TOPIC_CHECKPOINTS,
}


# Topic generations: the embedded broker (Tansu's memory engine) keeps every record in memory and
# honours neither retention nor DeleteRecords, but deleting a topic frees its records (220 MB back to
# 16 MB, measured). So where ``kafka.topic_generation_s`` is set, each input topic is a family of
# generations, "ss.ops.g<n>" with n = unix time // generation_s. A producer picks the generation of the
# moment it sends (wall clock, no coordination); consumers read every generation the broker has;
# ``services.topic_generations`` creates the next one ahead of time and deletes a generation once its
# period is over and the stored offsets of every shard are at its end.
GENERATION_MARK = ".g"


def generation(now_s: float, generation_s: float) -> int:
    """The generation number of the wall-clock time ``now_s``."""
    return int(now_s // generation_s)


def generation_topic(family: str, gen: int) -> str:
    return f"{family}{GENERATION_MARK}{gen}"


def topic_now(family: str, generation_s: float, now_s: float | None = None) -> str:
    """The topic a record of ``family`` goes to now: the family itself, or its current generation."""
    if not generation_s:
        return family
    return generation_topic(family, generation(time.time() if now_s is None else now_s, generation_s))


def split_generation(topic: str) -> tuple[str, int | None]:
    """(family, generation) of a topic name; (topic, None) for a topic without a generation."""
    family, mark, gen = topic.rpartition(GENERATION_MARK)
    if mark and gen.isdigit():
        return family, int(gen)
    return topic, None


def family_of(topic: str) -> str:
    """The input topic ``topic`` belongs to ("ss.ops" for "ss.ops.g5912" and for "ss.ops")."""
    return split_generation(topic)[0]


def past_generation(topic: str, generation_s: float, now_s: float) -> bool:
    """Whether ``topic`` is a generation whose period ended before ``now_s`` (False for a plain topic)."""
    gen = split_generation(topic)[1]
    return bool(generation_s) and gen is not None and gen < generation(now_s, generation_s)
