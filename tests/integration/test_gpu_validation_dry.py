"""`benchmarks/gpu_validation.py --dry-run`: the GPU validation run's every code path but the device, on CPU.

No GPU here (nor in CI): the plugin is built, loaded and driven as NCCL would, the exporter runs on CPU at
10% sampling, NVML is absent, the MFU arithmetic runs, and the BENCHMARKS.md section writer writes into a
temporary copy. What this test holds the script to: it exits 0, prints one table with a row per check,
says the device checks were skipped, and leaves the real BENCHMARKS.md as it was.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # a real build of the plugin (gcc), torch.distributed, subprocesses

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_validation.py"
CHECKS = ("plugin", "timing", "overhead", "nvml", "mfu", "benchmarks-writer")


@pytest.mark.timeout(90)  # the run is bounded by its own budgets; this only stops a wedged one
def test_the_dry_run_checks_everything_but_the_device(tmp_path):
    from ingest.nccl_profiler import compiler

    if compiler() is None:
        pytest.skip("no C compiler: make setup-test installs gcc (the dry run builds the plugin)")
    bench = ROOT / "BENCHMARKS.md"
    before = hashlib.sha256(bench.read_bytes()).hexdigest()
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=85)
    took = time.monotonic() - t0
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    out = done.stdout
    assert "DRY RUN: no device check ran" in out and "device checks skipped" in out, out
    table = [ln for ln in out.splitlines() if ln.startswith("| ")]
    assert table[0] == "| check | status | result | target | notes | s |", table
    rows = {ln.split(" | ")[0][2:]: ln.split(" | ")[1] for ln in table[1:]}
    assert set(rows) == set(CHECKS), rows
    # Nothing measured on a device: every row is DRY, NVML's absent one SKIPPED, none FAILED.
    assert rows["nvml"] in ("SKIPPED", "DRY") and all(rows[c] == "DRY" for c in CHECKS if c != "nvml"), rows
    plugin = next(ln for ln in table if ln.startswith("| plugin |"))
    assert "v1..v5 exported" in plugin and "1 comm + 72 proxy records each" in plugin, plugin
    assert hashlib.sha256(bench.read_bytes()).hexdigest() == before, "the dry run changed BENCHMARKS.md"
    saved = json.loads((tmp_path / "gpu_validation.json").read_text())
    assert saved["dry"] is True and [r["check"] for r in saved["rows"]] == list(CHECKS)
    # --from-results re-renders a saved run, and refuses to put a dry run into BENCHMARKS.md.
    again = subprocess.run([sys.executable, str(SCRIPT), "--from-results", str(tmp_path / "gpu_validation.json"),
                            "--write-benchmarks"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert again.returncode == 2 and "not written to BENCHMARKS.md" in again.stderr, again.stderr
    assert hashlib.sha256(bench.read_bytes()).hexdigest() == before
    assert took < 60, f"the dry run took {took:.0f} s"
