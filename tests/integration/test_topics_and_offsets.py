"""Topics checked at start, every partition read, a broker that lost its data stops the pipeline (issue 18).

Each test runs its own Tansu broker (the topics' partition counts are the
subject, and the session broker's topics must stay as they are), the store
behind its daemon and the session's local Ray.
"""
import dataclasses
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from core import topics
from core.kafka_admin import BrokerError, OffsetsAheadError, ensure_topics, topic_partitions
from generators.fleetgen import fleet_windows, make_fleet
from ingest.producer import TelemetryProducer
from services.broker import LocalBroker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _jobs_on(partitions: list[int], count: int, tag: str) -> list:
    """Small fleet jobs whose ids the producer's partitioner puts on ``partitions`` (murmur2 of the key)."""
    from kafka.partitioner.default import murmur2

    base = make_fleet(len(partitions), 3, 8, 16)
    out = []
    for want, spec in zip(partitions, base):
        i = 0
        while (murmur2(f"{tag}-{want}-{i}".encode()) & 0x7fffffff) % count != want:
            i += 1
        out.append(dataclasses.replace(spec, job_id=f"{tag}-{want}-{i}"))
    return out


def _produce(bootstrap: str, jobs) -> list[tuple[str, int, int]]:
    keys = []
    with TelemetryProducer(bootstrap) as p:
        for j in jobs:
            p.send(j.registration(0, 2))
        for spec, wid, table in fleet_windows(jobs, 1, 2, 0):
            p.send(table)
            keys.append((spec.job_id, 0, wid))
        assert p.flush(60)
        assert p.stats.records_dropped == 0
    return keys


def _config(bootstrap: str, store_url: str, partitions: int, shards: int, source_id: str):
    from core.config import Config

    return Config().replace(kafka={"bootstrap": bootstrap, "partitions": partitions, "source_id": source_id},
                            store={"url": store_url}, pipeline={"shards": shards, "idle_timeout_s": 5.0})


def _wait_stored(store, keys, pipe, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(store.window_stored(k) for k in keys):
            return
        time.sleep(0.3)
    raise AssertionError(f"windows not stored: {[k for k in keys if not store.window_stored(k)]}; {pipe.status()}")


def _analyse(cfg, source: str, store, keys):
    """A pipeline over the topics until ``keys`` are stored, then stopped (which stores the final offsets)."""
    from ray_jobs.pipeline import Pipeline
    from storage import open_store

    pipe = Pipeline(cfg, source, open_store).start()
    try:
        _wait_stored(store, keys, pipe)
    finally:
        pipe.stop()
    return pipe


def _cli(*args, timeout=120, stdin=subprocess.DEVNULL):
    return subprocess.run([sys.executable, "-m", "stragglerscope", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, stdin=stdin,
                          env=dict(os.environ, STRAGGLERSCOPE_PIPELINE_METRICS_PORT="-1"))


def _toml(path: Path, bootstrap: str, store_url: str, partitions: int, source_id: str) -> str:
    path.write_text(f'[kafka]\nbootstrap = "{bootstrap}"\npartitions = {partitions}\nsource_id = "{source_id}"\n'
                    f'[store]\nurl = "{store_url}"\n[pipeline]\nshards = 1\nmetrics_port = -1\n')
    return str(path)


def test_fewer_partitions_than_configured_is_a_one_line_error(tmp_path):
    from ray_jobs.pipeline import Pipeline
    from storage import open_store

    with LocalBroker() as broker:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        with pytest.raises(BrokerError, match=r"topic ss\.\w+ has 2 partitions, fewer than kafka.partitions = 4"):
            Pipeline(_config(broker.bootstrap, "chdb://unused", 4, 2, "few"), "few", open_store).start()
        r = _cli("run", "--config", _toml(tmp_path / "c.toml", broker.bootstrap, f"chdb://{tmp_path / 's'}", 4, "few"))
        assert r.returncode == 2, r.stderr
        err = r.stderr.strip().splitlines()
        assert "has 2 partitions, fewer than kafka.partitions = 4" in err[-1] and "Traceback" not in r.stderr
        assert err[-1].startswith("stragglerscope run: error:"), r.stderr


def test_clients_never_create_topics():
    """Consumers and producers asking about a missing topic leave it missing (Tansu creates any topic a
    metadata request names unless the request says not to)."""
    from ray_jobs.kafka_source import KafkaSource

    with LocalBroker() as broker:
        src = KafkaSource(broker.bootstrap, [topics.TOPIC_OPS], range(2))
        src.seek({})
        src.poll(300)
        src.lag()
        with TelemetryProducer(broker.bootstrap, delivery_timeout_s=2.0) as p:
            p.send(make_fleet(1, 0, 8, 8)[0].registration(0, 2))
            p.flush(15)
        assert topic_partitions(broker.bootstrap, topics.INPUT_TOPICS) == {}, "no client created a topic"
        assert src.problems and all("does not exist" in line for line in src.problems)
        src.close()


def test_records_on_partitions_beyond_the_configured_count_are_analysed(ray_local, tmp_path):
    """Topics with 6 partitions, kafka.partitions = 4: the jobs on partitions 4 and 5 are analysed too."""
    from ray_jobs.pipeline import Pipeline
    from services.store_daemon import StoreDaemon
    from storage import open_store

    with LocalBroker() as broker, StoreDaemon(f"chdb://{tmp_path / 'store'}") as daemon:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 6)
        jobs = _jobs_on([4, 5, 1], 6, f"more-{uuid.uuid4().hex[:4]}")
        keys = _produce(broker.bootstrap, jobs)
        store = open_store(daemon.url)
        store.setup()
        pipe = Pipeline(_config(broker.bootstrap, daemon.url, 4, 2, "more"), "more", open_store).start()
        try:
            assert pipe.partitions == 6
            pipe.wait_ready()
            _wait_stored(store, keys, pipe)
        finally:
            pipe.stop()
        store.close()


def test_a_broker_restarted_empty_stops_the_next_start_until_offsets_are_reset(ray_local, tmp_path):
    from ray_jobs.broker_checks import stored_offsets
    from ray_jobs.pipeline import Pipeline
    from services.store_daemon import StoreDaemon
    from storage import open_store

    source = f"restart-{uuid.uuid4().hex[:6]}"
    broker = LocalBroker().start()
    port = broker.port
    try:
        with StoreDaemon(f"chdb://{tmp_path / 'store'}") as daemon:
            store = open_store(daemon.url)
            store.setup()
            cfg = _config(broker.bootstrap, daemon.url, 2, 1, source)
            toml = _toml(tmp_path / "c.toml", broker.bootstrap, daemon.url, 2, source)

            ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
            first = _produce(broker.bootstrap, _jobs_on([0, 1], 2, "before"))
            _analyse(cfg, source, store, first)
            assert any(off > 0 for off in stored_offsets(open_store, daemon.url, source).values())

            broker.stop()
            broker = LocalBroker(port=port).start()  # same address, empty

            with pytest.raises(OffsetsAheadError, match="stragglerscope offsets reset") as e:
                Pipeline(cfg, source, open_store).start()
            assert e.value.ahead and all(end == 0 for _, end in e.value.ahead.values())
            r = _cli("run", "--config", toml)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
            assert "lost records" in r.stderr.strip().splitlines()[-1]

            r = _cli("offsets", "show", "--config", toml)
            assert r.returncode == 1 and "BEYOND THE END" in r.stdout, r.stdout + r.stderr
            r = _cli("offsets", "reset", "--config", toml)
            assert r.returncode == 2 and "add --yes" in r.stderr, r.stderr
            r = _cli("offsets", "reset", "--config", toml, "--yes")
            assert r.returncode == 0, r.stderr
            assert not any(stored_offsets(open_store, daemon.url, source).values())

            second = _produce(broker.bootstrap, _jobs_on([0, 1], 2, "after"))
            _analyse(cfg, source, store, second)
            store.close()
    finally:
        broker.stop()


def test_a_running_source_reports_a_topic_created_again_under_it():
    """The broker restarts empty and gets more records than the source had read: no offset is beyond
    the end, but the topic id changed; the source must not read on as if nothing happened."""
    from ray_jobs.kafka_source import KafkaSource

    broker = LocalBroker().start()
    port = broker.port
    try:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        _produce(broker.bootstrap, _jobs_on([0, 1], 2, "a"))
        src = KafkaSource(broker.bootstrap, [topics.TOPIC_OPS], range(2), check_interval_s=0.0)
        src.seek({})
        # Nothing read yet: both partitions are behind (the hang monitor's per-partition clock asks).
        assert src.lag() > 0 and src.unread() == {(topics.TOPIC_OPS, 0), (topics.TOPIC_OPS, 1)}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(src.positions().values()):
            for m in src.poll(300):
                src.advance((m.topic, m.partition), m.offset + 1)
        assert all(src.positions().values()) and src.lag() == 0 and src.problems == [] and src.unread() == set()

        broker.stop()
        broker = LocalBroker(port=port).start()
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        for _ in range(3):
            _produce(broker.bootstrap, _jobs_on([0, 1], 2, f"b{_}"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(src.problems) < 2:
            src.poll(300)
            src.lag()
        assert len(src.problems) == 2, src.problems
        assert all(any(w in p for w in ("created again", "lost records", "does not exist")) for p in src.problems)
        src.close()
    finally:
        broker.stop()


def _stored_windows(store, source_keys):
    return [k for k in source_keys if store.window_stored(k)]


def test_a_broker_restarted_empty_that_grew_past_the_old_offsets_is_never_read_on_silently(ray_local, tmp_path):
    """Issue 39: after the broker lost its data, producers kept sending while the pipeline was down and the
    new partitions grew past the stored offsets. Every offset is within its partition's end, so the old
    check saw nothing, and the records below the old offsets were never read. The offsets carry the log
    they were read from: the start refuses (on_lost_log = stop), or rewinds with an audit row and reads
    every new record (on_lost_log = rewind)."""
    from core.kafka_admin import LogChangedError, end_offsets
    from ray_jobs.broker_checks import stored_offsets
    from ray_jobs.pipeline import Pipeline
    from services.store_daemon import StoreDaemon
    from storage import open_store

    source = f"grown-{uuid.uuid4().hex[:6]}"
    broker = LocalBroker().start()
    port = broker.port
    try:
        with StoreDaemon(f"chdb://{tmp_path / 'store'}") as daemon:
            store = open_store(daemon.url)
            store.setup()
            cfg = _config(broker.bootstrap, daemon.url, 2, 1, source)
            ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
            first = _produce(broker.bootstrap, _jobs_on([0, 1], 2, "before"))
            _analyse(cfg, source, store, first)
            old = stored_offsets(open_store, daemon.url, source)
            assert any(off > 0 for off in old.values())

            broker.stop()
            broker = LocalBroker(port=port).start()  # same address, empty
            ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
            later = []
            for i in range(4):
                later += _produce(broker.bootstrap, _jobs_on([0, 1], 2, f"later{i}"))
            ends = end_offsets(broker.bootstrap, old)
            assert all(ends[tp] >= off for tp, off in old.items()), "the silent case: no offset beyond an end"

            with pytest.raises(LogChangedError, match=r"read from other logs .*stragglerscope offsets reset"):
                Pipeline(cfg, source, open_store).start()
            toml = _toml(tmp_path / "c.toml", broker.bootstrap, daemon.url, 2, source)
            r = _cli("run", "--config", toml)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
            assert "lost records" in r.stderr.strip().splitlines()[-1]
            r = _cli("offsets", "show", "--config", toml)
            assert r.returncode == 1 and "LOG LOST" in r.stdout, r.stdout + r.stderr

            pipe = _analyse(cfg.replace(kafka={"on_lost_log": "rewind"}), source, store, later)  # every new record
            assert {(r["topic"], r["partition"]) for r in pipe.offset_resets} == {
                tp for tp, off in old.items() if off > 0}
            audit = store.query("SELECT topic, `partition`, from_offset, to_offset, by FROM offset_resets")
            assert sorted(audit.column("by").to_pylist()) == ["start"] * len(pipe.offset_resets)
            assert all(r["to_offset"] == 0 and r["from_offset"] > 0 for r in audit.to_pylist())
            store.close()
    finally:
        broker.stop()


def test_a_running_source_rewinds_a_lost_log_when_told_to():
    """kafka.on_lost_log = rewind while running: the partition whose topic was created again is read from the
    new log's start, and the move is kept for the audit."""
    from ray_jobs.kafka_source import KafkaSource

    broker = LocalBroker().start()
    port = broker.port
    try:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        _produce(broker.bootstrap, _jobs_on([0, 1], 2, "a"))
        src = KafkaSource(broker.bootstrap, [topics.TOPIC_OPS], range(2), check_interval_s=0.0,
                          on_lost_log="rewind")
        src.seek({})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(src.positions().values()):
            for m in src.poll(300):
                src.advance((m.topic, m.partition), m.offset + 1)
        old = src.positions()
        old_logs = src.log_ids()
        assert all(old.values()) and all(old_logs.values())

        broker.stop()
        broker = LocalBroker(port=port).start()
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        for i in range(3):
            _produce(broker.bootstrap, _jobs_on([0, 1], 2, f"b{i}"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(src.lost_logs()) < 2:
            for m in src.poll(300):
                src.advance((m.topic, m.partition), m.offset + 1)
            src.lag()
        assert len(src.lost_logs()) == 2 and src.problems == [], (src.lost_logs(), src.problems)
        for tp in src.lost_logs():
            assert src.rewind(tp, by="shard 0") == 0
        resets = src.take_resets()
        assert {(r["topic"], r["partition"]) for r in resets} == set(old)
        assert all(r["from_log_id"] == old_logs[(r["topic"], r["partition"])] != r["to_log_id"] for r in resets)
        seen = {tp: set() for tp in old}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and src.lag():
            for m in src.poll(300):
                seen[(m.topic, m.partition)].add(m.offset)
                src.advance((m.topic, m.partition), m.offset + 1)
        for tp, offs in seen.items():
            assert min(offs) == 0 and offs == set(range(max(offs) + 1)), "every record of the new log"
        assert src.log_ids() != old_logs
        src.close()
    finally:
        broker.stop()


def test_replay_publish_only_feeds_a_running_pipeline_without_taking_it_over(ray_local, tmp_path):
    """Issue 39: `replay` started a driver of its own, which took the shards over from a running `run`. With
    --publish-only it only publishes; --wait then watches the running pipeline store every window."""
    from ray_jobs.pipeline import Pipeline
    from services.store_daemon import StoreDaemon
    from storage import open_store

    golden = str(ROOT / "tests" / "golden" / "whatif" / "ST")
    source = f"pub-{uuid.uuid4().hex[:6]}"
    with LocalBroker() as broker, StoreDaemon(f"chdb://{tmp_path / 'store'}") as daemon:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
        pipe = Pipeline(_config(broker.bootstrap, daemon.url, 2, 1, source), source, open_store).start()
        try:
            pipe.wait_ready()
            toml = _toml(tmp_path / "c.toml", broker.bootstrap, daemon.url, 2, source)
            r = _cli("replay", "--publish-only", "--wait", "--timeout", "180", "--config", toml, golden, timeout=240)
            assert r.returncode == 0, r.stderr
            assert "published  1 traces" in r.stderr and "stored     1 windows" in r.stderr, r.stderr
            assert "ray " not in r.stderr and "broker     Tansu" not in r.stderr  # no driver, no services of its own
            assert pipe.check_health() and pipe.status()[0].get("windows_stored", 0) >= 1  # still ours, and it did it
        finally:
            pipe.stop()
    r = _cli("replay", "--publish-only", golden)  # no Kafka configured: one line, before anything starts
    assert r.returncode == 2 and "needs the running pipeline's Kafka" in r.stderr.strip().splitlines()[-1]
    r = _cli("replay", "--wait", golden)
    assert r.returncode == 2 and "--wait goes with --publish-only" in r.stderr
