"""Hangs of unchanged jobs under `stragglerscope trace`, end to end on real parts (issue 55).

Real processes: a DDP job written as teams write it (``tests/training/ddp_checkpoint.py``: DataLoader over a
DistributedSampler, AdamW with warm-up and cosine, clip_grad_norm_, checkpoints) launched with ``torchrun``
through ``stragglerscope trace`` into the real Tansu broker; a real ``stragglerscope run`` (Ray shards, chDB)
with the hang settings it ships with. Checks:
- one rank stopped with SIGSTOP is the rank named, with its state, within seconds; its peers, waiting for
  it inside DDP's gradient all-reduce, are not; still stopped past the heartbeat timeout it is a process
  loss; resumed, the stall's end is stored;
- rank 0 writing a checkpoint with torch.save to a slow file while the others wait in a barrier pages
  nothing.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.fleet import stop_process_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "training" / "ddp_checkpoint.py"


def launch(cfg: Path, job: str, extra: list[str], tmp: Path) -> subprocess.Popen:
    from services.ports import free_fixed_port

    cmd = [sys.executable, "-m", "stragglerscope", "trace", "--config", str(cfg), "--job-id", job, "--sample", "8/8",
           "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr",
           "127.0.0.1", "--master-port", str(free_fixed_port()), str(JOB), "--dir", str(tmp / "ckpt"), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(tmp / f"{job}.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def rank_pid(job: str, rank: int, timeout: float = 120) -> int:
    """The pid of ``rank`` of the traced ``job`` (its environment names both)."""
    want = {f"STRAGGLERSCOPE_TRACE_JOB_ID={job}".encode(), f"RANK={rank}".encode()}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                env = set((d / "environ").read_bytes().split(b"\0"))
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if want <= env and JOB.name.encode() in cmd:
                return int(d.name)
        time.sleep(0.5)
    raise AssertionError(f"rank {rank} of {job} never started")


def wait_rows(store, sql: str, timeout: float, proc: subprocess.Popen | None = None) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = store.query(sql).to_pylist()
        if rows:
            return rows
        assert proc is None or proc.poll() is None, "the job ended first"
        time.sleep(0.5)
    return []


def test_a_sigstopped_ddp_rank_is_the_rank_named(fleet, tmp_path):
    pytest.importorskip("torch")
    cfg, store = fleet
    job = f"ddp-stop-{uuid.uuid4().hex[:6]}"
    proc = launch(cfg, job, ["--steps", "2000", "--gpu-ms", "100"], tmp_path)
    pid = None
    try:
        pid = rank_pid(job, 2)
        # Past the first steps, so that the ranks know their pace (the threshold adapts from step 4 on).
        assert wait_rows(store, f"SELECT window_id FROM windows WHERE job_id = '{job}' LIMIT 1", 180, proc)
        time.sleep(3)
        os.kill(pid, signal.SIGSTOP)
        stopped_ns = time.time_ns()
        rows = wait_rows(store, f"SELECT * FROM hangs WHERE job_id = '{job}' AND kind != 'node_loss'", 60, proc)
        assert rows, "no hang stored within 60 s of the stop"
        h = rows[0]
        found_s = (h["hang_id"] - stopped_ns) / 1e9
        assert h["missing_ranks"] == "2", h
        # Its peers wait inside DDP's gradient all-reduce (its C++ reducer, after their last gradient).
        assert (h["kind"], h["op"], h["group"]) == ("comm_hang", "all_reduce", "world"), h
        assert "2" not in h["stuck_ranks"].split(","), h
        evidence = json.loads(h["evidence_json"])
        assert evidence["states"] == {"2": "stopped"}, evidence["states"]
        assert found_s < 30, f"named {found_s:.1f} s after the stop"
        alerts = store.query(f"SELECT rule, summary FROM alerts WHERE job_id = '{job}'").to_pylist()
        assert any("missing ranks 2 (stopped)" in a["summary"] for a in alerts), alerts
        # The waiting ranks dumped their stacks before the hang was named.
        assert evidence["ranks_with_stacks"] and "2" not in evidence["ranks_with_stacks"].split(",")
        # Still stopped past the heartbeat timeout (30 s): a process loss, its host's other ranks still there.
        loss = wait_rows(store, f"SELECT * FROM hangs WHERE job_id = '{job}' AND kind = 'node_loss'", 45, proc)
        assert loss and loss[0]["missing_ranks"] == "2" and loss[0]["op"] == "process stopped", loss
        os.kill(pid, signal.SIGCONT)
        pid = None
        ended = wait_rows(store, f"SELECT * FROM hangs WHERE job_id = '{job}' AND kind = 'hang_ended'", 60, proc)
        assert ended and ended[0]["missing_ranks"] == "2", ended
        assert ended[0]["duration_s"] >= 30
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        stop_process_group(proc)


def test_a_rank_0_checkpoint_behind_a_barrier_pages_nothing(fleet, tmp_path):
    pytest.importorskip("torch")
    cfg, store = fleet
    job = f"ddp-ckpt-{uuid.uuid4().hex[:6]}"
    # Saves at step 20, 25 s on the slow "mount": three times the hang threshold of this job. (A second save
    # at step 40 cost the suite 27 s and met the same rule in the same state.)
    proc = launch(cfg, job, ["--steps", "30", "--gpu-ms", "100", "--checkpoint", "rank0", "--every", "20",
                             "--save-s", "25"], tmp_path)
    try:
        assert proc.wait(400) == 0, (tmp_path / f"{job}.log").read_text()[-3000:]
    finally:
        stop_process_group(proc)
    hangs = store.query(f"SELECT kind, duration_s, missing_ranks FROM hangs WHERE job_id = '{job}'").to_pylist()
    assert hangs == [], hangs
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step*.pt")) == ["step20.pt"]
    alerts = store.query(f"SELECT rule, summary FROM alerts WHERE job_id = '{job}' AND rule IN "
                         "('hang', 'node_loss')").to_pylist()
    assert alerts == [], alerts
