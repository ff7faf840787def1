"""Kafka topics as producers and consumers need them: reachability, creation, partition and offset checks.

Any Kafka-protocol broker: the embedded one (``services/broker.py``) or a
fleet's own. Consumers assign partitions manually and keep their offsets
beside their results (no consumer groups: docs/architecture.md, "Windows and delivery"), so what is
checked here is what that needs: the topics exist with enough partitions,
and no stored offset is beyond the end of its partition.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Iterable

from core.kafka_conn import KafkaConn, as_conn, diagnose

log = logging.getLogger(__name__)

DEFAULT_PARTITIONS = 8


class BrokerError(RuntimeError):
    """The broker could not be started or reached, or its topics do not fit; the message says why.

    One line fit for a command line, with any password it would show
    replaced by ``***`` (``core.redact``).
    """

    def __init__(self, message: object = "broker error") -> None:
        from core.redact import redact

        super().__init__(redact(" ".join(str(message).split()))[:2000])


class OffsetsAheadError(BrokerError):
    """Stored offsets are beyond the end of their partitions: the broker lost records (restarted empty,
    topic deleted and re-created). ``ahead`` maps (topic, partition) to (stored, end)."""

    def __init__(self, message: str, ahead: dict[tuple[str, int], tuple[int, int]]):
        super().__init__(message)
        self.ahead = ahead

    def __reduce__(self):
        return type(self), (str(self), self.ahead)


class LogChangedError(BrokerError):
    """Stored offsets were read from other logs than the partitions have now: the broker lost its data (restarted
    empty, topics deleted and created again) and reading on would skip records. ``changed`` maps (topic,
    partition) to (stored offset, stored log id, log id now)."""

    def __init__(self, message: str, changed: dict[tuple[str, int], tuple[int, str, str]]):
        super().__init__(message)
        self.changed = changed

    def __reduce__(self):
        return type(self), (str(self), self.changed)


_NO_TOPIC_ID = "00000000-0000-0000-0000-000000000000"


def log_id(topic_id, cluster_id) -> str:
    """What names the log a partition's offsets count in: the topic's id where the broker gives one (Kafka
    2.8 and later, Tansu; a topic created again gets a new one), else its cluster id (a broker that lost
    its storage formats a new cluster), else '' (unknown: such offsets are not checked against their log)."""
    tid = str(topic_id or "")
    if tid and tid != _NO_TOPIC_ID:
        return tid
    return f"cluster:{cluster_id}" if cluster_id else ""


def topic_logs(bootstrap: KafkaConn | str, topics: Iterable[str], timeout_s: float = 20.0) -> dict[str, str]:
    """``log_id`` of each of ``topics`` that exists; creates nothing."""
    from kafka import KafkaConsumer
    from kafka.errors import KafkaError

    conn = as_conn(bootstrap)
    try:
        kept = KeptClient(KafkaConsumer)
        consumer = KafkaConsumer(bootstrap_servers=conn.bootstrap, client_id="stragglerscope-admin", group_id=None,
                                 enable_auto_commit=False, allow_auto_create_topics=False, kafka_client=kept,
                                 request_timeout_ms=int(timeout_s * 1000) + 1000, **conn.client_options())
    except KafkaError as e:
        raise BrokerError(f"cannot reach Kafka at {conn.describe()}: {_reason(e)}{_why(conn)}") from None
    try:
        out = {}
        for t in dict.fromkeys(topics):
            if consumer.partitions_for_topic(t):  # fetches the topic's metadata, its id with it
                out[t] = kept.log_id(t)
        return out
    except KafkaError as e:
        raise BrokerError(f"cannot read topic metadata at {bootstrap}: {_reason(e)}") from None
    finally:
        consumer.close()


def logs_changed(stored: dict[tuple[str, int], int], stored_logs: dict[tuple[str, int], str],
                 logs_now: dict[str, str]) -> dict[tuple[str, int], tuple[int, str, str]]:
    """The partitions whose stored offset (above 0) was read from another log than their topic has now.

    Either side unknown ('' or a topic that is gone) proves nothing here: offsets beyond a partition's end
    are ``offsets_ahead``'s."""
    out = {}
    for tp, off in sorted(stored.items()):
        was, now = stored_logs.get(tp, ""), logs_now.get(tp[0], "")
        # Compared only in kind: a broker upgraded to topic ids has not lost its logs.
        if off > 0 and was and now and was != now and was.startswith("cluster:") == now.startswith("cluster:"):
            out[tp] = (off, was, now)
    return out


class KeptClient:
    """A kafka-python consumer's or producer's network client, made through their documented ``kafka_client``
    option: made the usual way, with topic auto-creation off, and kept, so its metadata cache (``cluster``:
    topic ids, the cluster id, the partitions known) is read through public members.

    ``allow_auto_create_topics=False`` is the documented setting, but kafka-python 3.0 does not hand it on to
    the client's metadata object, and Tansu then creates any topic a metadata request names, with its default
    partition count. A topic created that way hides a lost or misconfigured topic (a re-created topic with
    the wrong partition count lost windows silently), so the setting is put where the requests are built,
    before the client sends its first request.

    ``kind``: the ``KafkaConsumer`` or ``KafkaProducer`` class; its default client is the one made.
    """

    def __init__(self, kind) -> None:
        self._make = kind.DEFAULT_CONFIG["kafka_client"]
        self.client = None

    def __call__(self, **config):
        client = self._make(**config)
        client.cluster.config["allow_auto_create_topics"] = False
        self.client = client
        return client

    @property
    def cluster(self):
        """The client's metadata cache (kafka-python's ``ClusterMetadata``); None before the client is made."""
        return None if self.client is None else self.client.cluster

    def log_id(self, topic: str) -> str:
        """``log_id`` of ``topic`` from the metadata cache ('' where it has none)."""
        cluster = self.cluster
        if cluster is None:
            return ""
        return log_id(cluster.topic_id(topic), cluster.cluster_id)


def _reason(e: BaseException) -> str:
    """``Type: message`` of a client error, once (kafka-python's messages often start with their type)."""
    text = str(e).strip() or type(e).__name__
    return text if text.startswith(type(e).__name__) else f"{type(e).__name__}: {text}"


SASL_REFUSAL_S = 4.0
"""How long a SASL bootstrap that only ever sees the broker drop the connection is given before that is said."""
_AUTH_WORDS = ("SaslAuthenticationFailedError", "AuthorizationError", "Authentication failed",
               "IllegalSaslStateError", "UnsupportedSaslMechanismError")


class _RefusalWatch(logging.Handler):
    """The broker's own word when it refuses our credentials. kafka-python 3 logs it at once (``kafka.net``:
    "Bootstrap connection ... failed: [Error 58] SaslAuthenticationFailedError: Authentication failed ...
    invalid credentials ...") and goes on trying to bootstrap until its timeout (21-30 s), which then says
    only that it could not. While it is attached, kafka.net's records come here and not to the terminal."""

    LOGGER = "kafka.net"

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reason = ""
        self.seen = threading.Event()
        self.drops = 0  # bootstrap connections dropped by the broker without a word (see _admin)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.name.endswith(".manager") and "failed: KafkaConnectionError: socket disconnected" in msg:
            self.drops += 1
        for word in _AUTH_WORDS:
            at = msg.rfind(word + ": ")
            if at >= 0:
                # "... failed: [Error 58] SaslAuthenticationFailedError: SaslAuthenticationFailedError: Authentication
                # failed during authentication due to invalid credentials ... (backoff 0.05 secs)"
                said = msg[at + len(word) + 2:].split(" (backoff")[0].rstrip(")").strip()
                self.reason = f"{word}: {said}"
                self.seen.set()
                return

    def __enter__(self) -> "_RefusalWatch":
        lg = logging.getLogger(self.LOGGER)
        self._saved = (lg.level, lg.propagate)
        lg.setLevel(logging.WARNING)
        lg.propagate = False
        lg.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        lg = logging.getLogger(self.LOGGER)
        lg.removeHandler(self)
        lg.level, lg.propagate = self._saved


def _admin(bootstrap: KafkaConn | str, timeout_s: float):
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    conn = as_conn(bootstrap)
    opts = dict(bootstrap_servers=conn.bootstrap, client_id="stragglerscope-admin",
                request_timeout_ms=int(timeout_s * 1000), **conn.client_options())
    if "bootstrap_timeout_ms" in KafkaAdminClient.DEFAULT_CONFIG:  # kafka-python >= 3.0.10
        opts["bootstrap_timeout_ms"] = int(timeout_s * 1000)
    if not conn.uses_sasl:
        try:
            return KafkaAdminClient(**opts)
        except KafkaError as e:
            raise BrokerError(f"cannot reach Kafka at {conn.describe()}: {_reason(e)}{_why(conn)}") from None
    # With SASL the client is made on a thread of its own, so that the broker's refusal ends the wait at once.
    made: list = []
    with _RefusalWatch() as refusal:
        def make():
            try:
                made.append(KafkaAdminClient(**opts))
            except Exception as e:  # handed to the caller below
                made.append(e)
        worker = threading.Thread(target=make, name="kafka-admin-bootstrap", daemon=True)
        worker.start()
        give_up = time.monotonic() + SASL_REFUSAL_S
        while worker.is_alive() and not refusal.seen.wait(0.05):
            if time.monotonic() > give_up and refusal.drops >= 2:
                break
    # The client still trying in the background gives up at its own timeout; nothing waits for it.
    if refusal.seen.is_set():
        raise BrokerError(f"Kafka at {conn.describe()} refused the credentials: {refusal.reason} (check "
                          "kafka.sasl_username, the password and kafka.sasl_mechanism)")
    if not made:
        # Apache Kafka sends its refusal, then closes; now and then the close comes first and the client sees
        # only a dropped connection, every time, until its own timeout.
        raise BrokerError(f"Kafka at {conn.describe()} closed the connection during SASL authentication "
                          f"{refusal.drops} times in {SASL_REFUSAL_S:g} s without answering: it refuses the "
                          "credentials (check kafka.sasl_username, the password and kafka.sasl_mechanism)")
    out = made[0]
    if isinstance(out, KafkaError):
        raise BrokerError(f"cannot reach Kafka at {conn.describe()}: {_reason(out)}{_why(conn)}") from None
    if isinstance(out, BaseException):
        raise out
    return out


def _why(conn: KafkaConn) -> str:
    """"; " and the transport's problem found by a direct handshake, or ""."""
    why = diagnose(conn)
    return f"; {why}" if why else ""


def topic_partitions(bootstrap: KafkaConn | str, topics: Iterable[str], timeout_s: float = 20.0) -> dict[str, int]:
    """Partition count of each of ``topics`` that exists (absent ones are left out); creates nothing."""
    from kafka.errors import KafkaError

    topics = list(topics)
    admin = _admin(bootstrap, timeout_s)
    try:
        return _describe(admin, topics)
    except KafkaError as e:
        raise BrokerError(f"cannot describe topics at {bootstrap}: {_reason(e)}") from None
    finally:
        admin.close()


def list_topics(bootstrap: KafkaConn | str, timeout_s: float = 20.0) -> set[str]:
    """The names of the topics the broker has."""
    from kafka.errors import KafkaError

    admin = _admin(bootstrap, timeout_s)
    try:
        return set(admin.list_topics())
    except KafkaError as e:
        raise BrokerError(f"cannot list topics at {bootstrap}: {_reason(e)}") from None
    finally:
        admin.close()


def delete_topics(bootstrap: KafkaConn | str, names: Iterable[str], timeout_s: float = 20.0) -> None:
    """Delete ``names`` (and their records)."""
    from kafka.errors import KafkaError

    admin = _admin(bootstrap, timeout_s)
    try:
        admin.delete_topics(list(names))
    except KafkaError as e:
        raise BrokerError(f"cannot delete topics at {bootstrap}: {_reason(e)}") from None
    finally:
        admin.close()


def _describe(admin, topics: list[str]) -> dict[str, int]:
    out = {}
    for t in admin.describe_topics(topics):
        if t.get("error_code", 0) == 0 and t.get("partitions"):
            out[t["name"]] = len(t["partitions"])
    return out


KNOWN_ROUNDS = 3
"""Consecutive metadata answers that must all hold the new topics before they are taken as known."""


def _known(admin, topics: list[str], timeout_s: float) -> dict[str, int]:
    """The topics' partition counts once the cluster knows them all. A multi-broker Apache Kafka answers
    CreateTopics once its controller took them; the other brokers learn them moments later (a first run on
    three brokers saw none of its new topics right after creating them, all of them 1 s later). Each
    metadata request goes to some broker: several answers in a row, each holding every topic, are taken as
    every broker's. Bounded by ``timeout_s``; what is missing then is the caller's to say."""
    deadline = time.monotonic() + timeout_s
    rounds, counts = 0, {}
    while True:
        counts = _describe(admin, topics)
        rounds = rounds + 1 if len(counts) == len(topics) else 0
        if rounds >= KNOWN_ROUNDS or time.monotonic() > deadline:
            return counts
        time.sleep(0.2 if rounds else 0.5)


def ensure_topics(bootstrap: KafkaConn | str, topics: Iterable[str], partitions: int = DEFAULT_PARTITIONS,
                  timeout_s: float = 20.0, replication_factor: int = 1,
                  min_insync_replicas: int = 0, topic_configs: dict[str, str] | None = None) -> dict[str, int]:
    """Create the topics that do not exist yet (idempotent); returns every topic's partition count.

    New topics get ``partitions`` partitions, ``replication_factor``
    replicas, ``topic_configs`` and, when above 0, ``min_insync_replicas`` (else the broker's
    default). Existing topics are left as they are: ``check_partitions``
    says whether their counts fit the configuration, and one whose ``cleanup.policy`` the broker reports
    differs from ``topic_configs``'s is said once in the log, with the command that changes it (``check_policy``).
    """
    if min_insync_replicas > replication_factor:
        raise BrokerError(f"kafka.min_insync_replicas ({min_insync_replicas}) exceeds kafka.replication_factor "
                          f"({replication_factor}): no write with acks=all could ever succeed")
    from kafka.admin import NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    topics = list(dict.fromkeys(topics))
    admin = _admin(bootstrap, timeout_s)
    try:
        counts = _describe(admin, topics)
        configs = {"min.insync.replicas": str(min_insync_replicas)} if min_insync_replicas > 0 else {}
        configs.update(topic_configs or {})
        new = [NewTopic(t, num_partitions=partitions, replication_factor=replication_factor, topic_configs=configs)
               for t in topics if t not in counts]
        old = [t for t in topics if t in counts]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
            counts = _known(admin, topics, timeout_s)
        policy = (topic_configs or {}).get("cleanup.policy")
        if policy and old:
            check_policy(admin, old, policy, as_conn(bootstrap))
    except KafkaError as e:
        raise BrokerError(f"cannot create topics at {bootstrap}: {_reason(e)}") from None
    finally:
        admin.close()
    missing = [t for t in topics if t not in counts]
    if missing:
        raise BrokerError(f"topics {', '.join(missing)} do not exist at {bootstrap} and could not be created (or "
                          f"were created and not known to every broker within {timeout_s:g} s)")
    return counts


_SAID_POLICY: set[tuple[str, str]] = set()


def topic_policy(admin, topic: str) -> str | None:
    """``topic``'s cleanup.policy as the broker reports it, set or by default; None when it reports none (Tansu
    reports no topic configuration at all, and drops the connection when asked for one by name: all of them are
    asked for)."""
    from kafka.admin import ConfigResource, ConfigResourceType
    from kafka.errors import KafkaError

    try:
        got = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)], config_filter="all")
        entry = got.get("topic", {}).get(topic, {}).get("cleanup.policy")
    except (KafkaError, OSError, ValueError, AttributeError, TypeError) as e:
        log.debug("cleanup.policy of %s not reported: %s", topic, e)
        return None
    value = entry.get("value") if isinstance(entry, dict) else entry
    return None if value is None else str(value)


def check_policy(admin, topics: list[str], wanted: str, conn: KafkaConn) -> None:
    """Say once per process and topic, in the log, that an existing topic's cleanup.policy is not ``wanted``
    (a topic made by an older version), with the command that changes it; never fails: the topic works as it
    is, only unbounded."""
    for t in topics:
        if (conn.bootstrap, t) in _SAID_POLICY:
            continue
        policy = topic_policy(admin, t)
        if policy is None or wanted in policy.split(","):
            continue
        _SAID_POLICY.add((conn.bootstrap, t))
        log.warning("topic %s has cleanup.policy=%s, not %s (made by an older stragglerscope): it grows with every "
                    "record, and every reader reads all of it. Change it with: kafka-configs.sh --bootstrap-server "
                    "%s --alter --entity-type topics --entity-name %s --add-config cleanup.policy=%s (its records "
                    "of before are keyed by job: clear the changes in force first, and set them again after)", t,
                    policy, wanted, conn.bootstrap.split(",")[0], t, wanted)


def check_partitions(counts: dict[str, int], topics: Iterable[str], configured: int) -> int:
    """The partition count the input ``topics`` share; BrokerError when it cannot be used.

    Every record of a job goes to the same partition index of every topic,
    and shard ``i`` reads the partitions ``p % shards == i`` of all of them:
    so the topics must share one count. Fewer partitions than ``configured``
    means topics created by someone else (a broker's auto-creation, a
    restarted broker); more is fine (every partition is read).
    """
    topics = list(topics)
    missing = [t for t in topics if t not in counts]
    if missing:
        raise BrokerError(f"input topic {missing[0]} does not exist (create it with {configured} partitions, "
                          "or start `stragglerscope run`, which creates missing topics)")
    for t in topics:
        if counts[t] < configured:
            raise BrokerError(
                f"topic {t} has {counts[t]} partitions, fewer than kafka.partitions = {configured}: it was "
                f"not created by stragglerscope (a broker's auto-creation or a restarted broker?); add "
                f"partitions (kafka-topics.sh --alter --topic {t} --partitions {configured}) or delete the "
                f"topic so that it is created again, or set kafka.partitions = {counts[t]} if that is intended")
    distinct = sorted({counts[t] for t in topics})
    if len(distinct) > 1:
        listing = ", ".join(f"{t} {counts[t]}" for t in topics)
        raise BrokerError(f"the input topics have different partition counts ({listing}): a job's records "
                          f"must reach one shard, so give every input topic {distinct[-1]} partitions")
    return distinct[0]


def prepare_topics(bootstrap: KafkaConn | str, partitions: int, replication_factor: int = 1, outputs: bool = True,
                   timeout_s: float = 20.0, min_insync_replicas: int = 0) -> int:
    """Create stragglerscope's missing topics; return the input topics' partition count (``check_partitions``).

    ``outputs``: the dead-letter and alert topics too (the pipeline writes them; exporters do not). The
    control topic (one partition: ``core.control``) is created either way: exporters read it.
    """
    from core.topics import (CONTROL_TOPIC_CONFIGS, INPUT_TOPICS, TOPIC_ALERTS, TOPIC_CONTROL, TOPIC_DEAD_LETTER,
                             topic_now)

    wanted = INPUT_TOPICS + ((TOPIC_DEAD_LETTER, TOPIC_ALERTS) if outputs else ())
    gen_s = as_conn(bootstrap).topic_generation_s
    if gen_s:  # the current generation, which producers write to from the start (services.topic_generations)
        wanted += tuple(topic_now(t, gen_s) for t in INPUT_TOPICS)
    counts = ensure_topics(bootstrap, wanted, partitions, timeout_s, replication_factor=replication_factor,
                           min_insync_replicas=min_insync_replicas)
    # Run-time changes, read by the exporters too (so also without ``outputs``): one partition, whoever reads
    # them reads them all, in order; compacted (newest record per scope and setting), so not every change ever made.
    ensure_topics(bootstrap, [TOPIC_CONTROL], 1, timeout_s, replication_factor=replication_factor,
                  min_insync_replicas=min_insync_replicas, topic_configs=CONTROL_TOPIC_CONFIGS)
    return check_partitions(counts, INPUT_TOPICS, partitions)


def end_offsets(bootstrap: KafkaConn | str, partitions: Iterable[tuple[str, int]],
                timeout_s: float = 20.0) -> dict[tuple[str, int], int | None]:
    """Each partition's end offset (the offset its next record gets); None for one that does not exist.

    Read from fetch answers (their high watermark), not ListOffsets: Tansu
    0.6 answers ListOffsets(latest) with the last batch's first offset + 1,
    short of the end whenever that batch holds several records. One small
    fetch per partition, from its beginning. Creates nothing.
    """
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import KafkaError, OffsetOutOfRangeError

    partitions = list(dict.fromkeys(partitions))
    if not partitions:
        return {}
    counts = topic_partitions(bootstrap, {t for t, _ in partitions}, timeout_s)
    present = [TopicPartition(t, p) for t, p in partitions if p < counts.get(t, 0)]
    out: dict[tuple[str, int], int | None] = {tp: None for tp in partitions}
    if not present:
        return out
    try:
        conn = as_conn(bootstrap)
        consumer = KafkaConsumer(bootstrap_servers=conn.bootstrap, client_id="stragglerscope-admin", group_id=None,
                                 enable_auto_commit=False, auto_offset_reset="none", allow_auto_create_topics=False,
                                 kafka_client=KeptClient(KafkaConsumer),
                                 max_partition_fetch_bytes=1024, fetch_max_bytes=64 << 10, **conn.client_options())
    except KafkaError as e:
        raise BrokerError(f"cannot reach Kafka at {conn.describe()}: {_reason(e)}{_why(conn)}") from None
    try:
        consumer.assign(present)
        deadline = time.monotonic() + timeout_s
        pending = set(present)
        restart = present
        while pending:
            for ktp, off in consumer.beginning_offsets(restart).items():
                consumer.seek(ktp, off)
            restart = []
            try:
                consumer.poll(timeout_ms=200)
            except OffsetOutOfRangeError as e:  # trimmed between the two requests: start again
                restart = [k for k in (e.args[0] if e.args else {}) if k in pending]
            for ktp in list(pending):
                hw = consumer.highwater(ktp)
                if hw is not None:
                    out[(ktp.topic, ktp.partition)] = hw
                    pending.discard(ktp)
                    consumer.pause(ktp)
            if pending and time.monotonic() > deadline:
                raise BrokerError(f"no fetch answer from Kafka at {bootstrap} for {len(pending)} partitions "
                                  f"within {timeout_s:.0f} s (e.g. {next(iter(pending))})")
    except KafkaError as e:
        raise BrokerError(f"cannot read end offsets at {bootstrap}: {_reason(e)}") from None
    finally:
        consumer.close()
    return out


def offsets_ahead(stored: dict[tuple[str, int], int],
                  ends: dict[tuple[str, int], int | None]) -> dict[tuple[str, int], tuple[int, int]]:
    """The partitions whose stored offset is beyond their end (a missing partition's end is 0)."""
    out = {}
    for tp, off in sorted(stored.items()):
        end = ends.get(tp) or 0
        if off > end:
            out[tp] = (off, end)
    return out


def check_reachable(bootstrap: KafkaConn | str, timeout_s: float = 5.0) -> None:
    """Raise BrokerError with a one-line reason when no broker answers at ``bootstrap`` (a TCP connect)."""
    for hp in str(bootstrap).split(","):
        host, _, port = hp.strip().rpartition(":")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
                return
        except (OSError, ValueError):
            continue
    raise BrokerError(f"no Kafka broker reachable at {bootstrap}")
