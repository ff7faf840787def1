"""Accuracy of `stragglerscope trace` on unchanged jobs, three slowdown levels per framework (issues 17, 37).

    .venv/bin/python benchmarks/trace_accuracy.py [--frameworks pipelining,interleaved,ddp,fsdp,plain] [--scale K]
    .venv/bin/python benchmarks/trace_accuracy.py --frameworks foreign   # the jobs written elsewhere (issue 37)

For each framework and delay level d (aimed near 1.2x, 1.5x and 2x the
normal step): rank 0 slowed by d in every forward and backward, and the control
with d / W on every rank, both armed as `stragglerscope trace` arms them. The
what-if analysis of the steady window (steps 8-13) gives S; the ratio of the
measured step times slowed / control is what S should be. Prints S, the
ratio, their error, the top worker and the simulation fidelity, and the
control's own S with the error of S_slowed / S_control: the control carries
the collective noise of 4 processes on 2 shared cores, which the ideal removes
from both runs, so S exceeds the ratio by about the control's S.

The jobs written elsewhere (``FOREIGN``: ``tests/training/foreign_pipe.py`` in
both rank orders and on a DeviceMesh of its own names, ``megatron_style.py``,
``titan_tp.py``, and issue 55's ``titan_fsdp.py``, ``ddp_accum.py``,
``megatron_interleaved.py``) slow the rank their case names, which for the DP x TP job is
not its worker's first; the top worker must be that rank's. They run armed as
`trace` arms them, with no --layout: the layout is what the processes say.
"""
from __future__ import annotations

import argparse
import statistics
import uuid

from traced_runs import ROOT, read_ops, run

from core import topics
from core.kafka_admin import ensure_topics
from core.layout import JobLayout
from services.broker import LocalBroker

# framework -> (ranks, layout, zoo arguments, three delays in ms)
CASES = {
    # Every job simulates 40 ms of device time per forward: with 10 ms the host's scheduling noise was a quarter
    # of a pipeline step's compute and the controls' own S reached 1.03 (BENCHMARKS.md, 2026-11-27).
    "pipelining": (4, JobLayout(2, 2), ["--gpu-ms", "40"], (24, 60, 120)),
    "interleaved": (4, JobLayout(2, 2, vpp_size=2), ["--gpu-ms", "40"], (16, 32, 64)),
    "ddp": (4, JobLayout(4, 1), ["--gpu-ms", "40"], (12, 32, 64)),
    "fsdp": (2, JobLayout(2, 1), ["--gpu-ms", "40"], (16, 40, 80)),
    "plain": (4, JobLayout(4, 1), ["--gpu-ms", "40"], (12, 32, 64)),
    # torch.compile (inductor) around DDP: the zoo's ddp with --compile (the suite's ddp-compiled case)
    "ddp-compiled": (4, JobLayout(4, 1), ["--gpu-ms", "40", "--compile"], (12, 32, 64)),
}

# name -> (script in tests/training, ranks, layout, arguments, three delays in ms, slowed rank, its worker (dp, pp))
FOREIGN = {
    "pipe-dp-major": ("foreign_pipe.py", 4, JobLayout(2, 2), ["--gpu-ms", "40"], (24, 60, 120), 1, (0, 1)),
    "pipe-pp-major": ("foreign_pipe.py", 4, JobLayout(2, 2), ["--gpu-ms", "40", "--rank-order", "pp-major"],
                      (24, 60, 120), 1, (1, 0)),
    "pipe-mesh": ("foreign_pipe.py", 4, JobLayout(2, 2), ["--gpu-ms", "40", "--mesh"], (24, 60, 120), 1, (0, 1)),
    "megatron": ("megatron_style.py", 4, JobLayout(2, 2), ["--gpu-ms", "40"], (24, 60, 120), 1, (1, 0)),
    "titan-tp": ("titan_tp.py", 4, JobLayout(2, 1, tp_size=2), ["--gpu-ms", "40"], (16, 40, 80), 3, (1, 0)),
    # issue 55: FSDP2 accumulating over 4 micro-batches (two ranks), DDP under no_sync, interleaved 1F1B
    "titan-fsdp-accum": ("titan_fsdp.py", 2, JobLayout(2, 1), ["--gpu-ms", "40"], (16, 32, 64), 0, (0, 0)),
    "ddp-accum": ("ddp_accum.py", 4, JobLayout(4, 1), ["--gpu-ms", "40"], (16, 32, 64), 0, (0, 0)),
    "megatron-interleaved": ("megatron_interleaved.py", 4, JobLayout(2, 2, vpp_size=2), ["--gpu-ms", "20"],
                             (20, 40, 80), 1, (1, 0)),
}


def run_script(script: str, ranks: int, args: list[str], *, bootstrap: str, job_id: str, sample: str) -> dict:
    """One armed torchrun of a job in tests/training; rank 0's {'losses', 'step_times'}."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from ingest.autotrace.session import TraceSettings, parse_sample
    from services.ports import free_fixed_port
    from stragglerscope.trace import child_env

    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as run_dir:
        env = child_env(TraceSettings(job_id=job_id, bootstrap=bootstrap, sampling=parse_sample(sample),
                                      run_dir=run_dir).to_env())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(free_fixed_port()), str(ROOT / "tests" / "training" / script),
               "--out", out, *args]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"{script} run failed:\n{r.stderr[-3000:]}")
        return json.loads((Path(out) / "rank0.json").read_text())


def main() -> None:
    import pyarrow.compute as pc

    from analyzers.whatif import analyze

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default=",".join(CASES))
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply each job's simulated accelerator time and its delays (the same slowdowns, with "
                        "the host's scheduling noise a K-th of the step)")
    a = p.parse_args()
    names = a.frameworks.replace("foreign", ",".join(FOREIGN)).split(",")
    rows = []
    with LocalBroker() as b:
        ensure_topics(b.bootstrap, topics.INPUT_TOPICS, 4)

        def measure(fw, extra):
            foreign = FOREIGN.get(fw)
            ranks, lay, args = foreign[1:4] if foreign else CASES[fw][:3]
            args = list(args)
            i = args.index("--gpu-ms") + 1
            args[i] = str(float(args[i]) * a.scale)
            job = f"acc-{uuid.uuid4().hex[:6]}"
            if foreign:
                rep = run_script(foreign[0], ranks, [*args, "--steps", "14", *extra], bootstrap=b.bootstrap,
                                 job_id=job, sample="6/8")
            else:  # "ddp-compiled" is the zoo's ddp (its --compile is among the arguments)
                rep = run(fw.split("-")[0], ranks, [*args, "--steps", "14", *extra], bootstrap=b.bootstrap,
                          job_id=job, sample="6/8")
            ops = read_ops(b.bootstrap, job)
            res = analyze(ops.filter(pc.equal(ops["window_id"], 8)), lay).to_json_dict()
            return statistics.median(rep["step_times"][8:14]), res

        for fw in names:
            normal, _ = measure(fw, [])
            delays = FOREIGN[fw][4] if fw in FOREIGN else CASES[fw][3]
            slowed_rank = FOREIGN[fw][5] if fw in FOREIGN else 0
            for d in (d * a.scale for d in delays):
                slow = ["--slow-rank", str(slowed_rank), "--delay-ms", str(d)]
                t_slow, res = measure(fw, slow)
                t_ctrl, res_c = measure(fw, slow + ["--control"])
                ratio = t_slow / t_ctrl
                top = max(res["by_dp_rank"], key=res["by_dp_rank"].get), max(res["by_pp_rank"],
                                                                              key=res["by_pp_rank"].get)
                want = FOREIGN[fw][6] if fw in FOREIGN else (0, 0)
                mark = "" if (int(top[0]), int(top[1])) == want else f" (want dp{want[0]}/pp{want[1]})"
                s, s_c = res["slowdown"], res_c["slowdown"]
                rows.append((fw, d, t_slow / normal, s, ratio, s / ratio - 1, f"dp{top[0]}/pp{top[1]}{mark}",
                             res["launch_slowdown"], s_c, s / s_c / ratio - 1))
                print(f"{fw:<12}{d:>5g} ms  slowed {t_slow / normal:5.2f}x  S={s:.3f}  slowed/control={ratio:.3f}  "
                      f"err {rows[-1][5]:+.1%}  top {rows[-1][6]}  fidelity {res['launch_slowdown']:.3f}  "
                      f"control S={s_c:.3f}  S/S_control err {rows[-1][9]:+.1%}", flush=True)
    print("\n| framework | d ms | slowed vs normal | S | slowed/control | error | top DP/PP | fidelity | control S "
          "| S/S_control error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f}x | {r[3]:.3f} | {r[4]:.3f} | {r[5]:+.1%} | {r[6]} | {r[7]:.3f} | "
              f"{r[8]:.3f} | {r[9]:+.1%} |")
    within = sum(abs(r[5]) <= 0.05 for r in rows)
    print(f"\n{within} of {len(rows)} levels within 5% of slowed/control; "
          f"{sum(abs(r[9]) <= 0.05 for r in rows)} with S / control S")


if __name__ == "__main__":
    main()
