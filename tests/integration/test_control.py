"""Run-time control through the real broker: a change made by the command's functions reaches a training rank's
exporter within a step, and a real traced job's ranks; a shard judges a job's next hang by a threshold changed
while it runs, and stores the change with who made it."""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest

from core.kafka_admin import prepare_topics
from ingest.exporter import RankExporter, Sampling
from actions.control import control_clear, control_set, control_status

pytestmark = pytest.mark.integration

STEP_S = 0.5


@pytest.fixture(scope="module")
def own_broker():
    from services.broker import LocalBroker

    # A broker of its own: a shard reads its input topics from the start, and the session's broker holds
    # every earlier test's records.
    with LocalBroker() as broker:
        prepare_topics(broker.bootstrap, 2)  # the input topics, and the control topic with one partition
        yield broker


class Training:
    """A rank's loop on a thread of its own: steps of STEP_S, one op each, recording which were profiled."""

    def __init__(self, exp: RankExporter):
        self.exp = exp
        self.profiled: dict[int, bool] = {}
        self.step = -1
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        step = 0
        while not self.stop.is_set():
            with self.exp.step(step):
                self.step = step
                self.profiled[step] = self.exp.profiling
                with self.exp.op("compute"):
                    time.sleep(STEP_S)
            step += 1

    def wait_for(self, cond, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return True
            time.sleep(0.02)
        return False


def test_a_sampling_change_reaches_a_running_rank_within_a_step_and_its_end_restores_the_job_s_own(own_broker):
    job = f"ctl-{uuid.uuid4().hex[:8]}"
    sent = []
    exp = RankExporter(job, 0, 0, 0, sent.append, sampling=Sampling(1, 1000), heartbeat_s=3600, use_cuda=False,
                       tcp_flows=False, nvml=False, port_counters=False, peer_timings=False)
    exp.follow_control(own_broker.bootstrap)
    loop = Training(exp)
    loop.thread.start()
    try:
        assert loop.wait_for(lambda: loop.step >= 2, 20)
        assert not any(loop.profiled.get(s) for s in range(1, 3))  # 1/1000: only step 0
        other = control_set(own_broker.bootstrap, "tester", f"{job}-other", {"sample": "1/1"})  # not this job's
        at_step, t0 = loop.step, time.monotonic()
        change = control_set(own_broker.bootstrap, "tester", job, {"sample": "1/1"}, for_s=600)
        assert loop.wait_for(lambda: any(loop.profiled.get(s) for s in range(at_step + 1, loop.step + 1)), 20)
        first = min(s for s in range(at_step + 1, loop.step + 1) if loop.profiled.get(s))
        took = time.monotonic() - t0
        print(f"sampling change published in step {at_step}, first profiled step {first}, after {took:.2f} s")
        # Read by the follower within a step (0.5 s), taken at that step's end: the next step is profiled.
        assert first <= at_step + 2, (at_step, first, loop.profiled)
        assert loop.wait_for(lambda: loop.step >= first + 3, 20)
        assert all(loop.profiled[s] for s in range(first, first + 3))  # every step from then on

        changes, _ = control_status(own_broker.bootstrap, job)
        assert [c.change_id for c in changes] == [change.change_id] and changes[0].who == "tester"
        assert other.change_id in {c.change_id for c in control_status(own_broker.bootstrap)[0]}

        at_step = loop.step
        control_clear(own_broker.bootstrap, "tester", job, change.change_id)
        assert loop.wait_for(lambda: any(loop.profiled.get(s) is False for s in range(at_step + 1, loop.step + 1)), 20)
        back = min(s for s in range(at_step + 1, loop.step + 1) if loop.profiled.get(s) is False)
        assert back <= at_step + 2 and exp.sampling == Sampling(1, 1000)
        assert control_status(own_broker.bootstrap, job)[0] == []
    finally:
        loop.stop.set()
        loop.thread.join(10)
        exp.close()
    assert not exp.control._thread.is_alive()  # closed with the exporter: no thread left behind
    op_windows = {w for t in sent if "optype" in t.column_names for w in t["window_id"].to_pylist()}
    # The steps profiled under the change were sent, each a window of its own (1/1), and no other.
    assert op_windows == {s for s, on in loop.profiled.items() if on} and len(op_windows) >= 4


def test_a_threshold_change_alters_the_next_hang_decision_of_a_shard_and_is_stored(own_broker, tmp_path):
    from core.config import Config
    from ingest.producer import TelemetryProducer
    from ray_jobs.pipeline import result_sink
    from ray_jobs.shard import ShardWorker
    from storage import open_store
    from tests.fakes import ManualClock

    job = f"ctl-hang-{uuid.uuid4().hex[:8]}"
    url = f"chdb://{tmp_path / 'store'}"
    cfg = Config().replace(kafka={"bootstrap": own_broker.bootstrap}, store={"url": url},
                           pipeline={"commit_interval_s": 0.0, "state_interval_s": 0.0,
                                     "state_dir": str(tmp_path / "state")})
    clock = ManualClock()
    with TelemetryProducer(own_broker.bootstrap) as producer:
        exp = RankExporter(job, 0, 0, 0, producer.send, sampling=Sampling(1, 1000), heartbeat_s=3600,
                           use_cuda=False, tcp_flows=False, nvml=False, port_counters=False, peer_timings=False)
        with exp.step(0):
            with exp.op("compute"):
                pass
        exp._beat()  # the rank finished step 0 and then made no progress: a stall from here on
        assert producer.flush(30)
        worker = ShardWorker(0, [0, 1], cfg, f"src-{job}", sink_factory=result_sink(cfg, open_store), clock=clock)
        worker.setup()
        try:
            deadline = time.monotonic() + 40
            while worker.stats.heartbeats < 1 and time.monotonic() < deadline:
                worker.step(poll_timeout_ms=200)
            assert worker.stats.heartbeats >= 1, worker.stats
            clock.t += 5  # the judging clock runs 3 s past the newest heartbeat: a 3 s stall
            worker.step(poll_timeout_ms=0)
            assert worker.stats.hangs == 0  # under the configured threshold (45 s before the pace is known)

            change = control_set(own_broker.bootstrap, "oncall", job, {"hang_floor_s": 2}, for_s=3600)
            deadline = time.monotonic() + 30
            while change.change_id not in worker.control_book.changes and time.monotonic() < deadline:
                worker.step(poll_timeout_ms=200)  # (the other test's changes are on the topic before it)
            assert change.change_id in worker.control_book.changes, worker.stats
            clock.t += 2
            worker.step(poll_timeout_ms=0)
            assert worker.stats.hangs == 1, worker.stats  # the same stall, judged by the job's new threshold
        finally:
            worker.stop()
            exp.close()
    store = open_store(url)
    try:
        hangs = store.query(f"SELECT job_id, kind FROM hangs WHERE job_id = '{job}'").to_pylist()
        rows = store.query(f"SELECT who, what_json, until_ns, when_ns FROM control_changes "
                           f"WHERE change_id = '{change.change_id}'").to_pylist()
    finally:
        store.close()
    assert [h["job_id"] for h in hangs] == [job] and hangs[0]["kind"] == "noncomm_hang"
    assert rows == [dict(who="oncall", what_json='{"hang_floor_s": 2.0}', until_ns=change.until,
                         when_ns=change.when)]


def _job_ops(bootstrap: str, job: str) -> list[dict]:
    """(rank, step, window_id) of every op span of ``job`` on the ops topic so far."""
    from kafka import KafkaConsumer

    from core import codec, topics

    consumer = KafkaConsumer(topics.TOPIC_OPS, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             group_id=None, consumer_timeout_ms=2000)
    try:
        rows = []
        for m in consumer:
            if m.key == job.encode():
                rows += codec.decode(m.value)[1].select(["rank", "step", "window_id"]).to_pylist()
        return rows
    finally:
        consumer.close()


@pytest.mark.slow
def test_a_real_traced_job_follows_a_sampling_change_made_by_the_command_mid_run(own_broker, tmp_path, monkeypatch,
                                                                                  capsys):
    """`stragglerscope trace` of an unchanged 2-rank DDP job on gloo; once its first (and, at 1/1000, only)
    profiled step is on the broker, `stragglerscope control set --sample 1/1` is run: every rank profiles every
    step from within a step or two of it on, and the ranks agree within one step."""
    pytest.importorskip("torch")
    import subprocess
    import sys
    from pathlib import Path

    from services.ports import free_fixed_port
    from stragglerscope.cli import main

    root = Path(__file__).resolve().parents[2]
    job = f"ctl-trace-{uuid.uuid4().hex[:6]}"
    cfg = tmp_path / "kafka.toml"
    cfg.write_text(f'[kafka]\nbootstrap = "{own_broker.bootstrap}"\npartitions = 2\n')
    cmd = [sys.executable, "-m", "stragglerscope", "trace", "--config", str(cfg), "--job-id", job, "--sample",
           "1/1000", "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(free_fixed_port()), str(root / "tests" / "training" / "zoo.py"),
           "--framework", "plain", "--steps", "60", "--gpu-ms", "60"]
    proc = subprocess.Popen(cmd, cwd=root, stdout=open(tmp_path / "trace.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _job_ops(own_broker.bootstrap, job):  # step 0, the only one 1/1000 profiles, is in
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "trace.log").read_text()[-3000:]
        monkeypatch.setenv("STRAGGLERSCOPE_KAFKA_BOOTSTRAP", own_broker.bootstrap)
        # No pipeline runs here, so no store has registered the job: --force, as for a job about to start.
        assert main(["control", "set", "--job", job, "--sample", "1/1", "--for", "10m", "--who", "tester",
                     "--force"]) == 0
        assert "sample=1/1" in capsys.readouterr().out
        assert proc.wait(180) == 0, (tmp_path / "trace.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ops = _job_ops(own_broker.bootstrap, job)
    by_rank: dict[int, set[int]] = {}
    for r in ops:
        assert r["window_id"] == r["step"]  # 1/1000 and 1/1 alike: each profiled step is a window of its own
        by_rank.setdefault(r["rank"], set()).add(r["step"])
    assert sorted(by_rank) == [0, 1], by_rank
    first = {}
    for rank, steps in by_rank.items():
        later = sorted(steps - {0})
        assert later, f"rank {rank} never followed the change: {sorted(steps)}"
        first[rank] = later[0]
        assert later == list(range(later[0], 60)), (rank, later)  # every step from then on, to the job's end
    print(f"first profiled step after the change, per rank: {first}")
    assert first[0] > 1 and abs(first[0] - first[1]) <= 1, first  # made mid-run; the ranks agree within a step
