"""Rolls the embedded broker's input topics over to new generations and deletes the ones read to their end.

Tansu's memory engine keeps every record until its topic is deleted: it
honours neither retention nor DeleteRecords (the latter panics it). Measured:
2,000 records of 100 kB held 220 MB; deleting the topic brought the broker back
to 16 MB. So with ``kafka.topic_generation_s`` set (the embedded broker's
default), records go to generation topics (``core.topics``), and this keeper,
a thread of the driver that owns the broker:

- creates the current and the next generation of every input topic, so a
  producer never meets a missing topic at a boundary (producers pick the
  generation by their clock; the shards assign new generations as the
  broker's metadata shows them);
- deletes a generation once its period ended ``LATE_WRITES_S`` ago (late
  producers and spools have moved on) and the offsets stored for the source,
  which the shards write only after the results they cover are stored, are at
  the end of each of its partitions. The end is a fetch's high watermark
  (``core.kafka_admin.end_offsets``), exact on Tansu, unlike ListOffsets.

A generation that is not read to its end stays, however old: nothing is lost
to a slow or stopped pipeline, the memory just grows as it did before.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from core import topics
from core.kafka_conn import KafkaConn

log = logging.getLogger(__name__)


def wanted_generations(families, generation_s: float, now_s: float) -> list[str]:
    """The generation topics that must exist at ``now_s``: the current one and the next of each family."""
    gen = topics.generation(now_s, generation_s)
    return [topics.generation_topic(f, g) for g in (gen, gen + 1) for f in families]


# How long after its period a generation may still receive records: a producer picks the generation when a
# message leaves, so only messages in flight (linger, retries: seconds) arrive late.
LATE_WRITES_S = 30.0


def retirable(existing, generation_s: float, now_s: float) -> list[str]:
    """Generation topics among ``existing`` whose period ended over ``LATE_WRITES_S`` (or one period) ago."""
    grace = min(LATE_WRITES_S, generation_s)
    out = []
    for t in existing:
        fam, gen = topics.split_generation(t)
        if gen is not None and fam in topics.INPUT_TOPICS and (gen + 1) * generation_s + grace <= now_s:
            out.append(t)
    return sorted(out)


def read_to_end(topic: str, partitions: int, ends: dict[tuple[str, int], int | None],
                stored: dict[tuple[str, int], int]) -> bool:
    """Whether every partition of ``topic`` has its stored offset at (or past) its end."""
    for p in range(partitions):
        end = ends.get((topic, p))
        if end is None or stored.get((topic, p), 0) < end:  # an unknown end is not proven read
            return False
    return True


class TopicGenerations:
    """The keeper thread; ``start()``, ``stop()``, or ``tick()`` by hand (tests)."""

    def __init__(self, conn: KafkaConn, partitions: int, stored_offsets: Callable[[], dict[tuple[str, int], int]],
                 replication_factor: int = 1, clock: Callable[[], float] = time.time):
        if not conn.topic_generation_s:
            raise ValueError("TopicGenerations needs kafka.topic_generation_s > 0")
        self.conn = conn
        self.generation_s = conn.topic_generation_s
        self.partitions = partitions
        self.stored_offsets = stored_offsets
        self.replication_factor = replication_factor
        self.clock = clock
        self.deleted: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> list[str]:
        """Create the wanted generations, delete the retirable ones that were read; returns those deleted."""
        from core.kafka_admin import delete_topics, end_offsets, ensure_topics, list_topics, topic_partitions

        now = self.clock()
        ensure_topics(self.conn, wanted_generations(topics.INPUT_TOPICS, self.generation_s, now), self.partitions,
                      replication_factor=self.replication_factor)
        old = retirable(list_topics(self.conn), self.generation_s, now)
        if not old:
            return []
        counts = topic_partitions(self.conn, old)
        ends = end_offsets(self.conn, [(t, p) for t in old for p in range(counts.get(t, 0))])
        stored = self.stored_offsets()
        done = [t for t in old if t in counts and read_to_end(t, counts[t], ends, stored)]
        if done:
            delete_topics(self.conn, done)
            self.deleted += done
            log.info("deleted %d input topic generations read to their end: %s", len(done), ", ".join(done))
        waiting = sorted(set(old) - set(done))
        if waiting:
            log.debug("generations not read to their end yet: %s", ", ".join(waiting))
        return done

    def _run(self) -> None:
        # A few checks per generation: a generation is deleted within about a quarter period of being read.
        every = max(1.0, self.generation_s / 4)
        while not self._stop.wait(every):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - a broker or store hiccup: try again next time
                log.warning("topic generations: %s", e)

    def start(self) -> "TopicGenerations":
        self.tick()  # the first generations exist before anything produces
        self._thread = threading.Thread(target=self._run, name="ss-topic-generations", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
