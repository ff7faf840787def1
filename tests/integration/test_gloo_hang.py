"""A real hang: a gloo DP2 x PP2 training job whose rank 1 is SIGSTOPped mid-training.

Real processes, real gloo collectives, real exporter and producer, real Tansu.
The shard's hang monitor, fed from Kafka, must call it a communication hang
with rank 1 missing, and merge the stacks its peers dumped while waiting.
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from analyzers.hang import HangParams
from core import codec, topics
from core.kafka_admin import ensure_topics
from ray_jobs.hang_monitor import HangReducer
from ray_jobs.kafka_source import KafkaSource

pytestmark = pytest.mark.integration


def test_sigstopped_rank_is_the_missing_rank_of_a_comm_hang(broker):
    pytest.importorskip("torch")
    ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 4)
    job = f"gloo-hang-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.train_gloo", "--bootstrap", broker.bootstrap, "--job-id", job,
         "--steps", "8", "--stop-rank", "1", "--stop-at-step", "3", "--heartbeat-s", "0.5",
         "--hang-dump-s", "2", "--dist-timeout", "90"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    # The job stops at step 3, before its ranks know their pace: the floor (8 s here, 45 s by default) is the
    # threshold. Who is missing follows the defaults: a peer whose heartbeat thread is starved for seconds on
    # a loaded 2-core machine is not missing before silent_s (6 s), and the stopped rank would become a loss
    # only after heartbeat_timeout_s (30 s).
    monitor = HangReducer(HangParams(floor_s=8.0), every_s=0.5)
    src = KafkaSource(broker.bootstrap, [topics.TOPIC_HEARTBEATS, topics.TOPIC_CCL], range(4))
    src.seek({})
    hangs = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not hangs:
            for m in src.poll(300):
                kind, t = codec.decode(m.value)
                t = t.filter(__import__("pyarrow.compute").compute.equal(t["job_id"], job))
                if not t.num_rows:
                    continue
                if kind == "heartbeat":
                    monitor.add_heartbeats(t, time.monotonic())
                elif kind == "ccl_record":
                    monitor.add_ccl(t, time.monotonic())
            hangs = monitor.evaluate(time.monotonic()).to_pylist()
            assert proc.poll() is None or hangs, proc.stdout.read().decode()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        src.close()
    assert hangs, "no hang detected within 120 s"
    h = hangs[0]
    assert h["kind"] == "comm_hang", (str({k: v for k, v in h.items() if k != "evidence_json"}), json.loads(h["evidence_json"]).get("states"), proc.stdout.read().decode()[-2000:] if proc.stdout else "")
    assert h["missing_ranks"] == "1", h
    assert "1" not in h["stuck_ranks"].split(",")
    evidence = json.loads(h["evidence_json"])
    assert evidence["wait_chain"]["root"] == "1"
    stacks = evidence["stacks_folded"]
    assert stacks, "the waiting peers dumped their stacks"
    assert "train_gloo.py" in stacks and "[ranks " in stacks
    assert "1" not in evidence["ranks_with_stacks"].split(","), "a stopped rank cannot dump"
    assert evidence["stacks_svg"].startswith("<svg") and "train_gloo.py" in evidence["stacks_svg"]
