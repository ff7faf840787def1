"""The exporter on a real GPU (issue 20): its overhead on a bf16 transformer, and its spans against
hand-placed CUDA events and the PyTorch profiler's kernel times.

    python3 benchmarks/gpu_exporter.py --out DIR          # on a machine with a CUDA GPU (the device tool)
    python3 benchmarks/gpu_exporter.py --tiny --out DIR   # a smoke run of the same code on CPU

A one-process training job (torch.distributed with NCCL, world size 1; a
GPT-style decoder of ~185M parameters in bf16, ``--microbatches`` per step,
AdamW, a world-wide all-reduce of the loss as the step's sync) runs in child
processes, alternately:

- ``bare``: not instrumented;
- ``10%`` and ``100%``: instrumented with no change to the training code
  (``stragglerscope.instrument``, what ``stragglerscope trace`` arms in every
  rank), sampling 10 of every 100 steps, or every step, exporting to a local
  Tansu broker. CUDA-timed spans: event pairs on the current stream, resolved
  by the exporter's thread.

Step time is host time from one step's end to the next, each step ending with
``loss.item()`` (as a training loop that logs its loss does). Of ``--steps``
steps the first 10 are dropped: the 10% runs are sampled on steps 100-109 of
the 100 kept. Then two checking runs at 100%, which also record their own
event pair around every microbatch's forward and backward (hand-placed) and
profile their last 3 steps:

- ``agree``: recorded forward and backward durations against the hand events
  (every step) and against the sum of the kernels the profiler saw inside
  each span (the profiled steps);
- ``slow``: an extra chain of matmuls in the forward of microbatch 1 of every
  step, timed by its own events: the recorded forward of microbatch 1 must
  exceed the others by that time. The what-if replay of the recorded spans
  must reproduce the step times (its launch slowdown);
- ``ahead``: as ``agree`` but reading the loss only every ``--sync-every``
  steps, so the host runs ahead of the GPU by its launch queue.

Every checking run also ties the GPU clock to the host's at each sync (an
event recorded on an idle stream) and reports where each recorded forward span
starts against when the GPU reached it, beside the launch-to-GPU lag (how
early a placement by record time would be).

A deterministic pair (``det-bare``, ``det-100%``: deterministic algorithms,
math attention) compares the losses bitwise; the usual kernels differ run to
run (cuDNN attention's backward).

Prints a table; writes every child's figures to ``--out``. On the device
machine (no package index there): kafka-python travels as a wheel and the
Tansu binary as a file, e.g. ``CALF_TANSU_BIN=/tmp/tansu PYTHONPATH=/tmp/site``
after unpacking both (BENCHMARKS.md, "The exporter on a real GPU").
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = {"bare": None, "10%": "10/100", "100%": "1/1", "agree": "1/1", "slow": "1/1", "ahead": "1/1",
         "det-bare": None, "det-100%": "1/1"}
CHECKS = ("agree", "slow", "ahead")  # the checking runs: hand events beside the recorded spans
DROP = 10          # warm-up steps left out of every figure
PROFILED = 3       # last steps of the checking runs seen by the profiler


# -- the training process -------------------------------------------------------------------------

def _model(torch, vocab: int, d: int, layers: int, heads: int):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(a)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.extra = None  # (matmuls, hand events) when this microbatch is slowed

        def forward(self, idx):
            x = self.emb(idx)
            if self.extra is not None:
                n, (e0, e1), a = self.extra
                e0.record()
                y = a
                for _ in range(n):  # a chain: each product waits for the last, as a slow layer would
                    y = (y @ a) * 0.5
                e1.record()
                x = x + y.sum() * 0  # part of the graph, so nothing can drop it
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    return Decoder()


def child(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    cuda = torch.cuda.is_available() and not a.tiny
    det = a.mode.startswith("det")
    if det:  # bitwise-repeatable kernels (cuBLAS workspace, math attention), to compare losses exactly
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device("cuda" if cuda else "cpu")
    sample = MODES[a.mode]
    job_id = f"gpu-{a.mode.rstrip('%')}-{uuid.uuid4().hex[:6]}"
    if sample:
        import stragglerscope

        stragglerscope.instrument(job_id, a.bootstrap, sample=sample, layout="dp=1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(a.port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    captured = []
    if a.mode in CHECKS:
        from ingest.autotrace.session import current

        exp = current().exporter
        send = exp.sink

        def tee(table):  # keep the op spans this rank sends, to compare them here
            if "optype" in table.schema.names:
                captured.append(table)
            return send(table)
        exp.sink = tee

    torch.manual_seed(0)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = _model(torch, a.vocab, a.d_model, a.layers, a.heads).to(dev, dtype)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(dev) for _ in range(a.microbatches)]
    hand = a.mode in CHECKS
    ahead = a.mode == "ahead"  # reads the loss every --sync-every steps: the host runs ahead of the GPU
    ev = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else None
    refs: list = []  # (event, perf_counter ns): events recorded on an idle stream, so they ran when recorded

    def take_ref():  # the GPU clock tied to the host clock, again at every sync (no drift between the two)
        if hand and cuda:
            torch.cuda.synchronize()
            r = ev()
            r.record()
            refs.append((r, time.perf_counter_ns()))
    take_ref()
    slow_a = torch.randn(2048, 2048, device=dev, dtype=dtype) / 2048 ** 0.5 if a.mode == "slow" else None
    prof = None
    steps, cpu_steps, losses, hand_rows, pending = [], [], [], [], []
    t_prev, c_prev = time.perf_counter(), time.process_time()
    if det:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        math_only = sdpa_kernel(SDPBackend.MATH)  # kept: a dropped context manager restores the backends
        math_only.__enter__()
    import warnings

    caught = warnings.catch_warnings(record=True)
    seen_warnings = caught.__enter__()
    warnings.simplefilter("always")
    for step in range(a.steps if not det else a.det_steps):
        if hand and cuda and not ahead and step == a.steps - PROFILED:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        total = torch.zeros((), device=dev, dtype=torch.float32)
        for mb, chunk in enumerate(data):
            x, y = chunk[:, :-1], chunk[:, 1:]
            tag = f"ss_{step}_{mb}"
            evs = [ev() for _ in range(4)] if hand and cuda else None
            if a.mode == "slow" and mb == 1 and cuda:
                model.extra = (a.slow_matmuls, (ev(), ev()), slow_a)
            rec_ns = time.perf_counter_ns()
            if evs:
                evs[0].record()
            with torch.profiler.record_function(f"{tag}_fwd"):
                logits = model(x)
            if evs:
                evs[1].record()
            extra, model.extra = model.extra, None
            loss = F.cross_entropy(logits.float().view(-1, a.vocab), y.reshape(-1)) / len(data)
            if evs:
                evs[2].record()
            with torch.profiler.record_function(f"{tag}_bwd"):
                loss.backward()
            if evs:
                evs[3].record()
                pending.append((step, mb, evs, extra[1] if extra else None, rec_ns, len(refs) - 1))
            total += loss.detach().float()
        dist.all_reduce(total)  # the step's sync, as a data-parallel job's gradient reduction would be
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not ahead or (step + 1) % a.sync_every == 0 or step == a.steps - 1:
            losses.append(total.item())  # waits for the GPU: the step is done
            take_ref()
        now, cnow = time.perf_counter(), time.process_time()
        steps.append(now - t_prev)
        cpu_steps.append(cnow - c_prev)
        t_prev, c_prev = now, cnow
    kernels = {}
    if prof is not None:
        prof.__exit__(None, None, None)
        kernels = _kernel_sums(prof, Path(a.work) / f"trace-{a.mode}.json")
    for step, mb, evs, extra, rec_ns, ref in pending:
        r_ev, r_ns = refs[ref]
        hand_rows.append(dict(step=step, mb=mb, fwd_ns=int(evs[0].elapsed_time(evs[1]) * 1e6),
                              # host time (perf ns) at which the GPU reached the forward, and of its launch
                              fwd_gpu_at_ns=r_ns + int(r_ev.elapsed_time(evs[0]) * 1e6), fwd_launch_ns=rec_ns,
                              bwd_ns=int(evs[2].elapsed_time(evs[3]) * 1e6),
                              extra_ns=int(extra[0].elapsed_time(extra[1]) * 1e6) if extra else 0,
                              **{f"{k}_{what}_ns": kernels[f"ss_{step}_{mb}_{k}"][i]
                                 for k in ("fwd", "bwd") for i, what in enumerate(("kernels", "busy"))
                                 if f"ss_{step}_{mb}_{k}" in kernels}))
    caught.__exit__(None, None, None)
    report = dict(mode=a.mode, job_id=job_id, warnings=sorted({str(w.message)[:300] for w in seen_warnings}),
                  device=torch.cuda.get_device_name() if cuda else "cpu",
                  torch=torch.__version__, params=params, step_s=steps, cpu_s=cpu_steps, losses=losses,
                  hand=hand_rows)
    if sample:
        from ingest.autotrace.session import current

        sess = current()
        sess.close()  # flush now: the spans below must be complete
        report.update(clock_ns=sess.exporter._to_job_clock(0),  # perf ns -> the spans' clock
                      exporter_errors=sess.exporter.stats.errors, ops_sent=sess.exporter.stats.ops,
                      records_sent=sess.producer.stats.records_sent,
                      records_dropped=sess.producer.stats.records_dropped)
    if captured:
        import pyarrow as pa

        import pyarrow.ipc as ipc

        ops = pa.concat_tables(captured)
        with ipc.new_file(str(Path(a.work) / f"ops-{a.mode}.arrow"), ops.schema) as w:
            w.write_table(ops)
    dist.destroy_process_group()
    Path(a.work, f"child-{a.mode.rstrip('%')}-{a.round}.json").write_text(json.dumps(report))


def _kernel_sums(prof, path: Path) -> dict[str, int]:
    """GPU time of the kernels (and copies) launched inside each ``ss_*`` range, by the range's thread
    or, for a backward, by autograd's (the training thread waits in ``backward()`` meanwhile): launches
    are matched to their kernels by the profiler's correlation ids."""
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    path.unlink()
    gpu = {e["args"]["correlation"]: (e["ts"], e["dur"]) for e in events
           if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in e.get("args", {})}
    launches = sorted((e["ts"], e["args"]["correlation"]) for e in events
                      if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}))
    out = {}
    for e in events:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ss_"):
            lo, hi = e["ts"], e["ts"] + e["dur"]
            mine = [gpu[c] for t, c in launches if lo <= t <= hi and c in gpu]
            if mine:  # (kernel time, first kernel's start to last kernel's end), ns
                out[e["name"]] = (int(sum(d for _, d in mine) * 1e3),
                                  int((max(t + d for t, d in mine) - min(t for t, _ in mine)) * 1e3))
    return out


# -- the driver -------------------------------------------------------------------------------------

def _run_child(a: argparse.Namespace, mode: str, rnd: int, bootstrap: str) -> dict:
    from services.ports import free_port

    cmd = [sys.executable, __file__, "--child", mode, "--round", str(rnd), "--bootstrap", bootstrap,
           "--out", a.out, "--work", a.work, "--port", str(free_port())]
    for k in ("steps", "microbatches", "batch", "seq", "vocab", "d_model", "layers", "heads", "slow_matmuls",
              "det_steps", "sync_every"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    if a.tiny:
        cmd.append("--tiny")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, check=True, env=env, timeout=600)
    return json.loads(Path(a.work, f"child-{mode.rstrip('%')}-{rnd}.json").read_text())


def _med_ms(xs) -> float:
    return statistics.median(xs) * 1e3


def _rel(a: float, b: float) -> float:
    return a / b - 1 if b else float("nan")


def _agreement(rep: dict) -> dict:
    """Recorded spans against the hand events and the profiler, per (step, microbatch)."""
    rec = {}
    for r in rep["ops"]:
        if r["optype"] in ("forward-compute", "backward-compute"):
            rec[(r["step"], r["mb_id"], r["optype"][:3])] = r["duration_ns"]
    out = {"fwd_hand": [], "bwd_hand": [], "fwd_kernels": [], "bwd_kernels": [], "fwd_busy": [], "bwd_busy": [],
           "fwd_hand_vs_kernels": [], "bwd_hand_vs_kernels": []}
    for h in rep["hand"]:
        if h["step"] < DROP:
            continue
        for k in ("fwd", "bwd"):
            got = rec.get((h["step"], h["mb"], "for" if k == "fwd" else "bac"))
            if got is None:
                continue
            out[f"{k}_hand"].append(_rel(got, h[f"{k}_ns"]))
            if h.get(f"{k}_kernels_ns"):
                out[f"{k}_kernels"].append(_rel(got, h[f"{k}_kernels_ns"]))
                out[f"{k}_busy"].append(_rel(got, h[f"{k}_busy_ns"]))
                out[f"{k}_hand_vs_kernels"].append(_rel(h[f"{k}_ns"], h[f"{k}_kernels_ns"]))
    out["missing"] = sum(1 for h in rep["hand"] for k in ("for", "bac") if (h["step"], h["mb"], k) not in rec)
    return out


def _whatif(rep: dict, ops) -> dict:
    from analyzers.whatif.api import analyze
    from core.layout import JobLayout

    res = analyze(ops, JobLayout(dp_size=1, pp_size=1, tp_size=1))
    host = {i: s for i, s in enumerate(rep["step_s"])}
    kept = [s for s in res.steps if s >= DROP]
    med = lambda key: statistics.median(res.step_time[key][s] for s in kept) * 1e3  # noqa: E731
    return dict(slowdown=res.slowdown, launch_slowdown=res.launch_slowdown, verdicts=res.verdicts,
                actual_ms=med("actual"), replay_ms=med("replay"),
                host_ms=statistics.median(host[s] for s in kept) * 1e3)


def _overhead(reps: dict, summary: dict) -> None:
    """Step time of the alternated bare / 10% / 100% runs, and their losses."""
    base = statistics.median(s for r in reps["bare"] for s in r["step_s"][DROP:])
    cbase = statistics.median(s for r in reps["bare"] for s in r["cpu_s"][DROP:])
    mbase = statistics.mean(s for r in reps["bare"] for s in r["step_s"][DROP:])
    print(f"{'run':>6} {'steps':>6} {'median ms':>10} {'vs bare':>8} {'mean ms':>8} {'vs bare':>8} {'CPU ms':>8} "
          f"{'CPU vs bare':>12}")
    for mode in ("bare", "10%", "100%"):
        st = [s for r in reps[mode] for s in r["step_s"][DROP:]]
        ct = [s for r in reps[mode] for s in r["cpu_s"][DROP:]]
        m, c, mean = statistics.median(st), statistics.median(ct), statistics.mean(st)
        per_round = [_rel(statistics.median(r["step_s"][DROP:]), statistics.median(x["step_s"][DROP:]))
                     for r, x in zip(reps[mode], reps["bare"])]
        summary["overhead"][mode] = dict(steps=len(st), median_ms=m * 1e3, vs_bare=_rel(m, base),
                                         mean_ms=mean * 1e3, mean_vs_bare=_rel(mean, mbase),
                                         cpu_ms=c * 1e3, per_round=per_round)
        print(f"{mode:>6} {len(st):>6} {m * 1e3:>10.2f} {_rel(m, base):>+8.2%} {mean * 1e3:>8.2f} "
              f"{_rel(mean, mbase):>+8.2%} {c * 1e3:>8.2f} {(c - cbase) * 1e3:>+9.2f} ms   rounds vs bare: "
              + " ".join(f"{x:+.2%}" for x in per_round))
    first = reps["bare"][0]["losses"]
    runs = [r for m in ("bare", "10%", "100%", "agree") for r in reps[m]]
    summary["losses_equal"] = all(r["losses"] == first for r in runs)
    summary["bare_losses_equal"] = all(r["losses"] == first for r in reps["bare"])
    summary["first_loss_equal"] = all(r["losses"][0] == first[0] for r in runs)
    print(f"losses bitwise equal across every bare, 10%, 100% and agree run: {summary['losses_equal']} "
          f"(bare runs among themselves: {summary['bare_losses_equal']}; first step's: "
          f"{summary['first_loss_equal']})")


def _check_run(rep: dict, ops) -> dict:
    """A checking run: its spans against hand events and the profiler, and its what-if replay."""
    ag = _agreement(rep)
    out = {k: (dict(n=len(v), median=statistics.median(v), max_abs=max(map(abs, v))) if v else None)
           for k, v in ag.items() if k != "missing"}
    out["missing"] = ag["missing"]
    print(f"\n{rep['mode']}: relative difference (median, max |.|, count); spans missing: {ag['missing']}; "
          f"exporter errors {rep.get('exporter_errors')}, records dropped {rep.get('records_dropped')}")
    for k, v in ag.items():
        if k != "missing" and v:
            print(f"  {k:>20}: {statistics.median(v):+.3%}  {max(map(abs, v)):.3%}  n={len(v)}")
    try:
        w = _whatif(rep, ops)
        out["whatif"] = w
        print(f"  what-if of the recorded spans: S {w['slowdown']:.4f}, launch slowdown "
              f"{w['launch_slowdown']:.4f}, verdicts {[v['kind'] for v in w['verdicts'] or []]}; median step: "
              f"spans {w['actual_ms']:.2f} ms, replayed {w['replay_ms']:.2f} ms, host {w['host_ms']:.2f} ms")
    except Exception as e:  # report, do not lose the figures above
        print(f"  what-if failed: {e!r}")
    return out


def _placement(rep: dict) -> dict | None:
    """Where the recorded forward spans start against when the GPU reached them (hand events tied to the
    host clock at every sync), and the launch-to-GPU lag: a placement by record time is early by that lag."""
    if "clock_ns" not in rep or not rep["hand"] or "fwd_gpu_at_ns" not in rep["hand"][0]:
        return None
    start = {(r["step"], r["mb_id"]): r["start_ns"] - rep["clock_ns"] for r in rep["ops"]
             if r["optype"] == "forward-compute"}
    err, lag = [], []
    for h in rep["hand"]:
        got = start.get((h["step"], h["mb"]))
        if h["step"] >= DROP and got is not None:
            err.append((got - h["fwd_gpu_at_ns"]) / 1e6)
            lag.append((h["fwd_gpu_at_ns"] - h["fwd_launch_ns"]) / 1e6)
    if not err:
        return None
    q = lambda xs, f: sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    out = dict(n=len(err), err_median_ms=statistics.median(err), err_p90_abs_ms=q([abs(e) for e in err], 0.9),
               err_max_abs_ms=max(map(abs, err)), lag_median_ms=statistics.median(lag), lag_max_ms=max(lag))
    print(f"  forward starts vs the GPU (ms, n={out['n']}): recorded - GPU median {out['err_median_ms']:+.3f}, "
          f"p90 |.| {out['err_p90_abs_ms']:.3f}, max |.| {out['err_max_abs_ms']:.3f}; launch-to-GPU lag median "
          f"{out['lag_median_ms']:.2f}, max {out['lag_max_ms']:.2f} (a record-time placement's error)")
    return out


def _slowed(rep: dict, summary: dict) -> None:
    """The slowed microbatch's recorded forward against the extra work's own events."""
    fwd: dict = {}
    for r in rep["ops"]:
        if r["optype"] == "forward-compute" and r["step"] >= DROP:
            fwd.setdefault(r["step"], {})[r["mb_id"]] = r["duration_ns"]
    extra = {h["step"]: h["extra_ns"] for h in rep["hand"] if h["mb"] == 1}
    ratios = [(d[1] - statistics.median(v for k, v in d.items() if k != 1)) / extra[s]
              for s, d in fwd.items() if 1 in d and len(d) > 1 and extra.get(s)]
    if ratios:
        summary["slow_excess_over_extra"] = dict(median=statistics.median(ratios), n=len(ratios),
                                                 extra_ms=statistics.median(extra.values()) / 1e6)
        print(f"\nslow: microbatch 1's recorded forward minus the others' median, over the extra matmuls' "
              f"own events ({statistics.median(extra.values()) / 1e6:.2f} ms): median {statistics.median(ratios):.4f} "
              f"over {len(ratios)} steps")


def driver(a: argparse.Namespace) -> None:
    from core import topics
    from core.kafka_admin import ensure_topics
    from services.broker import LocalBroker

    Path(a.out).mkdir(parents=True, exist_ok=True)
    import pyarrow.ipc as ipc

    tables: dict = {}
    reps: dict[str, list[dict]] = {m: [] for m in MODES}
    with LocalBroker() as b:
        ensure_topics(b.bootstrap, topics.INPUT_TOPICS, 4)
        for rnd in range(a.rounds if not a.only else 0):
            order = ["bare", "10%", "100%"]
            order = order[rnd % 3:] + order[:rnd % 3]  # no mode always runs first (a cold GPU) or last
            for mode in order:
                rep = _run_child(a, mode, rnd, b.bootstrap)
                reps[mode].append(rep)
                Path(a.out, "runs.json").write_text(json.dumps(reps))  # kept as it goes: a cut run keeps its figures
                st = rep["step_s"][DROP:]
                print(f"round {rnd + 1} {mode:>5}: median step {_med_ms(st):8.2f} ms over {len(st)} steps, "
                      f"CPU {_med_ms(rep['cpu_s'][DROP:]):7.2f} ms/step", flush=True)
        for mode in ("det-bare", "det-100%"):
            if not a.only or mode in a.only:
                reps[mode].append(_run_child(a, mode, 0, b.bootstrap))
                Path(a.out, "runs.json").write_text(json.dumps(reps))
        for mode in CHECKS:
            if a.only and mode not in a.only:
                continue
            rep = _run_child(a, mode, 0, b.bootstrap)
            # the rank's op spans, read once: the checks below and runs.json use them
            tables[mode] = ipc.open_file(str(Path(a.work) / f"ops-{mode}.arrow")).read_all()
            rep["ops"] = tables[mode].select(["step", "optype", "mb_id", "start_ns", "duration_ns"]).to_pylist()
            reps[mode].append(rep)
            Path(a.out, "runs.json").write_text(json.dumps(reps))
            shutil.copy(Path(a.work) / f"ops-{mode}.arrow", a.out)
    summary: dict = {"overhead": {}}
    any_rep = next(r[0] for r in reps.values() if r)
    print(f"\ndevice {any_rep['device']}, torch {any_rep['torch']}, {any_rep['params'] / 1e6:.0f}M parameters, "
          f"{a.microbatches} microbatches of {a.batch}x{a.seq} tokens")
    if reps["bare"]:
        _overhead(reps, summary)
    if reps["det-bare"] and reps["det-100%"]:
        dl = [reps[m][0]["losses"] for m in ("det-bare", "det-100%")]
        summary["deterministic_losses_equal"] = dl[0] == dl[1]
        summary["deterministic_warnings"] = sorted({w for m in ("det-bare", "det-100%")
                                                    for w in reps[m][0]["warnings"]})
        print(f"deterministic kernels: losses of {len(dl[0])} steps bitwise equal bare vs 100%: "
              f"{summary['deterministic_losses_equal']} (last {dl[0][-1]} vs {dl[1][-1]}); warnings: "
              f"{summary['deterministic_warnings']}")
    for mode in CHECKS:
        if reps[mode]:
            summary[mode] = _check_run(reps[mode][0], tables[mode])
            summary[mode]["placement"] = _placement(reps[mode][0])
    if reps["slow"]:
        _slowed(reps["slow"][0], summary)
    Path(a.out, "summary.json").write_text(json.dumps(summary, indent=1, default=str))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the figures: runs.json (every run), summary.json, "
                   "the checking runs' op spans (ops-*.arrow)")
    p.add_argument("--work", default="", help="scratch folder of the child processes (default: a temporary one)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of bare / 10%% / 100%%")
    p.add_argument("--steps", type=int, default=110, help="steps per run; the first 10 are dropped")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--slow-matmuls", type=int, default=60, help="2048^3 bf16 products added to the slowed forward")
    p.add_argument("--only", type=lambda t: t.split(","), default=[],
                   help="only these checking runs (agree,slow,ahead,det-bare,det-100%%): no overhead rounds")
    p.add_argument("--sync-every", type=int, default=10, help="the ahead run reads its loss every N steps")
    p.add_argument("--det-steps", type=int, default=20, help="steps of the deterministic pair (losses compared)")
    p.add_argument("--tiny", action="store_true", help="a small model on CPU: checks the script, measures nothing")
    p.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tiny:
        a.vocab, a.d_model, a.layers, a.heads, a.seq, a.batch = 512, 64, 2, 4, 32, 2
    if a.child:
        a.mode = a.child
        child(a)
        return
    with tempfile.TemporaryDirectory() as tmp:
        a.work = a.work or tmp
        driver(a)


if __name__ == "__main__":
    main()
