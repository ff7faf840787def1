"""The rank's watch process (ingest/rank_watch.py): a real watch process over a real victim process.

The victim stands in for a training rank (a sleeping process we can stop, resume and kill); the test writes
the heartbeats the rank's exporter would write into the watch's pipe, and reads what the watch would have
sent to Kafka from its ``--out`` file.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import codec
from core import schema as S

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PERIOD = 0.3


def heartbeat_line(rank=2, ts_ns=1, op="forward-compute") -> bytes:
    row = dict(job_id="w", attempt=0, rank=rank, host="h", pid=1, ts_ns=ts_ns, step=5, last_op="optimizer",
               last_op_end_ns=ts_ns - 10, inflight_op=op, inflight_group="", inflight_seq=-1,
               inflight_since_ns=ts_ns - 5, clock_offset_ns=0, stack="", step_done=4, step_done_ns=ts_ns - 20)
    table = codec.from_rows(S.HEARTBEAT, [row])
    out = table.to_pylist()[0]
    out.pop("stack")
    out.pop("flight_recorder")
    return json.dumps(out).encode() + b"\n"


@pytest.fixture
def victim():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
    proc.wait(10)


def start_watch(pid: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ingest.rank_watch", "--pid", str(pid), "--period", str(PERIOD),
                             "--out", str(out)], stdin=subprocess.PIPE, cwd=ROOT)


def said(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    return cond()


def test_a_stopped_rank_is_said_stopped_and_a_resumed_one_is_left_to_speak(victim, tmp_path):
    out = tmp_path / "said.jsonl"
    w = start_watch(victim.pid, out)
    try:
        w.stdin.write(heartbeat_line(ts_ns=time.time_ns()))
        w.stdin.flush()
        time.sleep(3 * PERIOD)
        assert said(out) == [], "nothing is said while the rank speaks for itself"
        os.kill(victim.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        rows = wait_for(lambda: [r for r in said(out) if r["proc_state"] == "stopped"])
        assert rows, "a stopped rank is said stopped"
        assert time.monotonic() - t0 < PERIOD + 1.5
        r = rows[0]
        # What the rank last said of itself, stamped now, without its stacks.
        assert (r["rank"], r["inflight_op"], r["step"], r["stack"]) == (2, "forward-compute", 5, "")
        assert abs(r["ts_ns"] - time.time_ns()) < 5 * 10**9
        # Decodes as a heartbeat of the current schema (what the pipeline reads).
        assert codec.from_rows(S.HEARTBEAT, [r]).num_rows == 1
        os.kill(victim.pid, signal.SIGCONT)
        for _ in range(4):  # the resumed rank speaks again
            w.stdin.write(heartbeat_line(ts_ns=time.time_ns()))
            w.stdin.flush()
            time.sleep(PERIOD)
        n = len(said(out))
        time.sleep(3 * PERIOD)
        assert len(said(out)) == n, "a resumed rank is not spoken for"
        w.stdin.write(b"bye\n")
        w.stdin.flush()
        assert w.wait(5) == 0
        assert len(said(out)) == n, "a goodbye ends the watch without a word"
    finally:
        w.kill()
        w.wait(5)


def test_a_rank_that_dies_is_said_exited_and_the_watch_ends(victim, tmp_path):
    out = tmp_path / "said.jsonl"
    w = start_watch(victim.pid, out)
    try:
        w.stdin.write(heartbeat_line(ts_ns=time.time_ns()))
        w.stdin.flush()
        victim.kill()
        victim.wait(5)
        rows = wait_for(lambda: [r for r in said(out) if r["proc_state"] == "exited"])
        assert len(rows) == 1 and rows[0]["rank"] == 2
        assert w.wait(5) == 0
    finally:
        w.kill()
        w.wait(5)


def test_a_pipe_closed_without_goodbye_is_an_exit(victim, tmp_path):
    """The rank's process is gone when its end of the pipe closes (the kernel closes it at its death)."""
    out = tmp_path / "said.jsonl"
    w = start_watch(victim.pid, out)
    w.stdin.write(heartbeat_line(ts_ns=time.time_ns()))
    w.stdin.close()
    assert w.wait(5) == 0
    assert [r["proc_state"] for r in said(out)] == ["exited"]


def test_a_running_rank_whose_heartbeats_stopped_is_unresponsive(victim, tmp_path, monkeypatch):
    out = tmp_path / "said.jsonl"
    w = start_watch(victim.pid, out)
    try:
        w.stdin.write(heartbeat_line(ts_ns=time.time_ns()))
        w.stdin.flush()
        # No more heartbeats while the victim runs: after max(3 periods, 5 s) it is unresponsive.
        rows = wait_for(lambda: [r for r in said(out) if r["proc_state"] == "unresponsive"], timeout=12)
        assert rows and rows[0]["inflight_op"] == "forward-compute"
    finally:
        w.kill()
        w.wait(5)


def test_the_rank_end_never_blocks_on_a_watch_that_does_not_read(tmp_path):
    """RankWatch.beat writes without blocking: a watch that reads nothing costs drops, not a stall."""
    from ingest.rank_watch import RankWatch

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE)
    try:
        watch = RankWatch(proc)
        table = codec.from_rows(S.HEARTBEAT, [json.loads(heartbeat_line())])
        t0 = time.monotonic()
        for _ in range(2000):
            watch.beat(table)
        assert time.monotonic() - t0 < 5
        assert watch.dropped > 0
    finally:
        proc.kill()
        proc.wait(5)


def test_proc_state_reads_the_kernel():
    from ingest.rank_watch import proc_state

    assert proc_state(os.getpid()) == "running"
    assert proc_state(2**22 + 12345) == "exited"
