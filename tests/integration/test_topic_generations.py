"""Input topics in generations on a real Tansu, read by real shards, deleted once read (issue 23, item 3).

The embedded broker frees a record's memory only when its topic is deleted.
Here generations last 6 s: a fleet's windows are produced over about five of
them, a real pipeline (Ray shards, chDB behind its daemon) reads every
generation as it appears, and the keeper deletes the ones read to their end.
Every window must be stored exactly once, no shard may report a Kafka
problem, and only the last generations may be left.
"""
import dataclasses
import time
import uuid

import pytest

from core import topics
from core.kafka_admin import list_topics
from generators.fleetgen import fleet_windows, make_fleet
from ingest.producer import TelemetryProducer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GENERATION_S = 6.0
PARTITIONS = 4


def test_generations_are_read_as_they_appear_and_deleted_once_read(ray_local, tmp_path):
    from core.config import Config
    from ray_jobs.broker_checks import stored_offsets
    from ray_jobs.pipeline import Pipeline
    from services.broker import LocalBroker
    from services.store_daemon import StoreDaemon
    from services.topic_generations import TopicGenerations
    from storage import open_store

    tag = f"gen-{uuid.uuid4().hex[:6]}"
    source = f"src-{tag}"
    jobs = [dataclasses.replace(j, job_id=f"{tag}-{i}") for i, j in enumerate(make_fleet(8, 3, 8, 32))]
    with LocalBroker() as broker, StoreDaemon(f"chdb://{tmp_path / 'store'}") as daemon:
        cfg = Config().replace(kafka={"bootstrap": broker.bootstrap, "partitions": PARTITIONS,
                                      "topic_generation_s": GENERATION_S},
                               store={"url": daemon.url}, pipeline={"shards": 2, "idle_timeout_s": 5.0})
        conn = cfg.kafka.conn()
        keeper = TopicGenerations(conn, PARTITIONS, lambda: stored_offsets(open_store, daemon.url, source)).start()
        store = open_store(daemon.url)
        store.setup()
        pipe = Pipeline(cfg, source, open_store).start()
        try:
            pipe.wait_ready()
            keys, sent_to = [], set()
            t0 = time.monotonic()
            with TelemetryProducer(conn) as p:
                for j in jobs:
                    p.send(j.registration(0, 2))
                for i, (spec, wid, table) in enumerate(fleet_windows(jobs, 10, 2, 0)):
                    # One window of every job every 2.5 s: the fleet spans about five generations.
                    while time.monotonic() < t0 + i // len(jobs) * 2.5:
                        time.sleep(0.05)
                    p.send(table)
                    sent_to.add(topics.topic_now(topics.TOPIC_OPS, GENERATION_S))
                    keys.append((spec.job_id, 0, wid))
                assert p.flush(60)
            assert len(sent_to) >= 3, sent_to

            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                stored = store.query("SELECT count() AS n FROM windows WHERE startsWith(job_id, {t:String})",
                                     {"t": tag}).column("n")[0].as_py()
                left = {t for t in list_topics(conn) if topics.split_generation(t)[1] is not None}
                if stored >= len(keys) and not (sent_to - {max(sent_to)}) & left:
                    break
                time.sleep(0.5)
            statuses = pipe.status()
        finally:
            pipe.stop()
            keeper.stop()
        assert sum(store.window_stored(k) for k in keys) == len(keys), statuses
        assert stored == len(keys), f"each window exactly once: {stored} rows for {len(keys)} windows"
        assert not [s["error"] for s in statuses if s.get("error")], [s.get("error") for s in statuses]
        # Every generation written to but the last was read to its end and deleted; the rest of the
        # families' generations went with them.
        gone = set(keeper.deleted)
        assert sent_to - {max(sent_to)} <= gone, (sorted(sent_to), sorted(gone), sorted(left))
        current = topics.generation(time.time(), GENERATION_S)
        assert all(topics.split_generation(t)[1] >= current - 3 for t in left), sorted(left)
        store.close()
