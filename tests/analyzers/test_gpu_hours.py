"""GPU-hours and waste have one definition: ``stragglerscope whatif`` prints what the pipeline stores.

Before, the what-if counted every GPU for the sum of the steps' times and the stored window counted them
for the window's wall span: on the golden ST trace, whose steps each start at 0 on their own clock, the
what-if said 0.157 GPU-hours (0.0239 wasted) and the store 0.00529 (0.00080), 30 times less.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from analyzers.whatif.api import run_cli, window_gpu_hours
from core.golden import load_golden
from core.registration import Registration
from ray_jobs.analysis import analyze_window

ST = Path(__file__).resolve().parent.parent / "golden" / "whatif" / "ST"


def test_the_whatif_command_and_the_stored_window_agree_on_a_golden_trace(tmp_path):
    trace, meta = ST / "trace-ST.parquet", ST / "meta-ST.yaml"
    printed = run_cli(trace, meta, tmp_path / "out.json")
    ops, layout = load_golden(trace, meta)
    key = (str(ops["job_id"][0]), int(ops["attempt"][0]), int(ops["window_id"][0]))
    info = Registration(key[0], key[1], layout, 32, n_gpus=layout.world_size)
    (row,) = analyze_window(ops, info, key, True, "")["window"].to_pylist()
    for field in ("gpu_hours", "wasted_gpu_hours", "slowdown", "waste_fraction"):
        assert row[field] == pytest.approx(printed[field], rel=1e-9), field
    steps = json.loads((tmp_path / "out.json").read_text())["step_time"]["actual"]
    assert printed["gpu_hours"] == pytest.approx(window_gpu_hours(8, list(steps.values())))
    assert printed["gpu_hours"] == pytest.approx(0.1575, rel=1e-3)  # 8 GPUs x 70.9 s of steps


def test_gpu_hours_ignore_steps_without_a_time():
    assert window_gpu_hours(4, [1800.0, float("nan"), 1800.0]) == pytest.approx(4.0)
