"""The shard's record source: a fixed set of Kafka partitions, read by hand.

``KafkaSource`` assigns its partitions by hand and never uses a consumer
group: Tansu's group joins take seconds and can wedge (docs/architecture.md, "The real components"), and
our offsets live in the store beside the results they cover, which is what
makes a crash replay exactly the records whose results were not stored. It
also publishes the shard's copies to the dead-letter and alert topics (the
same producer: ``dead_letter``, ``alert_producer``). It follows the shard's
adapter lifecycle (docs/architecture.md, "Conventions" 4): clients are created
in ``setup()`` (never in ``__init__``: Ray pickles the shard before it runs),
then poll, then close. ``ray_jobs.transports.RecordSource`` is the contract.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Iterable

from core import topics
from core.kafka_conn import KafkaConn, as_conn
from ray_jobs.transports import TopicPartition

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Message:
    """One Kafka record as the shard sees it (kafka-python's ConsumerRecord, trimmed)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


FETCH_MAX_BYTES = 4 << 20
"""At most this much a poll fetches (every partition together): each byte is checked (CRC-32C) and decoded
inside the shard's loop, so this bounds how long one poll holds it. Our producers send messages under 1 MB
(``core.topics.MAX_MESSAGE_BYTES``); a bigger one from elsewhere still comes, alone (Kafka returns a first
batch over the limit so that a reader can go on), and its decoded size is bounded at the boundary
(``validation.max_decoded_mb``)."""
PARTITION_FETCH_BYTES = 1 << 20
"""... and this much of one partition: one busy partition does not take a poll's whole share."""
LOST_LOG_GRACE_S = 15.0
"""How long a partition's end may stay behind the position read before its log counts as lost. A real Kafka
cluster's new leader learns the high watermark from its followers' next fetches, so just after a failover it
can answer with an end behind what the old leader had already handed out (Kafka's clients check positions
against leader epochs for this reason). Taken at once, that moment paused the partition for good as a broker
that lost records; a broker that really lost its records stays behind."""


METADATA_MAX_AGE_MS = 10_000
"""How old the consumer's metadata may get: how soon a restarted broker (``brokers``) and a new topic generation
are seen. A request every 10 s per shard costs the broker nothing measurable."""

class KafkaSource:
    """Reads a fixed set of partitions of the input topics; tracks what was handled.

    ``seek(stored)`` positions each partition at its stored offset (or the
    beginning). ``advance(tp, next_offset)`` records that everything before
    ``next_offset`` was handled; ``positions()`` returns those, which the shard
    turns into committable offsets once results are stored.

    The source never creates a topic and never skips records silently. A
    partition it cannot read as it should is paused, logged once (a warning)
    and listed in ``problems`` (one line each, for the shard's status) until
    the source is set up again: a partition that does not exist (a topic
    deleted or re-created with fewer partitions), a topic re-created under
    the source (its topic id changed: the broker restarted empty), a position
    beyond the partition's end (the broker lost records; reading on would
    skip the records it now gives those offsets; only once it has stayed
    beyond for ``lost_log_grace_s``: a new leader after a failover tells its
    end late). Records that expired
    before they were read (position before the beginning) are logged and
    skipped: nothing can bring them back. ``poll``, ``positions`` and ``lag``
    never raise for such a partition; the others are read on.

    With topic generations (``conn.topic_generation_s``, ``core.topics``),
    ``topics`` names the families, and the source reads them and every
    generation of them the broker has: new ones are assigned as the broker's
    metadata shows them (from their stored offset, else the beginning). A generation
    that disappears once its period is over was retired by
    ``services.topic_generations``, which deletes one only when the stored
    offsets are at its end: it is let go, not reported.
    """

    PROBLEM_HINT = "stop the pipeline; `stragglerscope offsets show` and README (Broker lost data) tell what to do"

    def __init__(self, bootstrap: KafkaConn | str, topics: Iterable[str], partitions: Iterable[int],
                 client_id: str = "stragglerscope-shard", max_poll_records: int = 500,
                 check_interval_s: float = 2.0, on_lost_log: str = "stop",
                 lost_log_grace_s: float = LOST_LOG_GRACE_S, clock: Callable[[], float] = time.monotonic):
        """``on_lost_log``: what to do with a partition whose log is not the one its offset counts in (the
        broker lost its data): 'stop' pauses it and reports it in ``problems``; 'rewind' reads the new log
        from its start, and each such move is kept for the audit (``take_resets``). ``lost_log_grace_s``: how
        long an end behind the position is waited out before it is taken for lost records."""
        self.conn = as_conn(bootstrap)
        self.bootstrap = self.conn.bootstrap
        self.families = tuple(topics)
        self.generation_s = self.conn.topic_generation_s
        # The topics read: the families themselves, and with generations those the broker has of them too
        # (a producer that was not told about generations writes to the family itself).
        self.topics = self.families
        self._stored: dict[TopicPartition, int] = {}
        self.partitions = tuple(partitions)
        self.client_id = client_id
        self.max_poll_records = max_poll_records
        self.check_interval_s = check_interval_s
        self._consumer = None
        self._client = None  # the consumer's network client (core.kafka_admin.KeptClient), for its metadata
        self._producer = None
        self._positions: dict[TopicPartition, int] = {}
        self._end: dict[TopicPartition, int] = {}
        self._end_checked = 0.0
        self._unread: set[TopicPartition] = set()  # partitions with records not read yet, as of the last lag()
        self._problems: dict[TopicPartition, str] = {}
        self._topic_ids: dict[str, Any] = {}
        self.on_lost_log = on_lost_log
        self._stored_logs: dict[TopicPartition, str] = {}
        self._lost: dict[TopicPartition, tuple[str, str]] = {}  # (why, old log id): paused until rewound
        self._resets: list[dict] = []  # rewinds done, for the audit table
        self.lost_log_grace_s = lost_log_grace_s
        self._clock = clock
        # (partition, "end" | "fetch") -> when its end was first seen behind the position (a high watermark
        # below it, or a fetch refused as beyond the end), not yet taken for a loss; each cleared by its own
        # evidence (a high watermark at or past the position; records fetched).
        self._behind_since: dict[tuple[TopicPartition, str], float] = {}

    def setup(self) -> None:
        from kafka import KafkaConsumer
        from kafka import TopicPartition as KTP

        from core.kafka_admin import KeptClient

        self._KTP = KTP
        self._client = KeptClient(KafkaConsumer)
        self._consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap, client_id=self.client_id, group_id=None,
            enable_auto_commit=False, auto_offset_reset="none", allow_auto_create_topics=False,
            kafka_client=self._client, max_poll_records=self.max_poll_records, fetch_max_bytes=FETCH_MAX_BYTES,
            max_partition_fetch_bytes=PARTITION_FETCH_BYTES, metadata_max_age_ms=METADATA_MAX_AGE_MS,
            **self.conn.client_options(),
        )
        if self.generation_s:
            # Every metadata refresh then lists all topics, new generations included (see _follow_generations).
            self._cluster().need_all_topic_metadata = True
            self.topics = self.families + self._generations(self._consumer.topics())
        self._tps = [KTP(t, p) for t in self.topics for p in self.partitions]
        self._consumer.assign(self._tps)
        self._problems, self._end = {}, {}

    def _generations(self, names) -> tuple[str, ...]:
        """The generation topics of our families among ``names``, oldest first."""
        found = [(gen, t) for t in names for fam, gen in [topics.split_generation(t)]
                 if gen is not None and fam in self.families]
        return tuple(t for _, t in sorted(found))

    def _past_generation(self, topic: str) -> bool:
        """A generation whose period is over: one whose end falls below our position was deleted after it was
        read (services.topic_generations deletes only those), before our metadata said so; not a loss."""
        return topics.past_generation(topic, self.generation_s, time.time())

    def _follow_generations(self) -> None:
        """Assign new generations from the metadata cache; let go of the retired ones."""
        cluster = self._cluster()
        if not self.generation_s or cluster is None:
            return
        live = self._generations(cluster.topics())
        cluster.request_update()  # ask again now (not at the next refresh): the next check sees newer generations
        if not live:
            return  # an empty cache (a broker that is away, an error answer) says nothing about deletions
        retired = [t for t in self.topics if t not in live and self._past_generation(t)]
        new = [t for t in live if t not in self.topics]
        if not (retired or new):
            return
        for t in retired:
            log.info("topic %s was retired (read to its end, then deleted)", t)
            for p in self.partitions:
                self._positions.pop((t, p), None)
                self._problems.pop((t, p), None)
                self._lost.pop((t, p), None)
        self.topics = tuple(t for t in self.topics if t not in retired) + tuple(new)
        self._tps = [self._KTP(t, p) for t in self.topics for p in self.partitions]
        self._consumer.assign(self._tps)  # keeps the fetch state of the partitions it had
        for t in new:
            self._topic_ids[t] = self._topic_id(t)
            for p in self.partitions:
                off = self._stored.get((t, p), 0)
                self._consumer.seek(self._KTP(t, p), off)
                self._positions[(t, p)] = off
                was = self._stored_logs.get((t, p), "")
                now = self._format_log(self._topic_ids[t])
                if off > 0 and was and now and was != now:  # a generation created again under its old name
                    self._log_lost((t, p), f"the stored offset {off} was read from another log ({was}; the "
                                           f"partition's log is {now} now): the broker lost its records", was)

    @property
    def problems(self) -> list[str]:
        """One line per partition that is not being read, and why, those that held records first; the ones
        that never held a record summed up in one line after them (after a broker lost its data, 64 empty
        partitions' lines filled the status, cut off before the ones that mattered); empty when all is well."""
        held = [tp for tp in sorted(self._problems) if self._positions.get(tp, 0) > 0]
        empty = [tp for tp in sorted(self._problems) if tp not in held]
        lines = [self._problems[tp] for tp in held]
        if len(empty) <= 2:
            return lines + [self._problems[tp] for tp in empty]
        names = ", ".join(f"{t}[{p}]" for t, p in empty[:4]) + (", ..." if len(empty) > 4 else "")
        why = self._problems[empty[0]].split(": ", 1)[-1]
        return lines + [f"{len(empty)} partitions that never held a record ({names}): {why}"]

    def _problem(self, tp: TopicPartition, what: str) -> None:
        """Pause ``tp`` and report it (once)."""
        if tp in self._problems:
            return
        self._problems[tp] = f"{tp[0]}[{tp[1]}]: {what}"
        with _suppress_kafka():
            self._consumer.pause(self._KTP(*tp))
        log.warning("not reading %s[%d] any more: %s; %s", tp[0], tp[1], what, self.PROBLEM_HINT)

    def _log_lost(self, tp: TopicPartition, what: str, old_log: str | None = None) -> None:
        """The broker lost ``tp``'s records (its log changed, or its end fell behind us): a problem, or with
        ``on_lost_log = rewind`` paused until the shard calls ``rewind`` (once what it polled is handled)."""
        if self.on_lost_log != "rewind":
            self._problem(tp, what)
            return
        if tp in self._lost or tp in self._problems:
            return
        self._lost[tp] = (what, self._format_log(self._topic_ids.get(tp[0])) if old_log is None else old_log)
        with _suppress_kafka():
            self._consumer.pause(self._KTP(*tp))
        log.warning("%s[%d]: %s; reading its new log from the start (kafka.on_lost_log = rewind)", tp[0], tp[1],
                    what)

    def lost_logs(self) -> list[TopicPartition]:
        """Partitions waiting for ``rewind`` (``on_lost_log = rewind``)."""
        return sorted(self._lost)

    def rewind(self, tp: TopicPartition, by: str) -> int:
        """Read ``tp`` from the start of the log it has now; the move is kept for ``take_resets``. Returns the
        new position. The caller drops what it holds of the old log's offsets first (they count in a lost log)."""
        reason, was_log = self._lost.pop(tp, ("", ""))
        ktp = self._KTP(*tp)
        begin = self._offsets("beginning", [ktp]).get(tp, 0)
        was = self._positions.get(tp, 0)
        self._topic_ids[tp[0]] = self._topic_id(tp[0])
        with _suppress_kafka():
            self._consumer.seek(ktp, begin)
            self._consumer.resume(ktp)
        self._positions[tp] = begin
        if was or begin:  # a partition that never held a record moved nowhere: nothing to audit
            self._resets.append(dict(topic=tp[0], partition=tp[1], from_offset=was, from_log_id=was_log,
                                     to_offset=begin, to_log_id=self._format_log(self._topic_ids[tp[0]]), by=by,
                                     reason=reason))
        log.warning("%s[%d]: rewound from offset %d of the lost log to %d of the new one", tp[0], tp[1], was, begin)
        return begin

    def take_resets(self) -> list[dict]:
        """The rewinds done since the last call (rows of ``core.schema.OFFSET_RESET`` less source and time)."""
        out, self._resets = self._resets, []
        return out

    def _format_log(self, topic_id) -> str:
        from core.kafka_admin import log_id

        cluster = self._cluster()
        return log_id(topic_id, cluster.cluster_id if cluster is not None else None)

    def log_ids(self) -> dict[TopicPartition, str]:
        """The log each assigned partition's position counts in, stored with the offsets (``core.kafka_admin.log_id``):
        a later start can tell a partition's new log from this one. A partition paused because its log was
        lost keeps the old log's id until it is rewound."""
        out = {}
        for t in self.topics:
            now = self._format_log(self._topic_ids.get(t))
            for p in self.partitions:
                tp = (t, p)
                held = tp in self._problems or tp in self._lost  # still at an offset of the old log
                lid = (self._stored_logs.get(tp) or now) if held else now
                if lid:
                    out[tp] = lid
        return out

    def _cluster(self):
        """The consumer's metadata cache (kafka-python's ``ClusterMetadata``; None before ``setup``)."""
        return self._client.cluster if self._client is not None else None

    def _existing(self, fresh: bool = False) -> list:
        """Assigned partitions the broker has; the others become problems.

        ``fresh``: ask the broker (the consumer's public call, which blocks
        until metadata arrives: only at setup); else the consumer's metadata
        cache, which it refreshes every 30 s and after errors, so a loop
        iteration never waits on a broker that is away.
        """
        out = []
        if not fresh:
            self._follow_generations()  # a retired generation is no problem
        cluster = self._cluster()
        for topic in self.topics:
            parts = None
            with _suppress_kafka():
                if fresh or cluster is None:
                    parts = self._consumer.partitions_for_topic(topic)
                else:
                    parts = cluster.partitions_for_topic(topic)
            for ktp in self._tps:
                if ktp.topic != topic:
                    continue
                if not parts:
                    self._problem((topic, ktp.partition), "the topic does not exist on the broker any more")
                elif ktp.partition not in parts:
                    self._problem((topic, ktp.partition), f"the topic has only {len(parts)} partitions now")
                elif (topic, ktp.partition) not in self._problems:
                    out.append(ktp)
        return out

    def _topic_id(self, topic: str):
        cluster = self._cluster()
        return cluster.topic_id(topic) if cluster is not None else None

    def _check_topic_ids(self) -> None:
        """A topic whose id changed was deleted and created again: the offsets we hold mean other records."""
        for topic in self.topics:
            now = self._topic_id(topic)
            was = self._topic_ids.setdefault(topic, now)
            if was is None and now is not None:
                self._topic_ids[topic] = now
            elif now is not None and now != was:
                for ktp in self._tps:
                    if ktp.topic == topic:
                        self._log_lost((topic, ktp.partition), "the topic was deleted and created again "
                                       "(its topic id changed; the broker lost its records?)")

    def seek(self, stored: dict[TopicPartition, int], stored_logs: dict[TopicPartition, str] | None = None,
             by: str = "shard") -> None:
        """Position every partition at its stored offset. ``stored_logs``: the log each offset was read from
        (``log_ids`` of the source that stored it); an offset read from another log than the partition has
        now counts in a lost log, and is a problem or is rewound (``on_lost_log``), never read on from."""
        from core.kafka_admin import logs_changed

        if self._consumer is None:
            self.setup()
        self._stored = dict(stored)  # where generations that appear later start
        self._stored_logs = dict(stored_logs or {})
        present = self._existing(fresh=True)
        begin = self._offsets("beginning", present, strict=True)  # a failure here fails the setup, as before
        self._end = self._offsets("end", present)  # lag before the first fetch; never a loss verdict
        for topic in self.topics:
            self._topic_ids[topic] = self._topic_id(topic)
        changed = logs_changed(stored, self._stored_logs, {t: self._format_log(self._topic_ids[t])
                                                           for t in self.topics})
        for ktp in self._tps:
            tp = (ktp.topic, ktp.partition)
            off = stored.get(tp, 0)
            if tp in changed:
                was, was_log, now_log = changed[tp]
                what = (f"the stored offset {was} was read from another log ({was_log}; the partition's log is "
                        f"{now_log} now): the broker lost its records")
                if self.on_lost_log == "rewind":  # nothing of the old log is held yet: from the new log's start
                    off = begin.get(tp, 0)
                    log.warning("%s[%d]: %s; reading the new log from offset %d (kafka.on_lost_log = rewind)",
                                tp[0], tp[1], what, off)
                    if was or off:  # a partition that never held a record moved nowhere: nothing to audit
                        self._resets.append(dict(topic=tp[0], partition=tp[1], from_offset=was,
                                                 from_log_id=was_log, to_offset=off, to_log_id=now_log, by=by,
                                                 reason=what))
                else:  # paused where it was: the stored offset and its log stay as they are
                    off = was
                    self._problem(tp, what)
                self._consumer.seek(ktp, off)
                self._positions[tp] = off
                continue
            if tp in begin and off < begin[tp]:
                if off > 0:
                    log.warning("%s[%d]: records %d to %d expired before they were read (retention); "
                                "reading on from %d", tp[0], tp[1], off, begin[tp] - 1, begin[tp])
                off = begin[tp]
            elif tp not in self._problems and tp not in begin:
                self._problem(tp, "its offsets could not be read")
            # Every assigned partition gets a position, paused ones too (the consumer wants one for each).
            # One beyond the end shows at the first fetch: an error (Kafka) or a high watermark below it (Tansu).
            self._consumer.seek(ktp, off)
            self._positions[tp] = off

    def _offsets(self, which: str, ktps: list, strict: bool = False) -> dict[TopicPartition, int]:
        if not ktps:
            return {}
        fn = self._consumer.beginning_offsets if which == "beginning" else self._consumer.end_offsets
        try:
            got = fn(ktps)
        except Exception as e:  # noqa: BLE001 - a partition that went away between metadata and request
            if strict:
                raise
            log.warning("reading the %s offsets of %d partitions failed: %s", which, len(ktps), e)
            return {}
        return {(k.topic, k.partition): v for k, v in got.items() if v is not None}

    def poll(self, timeout_ms: int) -> list[Message]:
        from kafka.errors import KafkaError, OffsetOutOfRangeError

        try:
            got = self._consumer.poll(timeout_ms=timeout_ms)
        except OffsetOutOfRangeError as e:
            self._out_of_range(e.args[0] if e.args and isinstance(e.args[0], dict) else {})
            return []
        except (KafkaError, KeyError) as e:  # a partition vanished under the fetcher
            log.warning("poll failed: %s: %s", type(e).__name__, e)
            self._existing()
            return []
        out = []
        for ktp, records in got.items():
            if records:  # fetched: a refusal as beyond the end before was the leader's late end
                self._behind_since.pop(((ktp.topic, ktp.partition), "fetch"), None)
            for r in records:
                out.append(Message(ktp.topic, ktp.partition, r.offset, r.key, r.value))
        # Registrations first: a window can then see its job's layout in the same batch.
        out.sort(key=lambda m: topics.family_of(m.topic) != topics.TOPIC_JOBS)
        return out

    def _out_of_range(self, fetched: dict) -> None:
        """The broker refused a fetch position: before the beginning the records expired, beyond the end it
        lost them."""
        ktps = [k for k in fetched if (k.topic, k.partition) not in self._problems]
        begin = self._offsets("beginning", ktps)
        for ktp in ktps:
            tp = (ktp.topic, ktp.partition)
            pos = fetched[ktp]
            if tp not in begin:
                self._problem(tp, "its offsets could not be read")
            elif pos < begin[tp]:
                log.warning("%s[%d]: records %d to %d expired before they were read (retention); reading on "
                            "from %d", tp[0], tp[1], pos, begin[tp] - 1, begin[tp])
                self._consumer.seek(ktp, begin[tp])
                self.advance(tp, begin[tp])
            elif not self._past_generation(tp[0]):
                if self._still_behind(tp, "fetch"):
                    self._log_lost(tp, f"the position {pos} is beyond its end: the broker lost records")
                else:  # fetched again from the same place next poll: the new leader's end may have caught up
                    with _suppress_kafka():
                        self._consumer.seek(ktp, pos)

    def _still_behind(self, tp: TopicPartition, how: str) -> bool:
        """Whether ``tp``'s end has been behind its position (``how``: by its high watermark, or by a refused
        fetch) for ``lost_log_grace_s``, counted from when it was first seen so."""
        now = self._clock()
        since = self._behind_since.setdefault((tp, how), now)
        if now - since < self.lost_log_grace_s:
            return False
        self._behind_since.pop((tp, how), None)
        return True

    def advance(self, tp: TopicPartition, next_offset: int) -> None:
        if next_offset > self._positions.get(tp, -1):
            self._positions[tp] = next_offset

    def positions(self) -> dict[TopicPartition, int]:
        return dict(self._positions)

    def lag(self) -> int:
        """Records not yet handled: each partition's high watermark (from the latest fetch) minus its position.

        High watermarks come with every fetch answer and, unlike Tansu's answer
        to ListOffsets (the last batch's first offset + 1), are exact. A high
        watermark below the position means the broker lost records. Every
        ``check_interval_s`` the metadata is checked too: partitions that went
        away, topics created again under us (see the class doc).
        """
        now = time.monotonic()
        if now - self._end_checked > self.check_interval_s:
            self._end_checked = now
            try:
                self._check_topic_ids()
                self._existing()
            except Exception as e:  # noqa: BLE001 - a check is not worth failing the loop for
                log.debug("partition check failed: %s", e)
        total, self._unread = 0, set()
        for ktp in self._tps:
            tp = (ktp.topic, ktp.partition)
            if tp in self._problems or tp in self._lost:
                continue
            try:
                hw = self._consumer.highwater(ktp)
            except (KeyError, AssertionError, AttributeError):  # not assigned any more
                hw = None
            pos = self._positions.get(tp, 0)
            if hw is not None and hw < pos:
                if not self._past_generation(tp[0]) and self._still_behind(tp, "end"):
                    self._log_lost(tp, f"its end {hw} is behind the position {pos}: the broker lost records")
                continue
            self._behind_since.pop((tp, "end"), None)
            # Before the first fetch answer: the end ListOffsets gave at seek(), a lower bound on Tansu.
            end = hw if hw is not None else self._end.get(tp)
            if end is not None and end > pos:
                total += end - pos
                self._unread.add(tp)
        return total

    def unread(self) -> set[TopicPartition]:
        return set(self._unread)

    def brokers(self) -> int:
        # A KRaft cluster lists only the brokers its controller has not fenced: one killed leaves within
        # its session timeout; one restarted comes back within ``METADATA_MAX_AGE_MS``.
        cluster = self._cluster()
        return len(cluster.brokers()) if cluster is not None else 0

    def _producer_client(self):
        if self._producer is None:
            from kafka import KafkaProducer

            from core.kafka_admin import KeptClient

            # max_block_ms: a missing topic (the broker lost it) costs the loop seconds, not a minute.
            self._producer = KafkaProducer(bootstrap_servers=self.bootstrap, client_id=self.client_id + "-out",
                                           acks=1, linger_ms=5, allow_auto_create_topics=False, max_block_ms=3000,
                                           kafka_client=KeptClient(KafkaProducer), **self.conn.client_options())
        return self._producer

    def dead_letter(self, msg: Message, reason: str) -> None:
        """Forward the rejected bytes to the dead-letter topic with the reason in a header."""
        try:
            self._producer_client().send(
                topics.TOPIC_DEAD_LETTER, key=msg.key, value=msg.value,
                headers=[("reason", reason.encode()[:1000]),
                         ("source", f"{msg.topic}/{msg.partition}/{msg.offset}".encode())],
            )
        except Exception as e:  # the store keeps the dead letter too; the topic copy is best effort
            log.warning("dead-letter publish failed: %s", e)

    def alert_producer(self):
        from ray_jobs.alerts import AlertTopic

        return AlertTopic(self._producer_client).send

    def close(self) -> None:
        for c in (self._consumer, self._producer):
            if c is not None:
                try:
                    c.close()
                except Exception:
                    pass
        self._consumer = self._producer = None


class _suppress_kafka:
    """Swallow kafka-python's errors (and its KeyErrors for vanished partitions) around a best-effort call."""

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        if exc is None:
            return False
        from kafka.errors import KafkaError

        if isinstance(exc, (KafkaError, KeyError)):
            log.debug("ignored: %s: %s", type(exc).__name__, exc)
            return True
        return False
