"""Fleet statistics over analysed windows only: a failed or flagged window (S = NaN) must not turn them NaN."""
import math

import pytest

from tests.storage.conftest import window_rows
from tests.storage.test_store import _fleet, _summary


def test_failed_and_flagged_windows_leave_fleet_statistics_alone(store):
    _fleet(store)
    before = _summary(store)
    nan = float("nan")
    # A failed window of a known job, and a job whose only window was flagged (clock skew).
    store.insert("window", window_rows(1, job="a", first_window=1000, slowdown=nan, gpu_hours=0.0,
                                              verdict="analysis_failed"))
    store.insert("window", window_rows(1, job="skewed", slowdown=nan, gpu_hours=0.0, verdict="clock_skew"))
    after = _summary(store)
    assert not math.isnan(after["mean_slowdown"]) and not math.isnan(after["p90_slowdown"])
    assert after == pytest.approx(before)
    top = store.run_named("top_wasting_jobs").to_pylist()
    assert "skewed" not in [r["job_id"] for r in top]
    assert all(not math.isnan(r["mean_slowdown"]) for r in store.run_named("wasted_by_team").to_pylist())
