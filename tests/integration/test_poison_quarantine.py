"""A message that kills its shard's process is quarantined after a bounded number of deaths.

Reproduces the crash loop of issue 18 with a real crash: the shard runs in a
child process whose decoder segfaults on one payload (``crashing_shard.py``).
Each run is a restart, as Ray would do. Before quarantine the shard died on
the same offset forever and its partition stalled.
"""
from __future__ import annotations

import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core import codec, topics
from core.layout import JobLayout
from generators.fleetgen import JobSpec, generate_window
from ray_jobs.kafka_source import Message
from tests.integration.crashing_shard import POISON

ROOT = Path(__file__).resolve().parents[2]


def _messages() -> list[Message]:
    jobs = [JobSpec(j, JobLayout(2, 2), num_microbatches=4) for j in ("before", "after")]
    regs = [Message(topics.TOPIC_JOBS, 0, i, j.job_id.encode(), codec.encode(j.registration(0, 2)))
            for i, j in enumerate(jobs)]
    ops = [Message(topics.TOPIC_OPS, 0, 0, b"before", codec.encode(generate_window(jobs[0], 0, 2, 0))),
           Message(topics.TOPIC_OPS, 0, 1, b"poison", POISON + b" the rest does not matter"),
           Message(topics.TOPIC_OPS, 0, 2, b"after", codec.encode(generate_window(jobs[1], 0, 2, 0)))]
    return regs + ops


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_a_message_that_segfaults_the_shard_is_quarantined_after_three_deaths(tmp_path):
    msgs, store, state = tmp_path / "messages.pickle", tmp_path / "store.pickle", tmp_path / "state"
    msgs.write_bytes(pickle.dumps(_messages()))
    codes = []
    for _ in range(6):  # Ray would restart forever; bounded here
        proc = subprocess.run([sys.executable, str(ROOT / "tests/integration/crashing_shard.py"), str(msgs),
                               str(store), str(state)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        codes.append(proc.returncode)
        if proc.returncode == 0:
            break
    assert codes == [-signal.SIGSEGV] * 3 + [0], (codes, proc.stderr[-2000:])
    rows, offsets, _logs, _states = pickle.loads(store.read_bytes())
    (dead,) = [r for r in rows["dead_letter"] if r["source_offset"] == 1]
    assert dead["source_topic"] == topics.TOPIC_OPS and "quarantined" in dead["reason"] and "3 times" in dead["reason"]
    stored = sorted(r["job_id"] for r in rows["window"])
    assert stored == ["after", "before"], "the messages on both sides of the poison are analysed"
    assert offsets["crashing"][(topics.TOPIC_OPS, 0)] == 3, "the partition moved past the poison"
