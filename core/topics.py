"""Kafka topic names, which record kind goes to which, and the message size limit."""
from __future__ import annotations

TOPIC_OPS = "ss.ops"
TOPIC_CCL = "ss.ccl"
TOPIC_HEARTBEATS = "ss.heartbeats"
TOPIC_JOBS = "ss.jobs"
TOPIC_CHECKPOINTS = "ss.checkpoints"
TOPIC_DEAD_LETTER = "ss.dead-letter"
TOPIC_ALERTS = "ss.alerts"
INPUT_TOPICS = (TOPIC_JOBS, TOPIC_OPS, TOPIC_CCL, TOPIC_HEARTBEATS, TOPIC_CHECKPOINTS)

MAX_MESSAGE_BYTES = 900_000
"""One Arrow IPC batch per Kafka message stays under Kafka's 1 MB default."""

TOPIC_OF_KIND = {
    "op_span": TOPIC_OPS,
    "ccl_record": TOPIC_CCL,
    "heartbeat": TOPIC_HEARTBEATS,
    "job": TOPIC_JOBS,
    "checkpoint": TOPIC_CHECKPOINTS,
}
