"""A real hang through the whole pipeline: gloo job -> Kafka -> Ray shard -> store -> alert, in seconds.

Rank 1 of a gloo DP2 x PP2 job SIGSTOPs itself. The hang row and a critical
alert must be stored within the hang threshold plus 5 s of the job's last
progress (issue 5, "Speed").
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from core import topics
from core.kafka_admin import ensure_topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The detector's own defaults for who is missing: a peer whose heartbeat thread is starved for seconds on a
# loaded 2-core machine is not missing before silent_s (6 s); the stopped rank, named by its watch at once,
# would become a process loss only after heartbeat_timeout_s (30 s), long after the stall is judged.
# k = 1 keeps the threshold at the floor (8 s) until the job's pace is known, then min_s (8 s) holds it:
# step-time scaling is the unit tests' business, and here it made the threshold depend on how slow the
# machine was.
FLOOR_S = 8.0
# The shards' view each second, to explain a slow detection.
HEALTH = ("messages", "heartbeats", "heartbeat_age_s", "heartbeat_silence_s", "hang_clock_held_back_s",
          "loop_seconds_max")


def _caught_up_pipeline(broker, daemon, **hang):
    """Two shards over 4 partitions, hang thresholds at the floor (``hang``: more of its settings), polling with
    no lag (the job must not start before its shard listens: answering status is not polling, so it waits for
    a measured lag of 0)."""
    from core.config import Config
    from ray_jobs.pipeline import Pipeline
    from storage import open_store

    cfg = Config().replace(
        kafka={"bootstrap": broker.bootstrap, "partitions": 4}, store={"url": daemon.url},
        pipeline={"shards": 2, "idle_timeout_s": 60.0},
        hang={"floor_s": FLOOR_S, "k_steps": 1.0, **hang})
    pipe = Pipeline(cfg, f"src-{uuid.uuid4().hex[:6]}", open_store).start()
    pipe.wait_ready()
    assert pipe.wait(Pipeline.caught_up, timeout_s=120), ("the shards never caught up", pipe.status())
    return pipe


def test_hang_alert_is_stored_within_threshold_plus_5s(ray_local, tmp_path, artifacts):
    pytest.importorskip("torch")
    from services.broker import LocalBroker
    from services.store_daemon import StoreDaemon
    from storage import open_store

    # A broker of its own: the session's broker holds every earlier test's records, and a new
    # pipeline reads them from the start. That backlog (about 1,400 messages, then the idle-timeout
    # analyses of dozens of dead jobs) delayed detection to 14.6 s in CI. This test measures the
    # detection latency of a caught-up pipeline; catching up is test_topics_and_offsets' business.
    with LocalBroker() as broker, StoreDaemon(f"chdb://{tmp_path / 'store'}") as daemon:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 4)
        job = f"pipe-hang-{uuid.uuid4().hex[:6]}"
        store = open_store(daemon.url)
        store.setup()
        pipe = _caught_up_pipeline(broker, daemon)
        proc = subprocess.Popen(
            [sys.executable, "-m", "examples.train_gloo", "--bootstrap", broker.bootstrap, "--job-id", job,
             "--steps", "30", "--stop-rank", "1", "--stop-at-step", "6", "--heartbeat-s", "0.5",
             "--hang-dump-s", "2", "--dist-timeout", "120"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 150
            rows, health, next_status = [], [], 0.0
            while time.monotonic() < deadline and not rows:
                rows = store.run_named("job_hangs", {"job_id": job}).to_pylist()
                if time.monotonic() >= next_status:
                    health.append([tuple(round(st.get(k, -1), 2) for k in HEALTH) for st in pipe.status()])
                    next_status = time.monotonic() + 1.0
                time.sleep(0.25)
            seen_ns = time.time_ns()
            alerts = store.run_named("alert_history", {"job_id": job, "rule": "hang"}).to_pylist()
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            pipe.stop()
            store.close()
    assert rows, "no hang stored"
    h = rows[-1]  # the first hang found (newest first), which raised the alert
    brief = [{k: r[k] for k in ("kind", "group", "seq", "missing_ranks", "stuck_ranks", "since_ns", "hang_id")}
             | {"wait_chain": json.loads(r["evidence_json"])["wait_chain"]} for r in rows]
    assert h["kind"] == "comm_hang" and h["missing_ranks"] == "1", brief
    # The alert of this very hang (its id ends with the hang id), not of an earlier one.
    mine = [a for a in alerts if a["alert_id"].endswith(f"/{h['hang_id']}")]
    assert mine and mine[0]["severity"] == "critical", (brief, [a["alert_id"] for a in alerts])
    threshold = json.loads(h["evidence_json"])["threshold_s"]
    latency = (mine[0]["ts_ns"] - h["since_ns"]) / 1e9
    stored_after = (seen_ns - h["since_ns"]) / 1e9
    # Where the time went: the hang id is the (input-clamped) evaluation time, so the stall the
    # monitor saw (duration) plus how far its clock was held behind the wall by lagging
    # heartbeats (hold-back) make up the latency.
    held_back = (mine[0]["ts_ns"] - h["hang_id"]) / 1e9
    (artifacts / "pipeline_hang_latency.txt").write_text(
        f"threshold {threshold:.1f} s; alert raised {latency:.2f} s and seen in the store "
        f"<= {stored_after:.2f} s after the last progress (stall seen {h['duration_s']:.2f} s, "
        f"clock held back {held_back:.2f} s by input lag)\n")
    # Shown in full on failure (an assertion message is cut short).
    print("per shard", HEALTH, "each second:\n" + "\n".join(map(str, health)))
    assert latency <= threshold + 5.0, (latency, threshold, h["duration_s"], held_back,
                                        HEALTH, "per shard, each second:", health)
    assert stored_after <= threshold + 5.0 + 0.5, (stored_after, threshold)


def _stopped_rank(proc) -> bool:
    """Whether a rank of the job has SIGSTOPped itself (the hang began)."""
    import psutil

    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    return any(k.status() == psutil.STATUS_STOPPED for k in kids if k.is_running())


def test_a_shard_killed_during_and_after_a_hang_stores_it_once(ray_local, tmp_path):
    """Issue 39: hang and downtime state must survive kill -9 of the shard that owns the job. The owner is
    killed during the hang's grace period and again right after the hang is stored: the hang is found once,
    in time, with one alert (before, a restarted shard forgot what it had reported and stored the same hang
    again under a new id)."""
    pytest.importorskip("torch")
    from kafka.partitioner.default import murmur2

    from services.broker import LocalBroker
    from services.store_daemon import StoreDaemon
    from storage import open_store

    with LocalBroker() as broker, StoreDaemon(f"chdb://{tmp_path / 'store'}") as daemon:
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 4)
        job = f"kill-hang-{uuid.uuid4().hex[:6]}"
        owner = ((murmur2(job.encode()) & 0x7fffffff) % 4) % 2
        store = open_store(daemon.url)
        store.setup()
        # The test outlasts the 30 s after which the stopped rank would become a process loss, a second row
        # by design (tests/diagnosis/test_hang_states.py): here only the comm hang is counted, so that waits.
        pipe = _caught_up_pipeline(broker, daemon, heartbeat_timeout_s=300.0)

        def kill_owner() -> None:
            pid = ray_local.get(pipe.actors[owner].pid.remote(), timeout=60)
            os.kill(pid, signal.SIGKILL)

        proc = subprocess.Popen(
            [sys.executable, "-m", "examples.train_gloo", "--bootstrap", broker.bootstrap, "--job-id", job,
             "--steps", "30", "--stop-rank", "1", "--stop-at-step", "6", "--heartbeat-s", "0.5",
             "--hang-dump-s", "2", "--dist-timeout", "300"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not _stopped_rank(proc):
                time.sleep(0.2)
            assert _stopped_rank(proc), "rank 1 never stopped"
            time.sleep(3.0)
            kill_owner()  # inside the 8 s grace
            rows = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not rows:
                rows = store.run_named("job_hangs", {"job_id": job}).to_pylist()
                time.sleep(0.25)
            assert rows, ("no hang stored", pipe.status())
            time.sleep(1.0)
            kill_owner()  # right after: the next 10 s snapshot was not due yet
            # Long enough for the restarted shard to judge the (still hung) job again several times.
            time.sleep(3 * FLOOR_S)
            rows = store.run_named("job_hangs", {"job_id": job}).to_pylist()
            alerts = store.run_named("alert_history", {"job_id": job, "rule": "hang"}).to_pylist()
            status = pipe.status()
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            pipe.stop()
            store.close()
    brief = [(r["kind"], r["missing_ranks"], r["hang_id"]) for r in rows]
    assert len(rows) == 1 and rows[0]["kind"] == "comm_hang" and rows[0]["missing_ranks"] == "1", brief
    assert len(alerts) == 1, [a["alert_id"] for a in alerts]
    assert status[owner].get("loops", 0) > 0, status  # the owner is back and polling
