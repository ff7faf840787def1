"""The broker against the pipeline's needs, before any shard starts: topics, and offsets that would skip records.

``check_topics`` creates the missing topics and refuses partition counts that
do not fit. ``check_offsets`` compares the offsets stored for a source with
the partitions' ends and logs: an offset beyond its partition's end, or read
from another log than the partition has now, means the broker lost records
(RELIABILITY.md); the pipeline then refuses to start, or rewinds with an
audit row (``kafka.on_lost_log``). ``stragglerscope offsets`` uses the same
inspection (``inspect_offsets``, ``rewind_offsets``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from core.config import Config

log = logging.getLogger(__name__)


def check_topics(cfg: Config) -> int:
    """Create the missing topics and return the input topics' partition count; BrokerError when it does not fit."""
    from core.kafka_admin import prepare_topics

    return prepare_topics(cfg.kafka.conn(), cfg.kafka.partitions, cfg.kafka.replication_factor,
                          min_insync_replicas=cfg.kafka.min_insync_replicas)


def stored_offsets(open_store: Callable[[str], Any], store_url: str, source_id: str) -> dict[tuple[str, int], int]:
    """The offsets stored for ``source_id`` (every input topic and partition), as the shards load them."""
    from core import topics
    store = open_store(store_url)
    try:
        store.setup()
        return store.load_offsets(source_id, topics.INPUT_TOPICS, None)
    finally:
        store.close()


@dataclasses.dataclass(frozen=True)
class OffsetCheck:
    """Stored offsets of a source against the broker (``inspect_offsets``)."""
    stored: dict[tuple[str, int], int]
    logs: dict[tuple[str, int], str]
    """The log each stored offset was read from ('' = stored before logs were kept)."""
    ends: dict[tuple[str, int], int | None]
    logs_now: dict[str, str]
    ahead: dict[tuple[str, int], tuple[int, int]]
    """Beyond their partition's end: (stored, end)."""
    changed: dict[tuple[str, int], tuple[int, str, str]]
    """Read from another log than the partition has now: (stored, that log, the log now)."""

    @property
    def lost(self) -> list[tuple[str, int]]:
        return sorted(set(self.ahead) | set(self.changed))


def inspect_offsets(cfg: Config, store, source_id: str) -> OffsetCheck:
    """The offsets stored for ``source_id`` in ``store`` (open), each against its partition's end and log."""
    from core import topics
    from core.kafka_admin import end_offsets, logs_changed, offsets_ahead, topic_logs
    from core.topics import past_generation

    stored = store.load_offsets(source_id, topics.INPUT_TOPICS, None)
    logs = store.load_offset_logs(source_id, topics.INPUT_TOPICS, None)
    live = {tp: off for tp, off in stored.items() if off > 0}
    ends = end_offsets(cfg.kafka.conn(), live) if live else {}
    # A past generation that is gone was read to its end and retired (services.topic_generations).
    gen_s, now = cfg.kafka.conn().topic_generation_s, time.time()
    live = {tp: off for tp, off in live.items() if ends.get(tp) is not None or not past_generation(tp[0], gen_s, now)}
    logs_now = topic_logs(cfg.kafka.conn(), {t for t, _ in live}) if live else {}
    return OffsetCheck(stored, logs, ends, logs_now, offsets_ahead(live, ends), logs_changed(live, logs, logs_now))


def check_offsets(cfg: Config, source_id: str, open_store: Callable[[str], Any]) -> list[dict]:
    """Refuse to start on offsets that would skip records; with ``kafka.on_lost_log = rewind``, rewind them.

    An offset stored for ``source_id`` beyond its partition's end, or read
    from another log than the partition has now (its topic id changed), means
    the broker lost records (restarted empty, topic deleted and re-created);
    reading on from it would skip the records the broker gives those offsets
    now, which nothing read. 'stop' (the default): LogChangedError or
    OffsetsAheadError, one line naming the way out. 'rewind': those offsets
    go to the start of the new logs, each with a row in ``offset_resets``;
    returns those rows.
    """
    from core.kafka_admin import LogChangedError, OffsetsAheadError

    store = open_store(cfg.store.url)
    try:
        store.setup()
        check = inspect_offsets(cfg, store, source_id)
        if not check.lost:
            return []
        if cfg.kafka.on_lost_log == "rewind":
            return rewind_offsets(store, source_id, check, by="start")
    finally:
        store.close()
    fix = ("Results of records read before are stored; the records the broker lost are gone. If the broker was "
           "reset, run `stragglerscope offsets reset` (same --config) to read its topics from the beginning, or "
           "set kafka.on_lost_log = \"rewind\"; `stragglerscope offsets show` lists them")
    if check.changed and not check.ahead:  # beyond the end says it plainest where both hold
        (topic, part), (off, was, now) = next(iter(check.changed.items()))
        more = f" and {len(check.changed) - 1} more partitions" if len(check.changed) > 1 else ""
        raise LogChangedError(
            f"Kafka at {cfg.kafka.bootstrap} lost records: the offsets stored for source {source_id!r} were read "
            f"from other logs than its topics have now: {topic}[{part}] stored {off} in log {was}, its log is "
            f"{now} now (the topic was created again){more}. {fix}", check.changed)
    (topic, part), (off, end) = next(iter(check.ahead.items()))
    more = f" and {len(check.ahead) - 1} more partitions" if len(check.ahead) > 1 else ""
    raise OffsetsAheadError(
        f"Kafka at {cfg.kafka.bootstrap} lost records: the offsets stored for source {source_id!r} are beyond "
        f"the end of {topic}[{part}] (stored {off}, end {end}){more}. {fix}", check.ahead)


def rewind_offsets(store, source_id: str, check: OffsetCheck, by: str,
                   partitions: list[tuple[str, int]] | None = None) -> list[dict]:
    """Store offset 0 in the partitions' current logs for ``partitions`` (default: those lost), each with an
    audit row; returns the rows."""
    from core import codec
    from core import schema as S

    tps = check.lost if partitions is None else partitions
    if not tps:
        return []
    now_ns = time.time_ns()
    rows = []
    for i, tp in enumerate(tps):
        off = check.stored.get(tp, 0)
        if tp in check.changed:
            why = f"read from log {check.changed[tp][1]}, the partition's log is {check.changed[tp][2]} now"
        elif tp in check.ahead:
            why = f"beyond the partition's end ({check.ahead[tp][1]})"
        else:
            why = "reset by hand"
        rows.append(dict(source_id=source_id, topic=tp[0], partition=tp[1], reset_ns=now_ns + i, from_offset=off,
                         from_log_id=check.logs.get(tp, ""), to_offset=0, to_log_id=check.logs_now.get(tp[0], ""),
                         by=by, reason=why))
    store.insert("offset_reset", codec.from_rows(S.OFFSET_RESET, rows))
    store.store_offsets(source_id, {tp: 0 for tp in tps}, {tp: check.logs_now.get(tp[0], "") for tp in tps})
    for r in rows:
        log.warning("%s[%d]: stored offset %d given up (%s); reading from the start (%s)", r["topic"],
                    r["partition"], r["from_offset"], r["reason"], by)
    return rows
