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


# The job's steps (--gpu-ms 60, 2 layers) took about 0.35 s each beside the shard on 2 shared cores: the window the
# command waits for (step 5's) was stored at about step 20, and the command chose step 36 (the lead,
# core.control.STEP_LEAD_S = 5 s, is 14 such steps). 80 steps leave 40 of the new sampling after it to check, and
# room for a slower machine; the 60 the test had with --force (each rank's next step end) would leave about 20.
TRACED_STEPS = 80
TRACED_EVERY = 5  # --sample 1/5: one window every 5 steps before the change, each a step of its own


@pytest.mark.slow
def test_a_real_traced_job_takes_a_sampling_change_made_by_the_command_from_the_step_it_chose(
        own_broker, tmp_path, monkeypatch, capsys):
    """`stragglerscope trace` of an unchanged 2-rank DDP job on gloo, profiled 1 step in 5, read by a shard that
    stores its registration and windows. Once the store has a window of its steady steps, `stragglerscope control
    set --sample 1/1` (no --force) is run: it chooses the step the change starts from (``from_step``) from that
    window, every rank profiles exactly the steps from it on and none before it but its own 1-in-5, no rank
    hears of it late, and the pipeline stores the change with that step."""
    pytest.importorskip("torch")
    import re
    import subprocess
    import sys
    from pathlib import Path

    from core.config import Config
    from ray_jobs.pipeline import result_sink
    from ray_jobs.shard import ShardWorker
    from services.ports import free_fixed_port
    from storage import open_store
    from stragglerscope.cli import main

    root = Path(__file__).resolve().parents[2]
    job = f"ctl-trace-{uuid.uuid4().hex[:6]}"
    url = f"chdb://{tmp_path / 'store'}"
    log_path = tmp_path / "trace.log"
    cfg = tmp_path / "kafka.toml"
    cfg.write_text(f'[kafka]\nbootstrap = "{own_broker.bootstrap}"\npartitions = 2\n')
    cmd = [sys.executable, "-m", "stragglerscope", "trace", "--config", str(cfg), "--job-id", job, "--sample",
           f"1/{TRACED_EVERY}", "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_fixed_port()),
           str(root / "tests" / "training" / "zoo.py"), "--framework", "plain", "--steps", str(TRACED_STEPS),
           "--gpu-ms", "60"]
    proc = subprocess.Popen(cmd, cwd=root, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    # The pipeline's shard, in this process: set up while the job starts (it reads its topics from the start).
    pipe = Config().replace(kafka={"bootstrap": own_broker.bootstrap}, store={"url": url},
                            pipeline={"commit_interval_s": 0.0, "state_interval_s": 0.0,
                                      "state_dir": str(tmp_path / "state")})
    worker = ShardWorker(0, [0, 1], pipe, f"src-{job}", sink_factory=result_sink(pipe, open_store))
    store = None
    try:
        worker.start()
        store = open_store(url)  # the shard's session, shared in this process
        # Window 0 holds the job's first step (gloo's first all-reduce, the tracer's start): its step time says
        # nothing of the steps after it, so the command waits for a window after it, as it would mid-run.
        deadline = time.monotonic() + 120
        while not store.query("SELECT count() AS n FROM windows WHERE job_id = {job:String} AND window_id > 0",
                              {"job": job}).column("n")[0].as_py():
            assert proc.poll() is None and time.monotonic() < deadline, (worker.stats, log_path.read_text()[-3000:])
            time.sleep(0.2)
        monkeypatch.setenv("STRAGGLERSCOPE_KAFKA_BOOTSTRAP", own_broker.bootstrap)
        monkeypatch.setenv("STRAGGLERSCOPE_STORE_URL", url)
        assert main(["control", "set", "--job", job, "--sample", "1/1", "--for", "10m", "--who", "tester"]) == 0
        said = capsys.readouterr().out
        m = re.search(r"change (\S+): job:\S+: sample=1/1 from step (\d+) ", said)
        assert m, said  # a registered job with a recent window: the command chose a step
        change_id, from_step = m.group(1), int(m.group(2))
        print(said.strip())
        assert from_step <= TRACED_STEPS - 10, f"from step {from_step}: the job ends too soon to see it applied"
        assert proc.wait(180) == 0, log_path.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while not store.query("SELECT count() AS n FROM control_changes WHERE change_id = {c:String}",
                              {"c": change_id}).column("n")[0].as_py():
            assert time.monotonic() < deadline, worker.stats
            time.sleep(0.2)
        audit = store.query("SELECT who, job_id, what_json, from_step FROM control_changes "
                            "WHERE change_id = {c:String}", {"c": change_id}).to_pylist()
        stored = store.query("SELECT DISTINCT window_id FROM windows WHERE job_id = {job:String}",
                             {"job": job}).column("window_id").to_pylist()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if store is not None:
            store.close()
        worker.stop()
    assert audit == [dict(who="tester", job_id=job, what_json='{"sample": "1/1"}', from_step=from_step)]
    expected = {s for s in range(TRACED_STEPS) if s % TRACED_EVERY == 0 or s >= from_step}
    by_rank: dict[int, set[int]] = {}
    for r in _job_ops(own_broker.bootstrap, job):
        assert r["window_id"] == r["step"]  # 1/5 and 1/1 alike: each profiled step is a window of its own
        by_rank.setdefault(r["rank"], set()).add(r["step"])
    assert sorted(by_rank) == [0, 1], by_rank
    for rank, steps in by_rank.items():
        # Exactly the agreed step on: no rank earlier, no rank later, and none took it late.
        assert steps == expected, (rank, from_step, sorted(steps ^ expected))
    assert "heard of a sampling change" not in log_path.read_text()
    # The windows the shard stored so far are of those steps (it stops before it has analysed them all).
    assert stored and set(stored) <= expected and max(stored) >= from_step, (from_step, sorted(stored))
    print(f"the change {change_id} from step {from_step}: every rank from that step on, windows stored up to "
          f"{max(stored)}")
