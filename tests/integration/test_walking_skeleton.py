"""The walking skeleton end to end on real components: Tansu, Ray, chDB, the CLI as users run it."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def cli(*args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "stragglerscope", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_once_stores_every_window_and_keeps_history(tmp_path):
    env = dict(os.environ, STRAGGLERSCOPE_STORE=f"chdb://{tmp_path / 'store'}", STRAGGLERSCOPE_PIPELINE_METRICS_PORT="-1")
    small = ["demo", "--headless", "--once", "--jobs", "5", "--max-gpus", "64", "--windows", "2", "--steps", "3",
             "--timeout", "180"]
    r = cli(*small, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "produced   5 jobs, 10 windows" in r.stderr

    r = cli("sql", "fleet_summary", "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    summary = summary[0] if isinstance(summary, list) else summary
    assert summary["jobs"] == 5
    assert summary["windows"] == 10
    assert summary["mean_slowdown"] >= 1.0
    assert summary["wasted_gpu_hours"] > 0

    # The fleet has straggler causes injected: analyses found them.
    r = cli("sql", "--query", "SELECT job_id, slowdown, verdict FROM windows", "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 10
    assert max(row["slowdown"] for row in rows) > 1.1
    assert all(row["verdict"] != "analysis_failed" for row in rows), rows

    # Each window's op-type waste rows came with it through the pipeline: the fleet's "wasted by op type"
    # sums over the same windows, and no op type wastes more than its windows' GPU-hours.
    r = cli("sql", "--query", "SELECT count(DISTINCT (job_id, window_id)) AS windows, "
            "sum(wasted_gpu_hours) AS wasted, max(wasted_gpu_hours - gpu_hours) AS over FROM optype_waste",
            "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    (waste,) = json.loads(r.stdout)
    assert waste["windows"] == 10 and waste["wasted"] > 0 and waste["over"] <= 0, waste

    # A second run adds to the history.
    r = cli(*small, "--seed", "1", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("sql", "fleet_summary", "--format", "json", env=env)
    summary = json.loads(r.stdout)
    summary = summary[0] if isinstance(summary, list) else summary
    assert summary["jobs"] == 10 and summary["windows"] == 20


def test_replay_of_a_golden_trace_stores_its_published_slowdown(tmp_path):
    """`stragglerscope replay` of the ST trace: through Kafka and Ray, the stored S is the published one."""
    golden = os.path.join(os.path.dirname(__file__), "..", "golden", "whatif", "ST")
    env = dict(os.environ, STRAGGLERSCOPE_STORE=f"chdb://{tmp_path / 'store'}", STRAGGLERSCOPE_PIPELINE_METRICS_PORT="-1")
    r = cli("replay", golden, "--timeout", "180", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stored     1 windows" in r.stderr
    r = cli("sql", "job_windows", "--param", "job_id=ST", "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert abs(row["slowdown"] / 1.1787021836556841 - 1) < 0.005
    assert row["verdict"] == "last_stage_imbalance"
