"""`stragglerscope trace -- torchrun ...` on embedded defaults: the one-command answer to "why is my job slow?".

No Kafka configured: the command starts the Tansu broker, the chDB store and a
local Ray pipeline for the run, and prints the job's diagnosis when the
training command exits. The job is ``torch.distributed.pipelining`` (1F1B, DP2
x PP2), unchanged, with rank 0 slowed.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.autotrace.test_trace_frameworks import ZOO, torchrun

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_trace_prints_the_verdict_of_a_slowed_pipeline(tmp_path):
    pytest.importorskip("torch")
    env = dict(os.environ, STRAGGLERSCOPE_STORE=f"chdb://{tmp_path / 'store'}",
               STRAGGLERSCOPE_PIPELINE_METRICS_PORT="-1")
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-m", "stragglerscope", "trace", "--job-id", "pipe-slow", "--sample", "6/8",
                        "--", *torchrun(4), str(ZOO), "--framework", "pipelining", "--steps", "14",
                        "--slow-rank", "0", "--delay-ms", "15", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    print(r.stdout)
    assert "== stragglerscope: job pipe-slow (attempt 0) ==" in r.stdout
    assert "4 ranks, layout dp=2 pp=2" in r.stdout
    window8 = r.stdout.split("window 8 ")[1]
    assert "verdict  Slow worker: Worker dp0/pp0 is the straggler" in window8, r.stdout
    assert "top workers  dp 0 pp 0" in window8, r.stdout
    assert "stragglerscope console --store" in r.stderr
    # The store keeps what was printed.
    q = subprocess.run([sys.executable, "-m", "stragglerscope", "sql", "job_windows", "--param", "job_id=pipe-slow",
                        "--format", "json"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    rows = {w["window_id"]: w for w in json.loads(q.stdout)}
    assert rows[8]["verdict"] == "worker" and rows[8]["slowdown"] > 1.1
