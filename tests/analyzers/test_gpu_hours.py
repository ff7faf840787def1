"""GPU-hours, waste and the main verdict have one definition: ``stragglerscope whatif`` prints what the
pipeline stores, and the op types' waste rows are built with their window from the same numbers.

Before, the what-if counted every GPU for the sum of the steps' times and the stored window counted them
for the window's wall span: on the golden ST trace, whose steps each start at 0 on their own clock, the
what-if said 0.157 GPU-hours (0.0239 wasted) and the store 0.00529 (0.00080), 30 times less.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from analyzers.whatif.gpu_hours import wasted_gpu_hours, window_gpu_hours
from analyzers.window import analyze_window
from actions.whatif_files import whatif_files
from core.golden import load_golden
from core.registration import Registration

ST = Path(__file__).resolve().parent.parent / "golden" / "whatif" / "ST"


def test_the_whatif_command_and_the_stored_window_agree_on_a_golden_trace(tmp_path):
    trace, meta = ST / "trace-ST.parquet", ST / "meta-ST.yaml"
    printed = whatif_files(trace, meta, tmp_path / "out.json")
    ops, layout = load_golden(trace, meta)
    key = (str(ops["job_id"][0]), int(ops["attempt"][0]), int(ops["window_id"][0]))
    info = Registration(key[0], key[1], layout, 32, n_gpus=layout.world_size)
    tables = analyze_window(ops, info, key, True, "")
    (row,) = tables["window"].to_pylist()
    for field in ("gpu_hours", "wasted_gpu_hours", "slowdown", "waste_fraction"):
        assert row[field] == pytest.approx(printed[field], rel=1e-9), field
    assert row["verdict"] == printed["verdict"] != ""
    # Each op type's waste row: its whole-window S_t from the what-if, the window's GPU-hours, one formula.
    waste = {r["optype"]: r for r in tables["optype_waste"].to_pylist()}
    assert set(waste) == set(printed["by_optype"]) and len(waste) > 3
    for optype, s_t in printed["by_optype"].items():
        r = waste[optype]
        assert (r["window_id"], r["gpu_hours"], r["team"], r["analyzed_ns"]) == (key[2], row["gpu_hours"], row["team"],
                                                                               row["analyzed_ns"])
        assert r["slowdown"] == pytest.approx(s_t, rel=1e-9)
        assert r["wasted_gpu_hours"] == pytest.approx(max(0.0, row["gpu_hours"] * (1 - 1 / s_t)), rel=1e-9)
    steps = json.loads((tmp_path / "out.json").read_text())["step_time"]["actual"]
    assert printed["gpu_hours"] == pytest.approx(window_gpu_hours(8, list(steps.values())))
    assert printed["gpu_hours"] == pytest.approx(0.1575, rel=1e-3)  # 8 GPUs x 70.9 s of steps


def test_gpu_hours_ignore_steps_without_a_time():
    assert window_gpu_hours(4, [1800.0, float("nan"), 1800.0]) == pytest.approx(4.0)


def test_waste_is_none_where_the_slowdown_says_nothing_was_lost():
    assert wasted_gpu_hours(10.0, 1.25) == pytest.approx(2.0)
    assert wasted_gpu_hours(10.0, 0.98) == 0.0  # S_t under 1 (an op type faster than its ideal) wastes nothing
    assert wasted_gpu_hours(10.0, float("nan")) == 0.0 and wasted_gpu_hours(float("nan"), 1.5) == 0.0
