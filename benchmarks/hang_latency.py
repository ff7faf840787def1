"""From a hang's onset to its alert, end to end, on unchanged jobs under `stragglerscope trace` (issue 55, item 3).

    .venv/bin/python benchmarks/hang_latency.py [--repeat 1] [--save-s 40] [--only ddp-stop,...]

Real jobs (DDP: ``tests/training/ddp_checkpoint.py``; FSDP2 and a DP2 x PP2
``torch.distributed.pipelining`` 1F1B: ``tests/training/zoo.py``), 4 ranks on
gloo, steps of 0.5-1 s, launched with ``torchrun`` through ``stragglerscope
trace`` (its defaults: heartbeats every 2 s, each rank's watch process) into a
real Tansu broker; a real `stragglerscope run` (Ray shards, chDB) with the
``[hang]`` settings it ships with. Each hang is one of:

- ``stop``: rank 2 is SIGSTOPped (a debugger, the scheduler's suspend, a hung driver call);
- ``stall``: rank 2's forward of a step takes 600 s (a rank stuck in its compute: a kernel that never ends);
- ``node``: the job runs on two launchers (``torchrun --nnodes 2``, two ranks each) and the second "node"
  is lost: its launcher, ranks 2 and 3 and their watch processes are all frozen (SIGSTOP), as a dead host's
  would be: no heartbeat, no watch, and no connection reset, so ranks 0 and 1 wait in their collective. (A
  rank SIGKILLed on gloo is no hang: its peers' connections are reset, they fail at once and the launcher
  ends the job.)

The latency is from the onset (the stored hang's ``since_ns``: the last op any rank ended) to the stored
alert; the hang is right when its missing (or suspect) ranks include rank 2 and no healthy rank is named.
Then the false alarms: the DDP job checkpoints every 20 steps for ``--save-s`` seconds in each of the four
ways of ``ddp_checkpoint.py`` (rank 0 ``torch.save`` behind a barrier, every rank its own ``torch.save``,
``torch.distributed.checkpoint.save``, ``async_save``); any hang stored is a false alarm.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DDP = ROOT / "tests" / "training" / "ddp_checkpoint.py"
ZOO = ROOT / "tests" / "training" / "zoo.py"
JOBS = {
    "ddp": [str(DDP), "--steps", "5000", "--gpu-ms", "150"],
    "fsdp": [str(ZOO), "--framework", "fsdp", "--steps", "5000", "--gpu-ms", "150"],
    "pipe": [str(ZOO), "--framework", "pipelining", "--dp", "2", "--steps", "5000", "--gpu-ms", "40"],
}
CASES = ["ddp-stop", "ddp-stall", "ddp-node", "fsdp-stop", "fsdp-stall", "pipe-stop", "pipe-stall", "pipe-node",
         "ddp-stop", "fsdp-stop", "ddp-stall", "pipe-stop"]
STALL_AT = 30  # the step a stall is injected at (the threshold has adapted by then)


def torchrun(port: int, nnodes: int = 1, node_rank: int = 0) -> list[str]:
    per = 4 // nnodes
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(per), "--master-addr", "127.0.0.1", "--master-port", str(port)]


def launch(cfg: Path, job: str, args: list[str], log: Path, two_nodes: bool = False) -> subprocess.Popen:
    from services.ports import free_fixed_port

    port = free_fixed_port()
    if two_nodes:
        a = " ".join(torchrun(port, 2, 0) + args)
        b = " ".join(torchrun(port, 2, 1) + args)
        command = ["bash", "-c", f"{a} & {b} & wait"]
    else:
        command = torchrun(port) + args
    cmd = [sys.executable, "-m", "stragglerscope", "trace", "--config", str(cfg), "--job-id", job,
           "--sample", "10/100", "--", *command]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def rank_pid(job: str, rank: int, timeout: float = 120) -> int:
    want = {f"STRAGGLERSCOPE_TRACE_JOB_ID={job}".encode(), f"RANK={rank}".encode()}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    env = set((d / "environ").read_bytes().split(b"\0"))
                    cmd = (d / "cmdline").read_bytes()
                except OSError:
                    continue
                if want <= env and b"torch.distributed.run" not in cmd and b"stragglerscope" not in cmd \
                        and b"rank_watch" not in cmd:
                    return int(d.name)
        time.sleep(0.5)
    raise RuntimeError(f"rank {rank} of {job} never started")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def wait_for(store, sql: str, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = store.query(sql).to_pylist()
        if rows:
            return rows
        time.sleep(0.5)
    return []


def one_hang(cfg: Path, store, case: str, logs: Path) -> dict:
    framework, fault = case.split("-")
    job = f"{case}-{uuid.uuid4().hex[:6]}"
    args = list(JOBS[framework])
    if fault == "stall":
        args += ["--stall-rank", "2", "--stall-at-step", str(STALL_AT), "--stall-s", "600"]
    proc = launch(cfg, job, args, logs / f"{job}.log", two_nodes=fault == "node")
    frozen: list[int] = []
    try:
        pid = rank_pid(job, 2)
        if fault != "stall":
            # The first window (steps 0-9) stored, then 20 s more: the ranks know their pace.
            if not wait_for(store, f"SELECT 1 FROM windows WHERE job_id = '{job}' LIMIT 1", 240):
                return dict(case=case, job=job, error="no window stored")
            time.sleep(20)
            if fault == "stop":
                frozen = [pid]
            else:  # the second node's launcher and everything under it
                agent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                frozen = descendants(agent)
            signal_all(frozen, signal.SIGSTOP)
        rows = wait_for(store, f"SELECT h.since_ns AS since_ns, h.hang_id AS found_ns, h.kind AS kind, "
                               f"h.missing_ranks AS missing, h.stuck_ranks AS stuck, h.evidence_json AS ev, "
                               f"a.ts_ns AS alerted_ns FROM hangs AS h ALL INNER JOIN (SELECT job_id, ts_ns, "
                               f"alert_id FROM alerts WHERE rule IN ('hang', 'node_loss') AND job_id = '{job}') AS a "
                               f"USING (job_id) WHERE h.job_id = '{job}' AND h.kind != 'hang_ended' "
                               f"ORDER BY h.hang_id LIMIT 1", 300)
    finally:
        signal_all(frozen, signal.SIGCONT)
        stop(proc)
    if not rows:
        return dict(case=case, job=job, error="no hang alerted within 300 s")
    r = rows[0]
    states = json.loads(r["ev"]).get("states", {})
    named = r["missing"] or (r["stuck"] if r["kind"] == "noncomm_hang" else "")
    from analyzers.explain import parse_ranks

    expected = {2, 3} if fault == "node" else {2}
    right = set(parse_ranks(named)) == expected
    return dict(case=case, job=job, kind=r["kind"], named=named, states=states, right=right,
                latency_s=(r["alerted_ns"] - r["since_ns"]) / 1e9, found_s=(r["found_ns"] - r["since_ns"]) / 1e9)


def one_checkpoint(cfg: Path, store, kind: str, save_s: float, logs: Path) -> dict:
    job = f"ckpt-{kind}-{uuid.uuid4().hex[:6]}"
    args = [str(DDP), "--steps", "70", "--gpu-ms", "150", "--checkpoint", kind, "--every", "20",
            "--save-s", str(save_s), "--dir", str(logs / job)]
    proc = launch(cfg, job, args, logs / f"{job}.log")
    try:
        rc = proc.wait(3 * save_s * 4 + 600)
    finally:
        stop(proc)
    time.sleep(5)  # what the pipeline had in hand when the job ended
    hangs = store.query(f"SELECT kind, duration_s, missing_ranks FROM hangs WHERE job_id = '{job}'").to_pylist()
    return dict(kind=kind, job=job, rc=rc, hangs=hangs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=1, help="times each of the 12 hangs is run")
    p.add_argument("--save-s", type=float, default=40.0, help="seconds each checkpoint save takes (0: none)")
    p.add_argument("--only", default="", help="comma-separated cases to run (e.g. ddp-stop,pipe-kill)")
    p.add_argument("--no-checkpoints", action="store_true", help="skip the false-alarm runs")
    a = p.parse_args()

    from core import topics
    from core.kafka_admin import ensure_topics
    from services.broker import LocalBroker
    from tests.fleet import fleet_config, start_fleet, stop_fleet

    cases = [c for c in CASES if not a.only or c in a.only.split(",")] * a.repeat
    with LocalBroker() as broker, tempfile.TemporaryDirectory() as d:
        logs = Path(d)
        ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 4)
        cfg = fleet_config(logs, broker.bootstrap)
        proc, store = start_fleet(cfg, logs / "run.log")
        try:
            results = []
            for i, case in enumerate(cases):
                r = one_hang(cfg, store, case, logs)
                results.append(r)
                if "error" in r:
                    print(f"[{i + 1}/{len(cases)}] {case}: {r['error']}", flush=True)
                else:
                    print(f"[{i + 1}/{len(cases)}] {case}: {r['kind']} naming {r['named']} {r['states'] or ''} "
                          f"({'right' if r['right'] else 'WRONG'}); found {r['found_s']:.1f} s, alerted "
                          f"{r['latency_s']:.1f} s after the onset", flush=True)
            lat = sorted(r["latency_s"] for r in results if "latency_s" in r)
            if lat:
                p90 = lat[min(len(lat) - 1, int(round(0.9 * (len(lat) - 1))))]
                print(f"hang onset -> alert over {len(lat)} of {len(results)} hangs: median "
                      f"{statistics.median(lat):.1f} s, p90 {p90:.1f} s, max {lat[-1]:.1f} s (target: p90 15 s); "
                      f"right rank named in {sum(r.get('right', False) for r in results)} of {len(results)}")
            if a.save_s > 0 and not a.no_checkpoints:
                false = 0
                for kind in ("rank0", "per-rank", "dcp", "dcp-async"):
                    r = one_checkpoint(cfg, store, kind, a.save_s, logs)
                    false += len(r["hangs"])
                    print(f"checkpoints '{kind}', 3 saves of {a.save_s:.0f} s: {len(r['hangs'])} hang(s) "
                          f"{r['hangs']}; the job exited with {r['rc']}", flush=True)
                print(f"false alarms over 12 checkpoint saves of {a.save_s:.0f} s: {false} (target: 0)")
        finally:
            stop_fleet(proc, store)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
