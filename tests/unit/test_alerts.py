"""Alert rules: thresholds, job size, cool-down per (job, rule)."""
import pytest

from ray_jobs.alerts import AlertRules
from stragglerscope.config import AlertConfig


def row(**kw):
    base = dict(job_id="j", attempt=0, window_id=0, slowdown=1.3, waste_fraction=0.23, wasted_gpu_hours=1.0,
                n_gpus=64, verdict="worker", m_w=0.9, m_s=0.0, launch_slowdown=1.0, note="")
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "kw, rules",
    [
        ({}, ["slowdown"]),
        ({"slowdown": 1.05}, []),
        ({"n_gpus": 4}, []),
        ({"slowdown": float("nan")}, []),
        ({"launch_slowdown": 1.2}, ["slowdown", "fidelity"]),
        ({"verdict": "analysis_failed", "slowdown": float("nan"), "note": "boom"}, ["analysis_failed"]),
    ],
)
def test_rules(kw, rules):
    alerts = AlertRules(AlertConfig()).evaluate_window(row(**kw), 0.0, 0)
    assert [a["rule"] for a in alerts] == rules


def test_cool_down_per_job_and_rule():
    r = AlertRules(AlertConfig(cooldown_s=600))
    assert r.evaluate_window(row(), 0.0, 0)
    assert not r.evaluate_window(row(window_id=1), 300.0, 0)
    assert r.evaluate_window(row(job_id="other"), 300.0, 0)
    assert r.evaluate_window(row(window_id=2), 601.0, 0)
    assert r.suppressed == 1


def test_severity_and_summary():
    a = AlertRules(AlertConfig()).evaluate_window(row(slowdown=1.8, waste_fraction=0.44), 0.0, 0)[0]
    assert a["severity"] == "critical"
    assert "S=1.80" in a["summary"] and "worker" in a["summary"] and "64 GPUs" in a["summary"]
