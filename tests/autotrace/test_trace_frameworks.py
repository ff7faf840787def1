"""Unchanged PyTorch jobs under `stragglerscope trace`, end to end on real parts (issue 17).

Real processes, gloo on CPU, launched with ``torchrun`` through ``stragglerscope
trace`` into the real Tansu broker; a real ``stragglerscope run`` pipeline (Ray
shard actors, chDB behind its daemon) analyses and stores the windows. The
training script (``tests/training/zoo.py``) knows nothing of stragglerscope.

For each framework (DDP also under ``torch.compile``), two runs: uninstrumented, then under ``trace`` with rank
0 slowed by a delay d in every forward and backward. Checks:
- instrumenting changes no loss value (bitwise) and no exit code;
- the checked window is complete, with the job's layout;
- rank 0 is the top worker, and the top DP and PP rank, with the worker verdict;
- replaying the original durations gives the measured step time, and the simulation stays close to it.
Accelerator time is simulated by sleeps inside the compute (``--gpu-ms``), so
the 2 shared cores do not decide the result. How close S comes to what the
slowdown costs is ``benchmarks/trace_accuracy.py``'s to measure (three levels
per job against a control run).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "tests" / "training" / "zoo.py"
SAMPLE, STEPS, WINDOW = "6/8", 14, 8  # windows 0 (warm-up) and 8 (steps 8-13, the one checked)
# How close S comes to what the slowdown costs (slowed / control step time, 5% the target) is measured by
# benchmarks/trace_accuracy.py at three levels per job, on a quiet machine (BENCHMARKS.md). Here, on the shared
# 2-core CI machine, each job runs once slowed and is checked for what noise does not move: the complete window,
# the layout, the slowed worker on top with the worker verdict, and spans that cover the step. (The pair of runs
# this test used to compare, slowed and control, cost a third of the suite's time and failed CI on the
# machine's noise, not on the method: stops 33, 56 and 57.)
ATTEMPTS = 2  # a loaded machine now and then blurs one run (another worker straggling too): measured again
# The simulation's fidelity (actual / simulated step) and the spans' cover of the step the script measured:
# within 5% on a quiet machine; up to 1.15 and 1.09 in whole-suite runs on this one (pipe-pp-major-mesh,
# stop 56; ddp's control, stop 57). A span or launch delay lost by the capture moves them further.
FIDELITY_BOUND = 0.15


# framework -> (ranks, layout (dp, pp, vpp), zoo arguments, delay d in ms)
FRAMEWORKS = {
    "pipelining": (4, (2, 2, 1), ["--gpu-ms", "10"], 15),
    "interleaved": (4, (2, 2, 2), ["--gpu-ms", "10"], 8),
    "ddp": (4, (4, 1, 1), ["--gpu-ms", "40"], 32),
    "fsdp": (2, (2, 1, 1), ["--gpu-ms", "40"], 32),
    "plain": (4, (4, 1, 1), ["--gpu-ms", "40"], 32),
    # torch.compile (inductor) around DDP: the outermost module is the compile wrapper, not the DDP
    "ddp-compiled": (4, (4, 1, 1), ["--gpu-ms", "40", "--compile"], 32),
}


def torchrun(ranks: int) -> list[str]:
    from services.ports import free_fixed_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
            "127.0.0.1", "--master-port", str(free_fixed_port())]


def run_zoo(framework: str, out: Path, extra: list[str], trace: list[str] | None = None, env=None, timeout=240):
    ranks, _, args, _ = FRAMEWORKS[framework]
    out.mkdir(parents=True, exist_ok=True)
    cmd = torchrun(ranks) + [str(ZOO), "--framework", framework.split("-")[0], "--steps", str(STEPS),
                             "--out", str(out), *args, *extra]
    if trace is not None:
        cmd = [sys.executable, "-m", "stragglerscope", "trace", *trace, "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def losses(out: Path) -> dict[int, list[float]]:
    return {int(p.stem[4:]): json.loads(p.read_text())["losses"] for p in out.glob("rank*.json")}


def step_time(out: Path) -> float:
    """Rank 0's mean step time over the checked window's steps as the script measured it: a mean as the
    analysis's own (``step_time_actual``) is; against a median, one step of 0.37 s among 0.16 s ones read as
    spans 24% longer than the step (CI stop 57), where the means agreed within 2%."""
    return statistics.mean(json.loads((out / "rank0.json").read_text())["step_times"][WINDOW:WINDOW + 6])


def spans_cover_the_step(result: dict, fidelity: bool = True) -> bool:
    """The recorded spans replay to the step the script measured (``step_time_actual`` against its mean), and
    (``fidelity``) the simulation without launch delays stays close to them (``launch_slowdown``)."""
    row = result["row"]
    return (abs(row["step_time_actual"] / result["measured"] - 1) <= FIDELITY_BOUND
            and (not fidelity or abs(row["launch_slowdown"] - 1) <= FIDELITY_BOUND))


def diagnosed(result: dict, worker: tuple[int, int], fidelity: bool = True) -> bool:
    """Whether a run's checked window says what the test asserts: complete, ``worker`` on top with the worker
    verdict, spans that cover the step. A miss is measured again (``ATTEMPTS``)."""
    return (not window_missed(result) and result["top"] == worker and result["row"]["verdict"] == "worker"
            and spans_cover_the_step(result, fidelity))


def diagnosis_report(case: str, result: dict, cfg: Path) -> str:
    row = result["row"]
    return (f"{case}: S={row['slowdown']:.3f} top={result['top']} dp={result['top_dp']} pp={result['top_pp']} "
            f"verdict={row['verdict']} spans/step={row['step_time_actual'] / result['measured']:.3f} "
            f"fidelity={row['launch_slowdown']:.3f}"
            + (f"; window: {row['note']}; fleet {fleet_status(cfg)}" if window_missed(result) else ""))


def window_missed(result: dict) -> bool:
    """Whether the checked window closed on the idle timeout, a rank's records short. On a loaded machine one
    rank's batch of a mid-window step (megatron, rank 3, step 10, CI stop 57) came too late for its window
    or not at all: a delivery the machine held up, not a diagnosis, so the attempt is measured again; the
    fleet's status line counts late records (``late=``), printed with the report."""
    return not result["row"]["complete"]


def fleet_status(cfg: Path) -> str:
    """The fleet pipeline's last status line (``tests.fleet``'s log beside its configuration)."""
    lines = [x for x in (cfg.parent / "run.log").read_text(errors="replace").splitlines() if x.startswith("status")]
    return lines[-1] if lines else "no status line yet"


def wait_window(store, job: str, timeout=120) -> dict:
    deadline = time.monotonic() + timeout
    while not store.window_stored((job, 0, WINDOW)):
        assert time.monotonic() < deadline, f"window {WINDOW} of {job} was not stored"
        time.sleep(0.5)
    (row,) = [r for r in store.run_named("job_windows", {"job_id": job}).to_pylist() if r["window_id"] == WINDOW]
    return row


def analysed(store, job: str) -> dict:
    row = wait_window(store, job)
    workers = store.run_named("job_workers", {"job_id": job, "window_id": WINDOW}).to_pylist()
    assert workers, f"no worker rows for the window: {row}"
    top = max(workers, key=lambda w: w["s_w"])
    top_dp = max(workers, key=lambda w: w["s_dp"])["dp_rank"]
    top_pp = max(workers, key=lambda w: w["s_pp"])["pp_rank"]
    return dict(row=row, top=(top["dp_rank"], top["pp_rank"]), top_dp=top_dp, top_pp=top_pp)


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_unchanged_job_is_diagnosed_and_keeps_its_losses(framework, fleet, tmp_path, artifacts):
    pytest.importorskip("torch")
    cfg, store = fleet
    _, (dp, pp, vpp), _, delay = FRAMEWORKS[framework]
    slow = ["--slow-rank", "0", "--delay-ms", str(delay)]

    plain = run_zoo(framework, tmp_path / "plain", slow)
    if plain.returncode != 0:
        # The control is torch alone, untraced. In a whole-suite run (2026-11-30) its DDP rank 0 aborted inside
        # torch ("terminate called without an active exception", SIGABRT) and the other ranks were stopped:
        # the control is run again once; a job that fails untraced twice fails the test.
        plain = run_zoo(framework, tmp_path / "plain", slow)
    assert plain.returncode == 0, plain.stderr[-3000:]
    for attempt in range(ATTEMPTS):
        job = f"{framework}-slow-{uuid.uuid4().hex[:6]}"
        r = run_zoo(framework, tmp_path / "slow", slow, trace=["--config", str(cfg), "--job-id", job, "--sample", SAMPLE])
        assert r.returncode == 0, r.stderr[-3000:]
        assert "instrumentation errors" not in r.stderr, r.stderr[-3000:]
        # No warning the user did not earn (issue 52): torch's deprecated Flight Recorder variable, the
        # MFU line once per rank and again in the summary (on CPU the peak is unknown: said once).
        assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in r.stderr and r.stderr.count("MFU not reported") <= 1, \
            r.stderr[-3000:]
        s = dict(analysed(store, job), measured=step_time(tmp_path / "slow"), job=job)
        if diagnosed(s, (0, 0)):
            break
    report = diagnosis_report(framework, s, cfg)
    with open(artifacts / "trace_frameworks.txt", "a") as f:
        f.write(report + "\n")
    print(report)
    # Instrumented or not, the same losses, bit for bit.
    assert losses(tmp_path / "slow") == losses(tmp_path / "plain")
    assert s["row"]["complete"] and s["row"]["dp_size"] == dp and s["row"]["pp_size"] == pp, report
    assert s["top"] == (0, 0) and s["top_dp"] == 0 and s["top_pp"] == 0, report
    assert s["row"]["verdict"] == "worker", report
    assert spans_cover_the_step(s), report


def test_gc_storm_on_one_rank_gives_the_gc_verdict(fleet, tmp_path):
    """Repeated gc.collect() on rank 0 between backward and the gradient all-reduce: real collections,
    seen through gc.callbacks, give the gc verdict."""
    cfg, store = fleet
    job = f"gc-storm-{uuid.uuid4().hex[:6]}"
    r = run_zoo("plain", tmp_path / "gc", ["--gc-storm-rank", "0", "--gc-storm", "1"],
                trace=["--config", str(cfg), "--job-id", job, "--sample", SAMPLE])
    assert r.returncode == 0, r.stderr[-3000:]
    row = wait_window(store, job)
    kinds = [v["kind"] for v in json.loads(row["verdicts_json"])]
    assert "gc" in kinds, (row["slowdown"], kinds)  # a GC storm on one rank is also a worker straggler


def test_a_job_that_crashes_crashes_the_same_way_under_trace(fleet, tmp_path):
    cfg, _ = fleet
    crash = ["--crash-at-step", "3"]
    bare = run_zoo("ddp", tmp_path / "bare", crash)
    traced = run_zoo("ddp", tmp_path / "traced", crash, trace=["--config", str(cfg), "--sample", "2/4"])
    assert bare.returncode != 0
    assert traced.returncode == bare.returncode, traced.stderr[-3000:]
    assert "crash requested by --crash-at-step" in bare.stderr
    assert "crash requested by --crash-at-step" in traced.stderr


def test_trace_passes_the_exit_code_of_a_command_without_torch_distributed(fleet):
    cfg, _ = fleet
    r = subprocess.run([sys.executable, "-m", "stragglerscope", "trace", "--config", str(cfg), "--",
                        sys.executable, "-c", "import sys; sys.exit(3)"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 3, r.stderr
    assert "no process initialised torch.distributed" in r.stderr


def test_collections_between_pipeline_chunks_make_one_gc_op_after_the_last_compute(fleet, tmp_path):
    """A collection between two backward chunks of an interleaved schedule is the step's gc: its op used to
    start between the chunks, before one that precedes it in the model, and the analysis failed on a
    dependency cycle (seen in CI, 1 run in 3 under load, from the schedule's own collections)."""
    cfg, store = fleet
    job = f"gc-chunks-{uuid.uuid4().hex[:6]}"
    r = run_zoo("interleaved", tmp_path / "gc", ["--gc-between-chunks-rank", "3"],
                trace=["--config", str(cfg), "--job-id", job, "--sample", SAMPLE])
    assert r.returncode == 0, r.stderr[-3000:]
    row = wait_window(store, job)
    assert row["verdict"] != "analysis_failed", row["note"]
    assert row["complete"] and row["slowdown"] == row["slowdown"], row


def test_a_device_mesh_names_the_layout_and_one_rank_speaks_for_each_worker(fleet, tmp_path):
    """Four ranks in a DeviceMesh ('dp', 'tp') of 2 x 2, the mesh the only place that says TP is 2. The
    trace reads the mesh over a contradicting --layout (a warning, never an exception); each worker's op
    spans come from its first TP rank (both ranks' spans under one worker made a dependency cycle)."""
    cfg, store = fleet
    slow = ["--slow-rank", "0", "--delay-ms", "32", "--mesh-tp", "2"]
    bare = run_zoo("plain", tmp_path / "bare", slow)
    assert bare.returncode == 0, bare.stderr[-3000:]
    for _ in range(ATTEMPTS):  # measured again once, as above: the whole suite's load once left no verdict
        job = f"mesh-{uuid.uuid4().hex[:6]}"
        r = run_zoo("plain", tmp_path / "traced", slow,
                    trace=["--config", str(cfg), "--job-id", job, "--sample", SAMPLE, "--layout", "dp=4"])
        assert r.returncode == 0, r.stderr[-3000:]
        assert "instrumentation errors" not in r.stderr, r.stderr[-3000:]
        assert "--layout says dp=4 but the DeviceMesh says dp=2" in r.stderr, r.stderr[-3000:]
        assert losses(tmp_path / "traced") == losses(tmp_path / "bare")
        got = analysed(store, job)
        if got["row"]["verdict"] == "worker" and got["top"] == (0, 0):
            break
    (reg,) = store.query(f"SELECT dp_size, tp_size FROM jobs WHERE job_id = '{job}'").to_pylist()
    assert reg == {"dp_size": 2, "tp_size": 2}
    row = got["row"]
    assert row["complete"] and row["verdict"] == "worker", row
    assert got["top"] == (0, 0), got
