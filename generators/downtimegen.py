"""A fleet's week of faults and restarts with exact ground truth, for the downtime accounting.

``generate_downtime_fleet(n_jobs, days, seed)`` simulates each job step by
step: step times around the job's own mean (uniform jitter), a synchronous
checkpoint save after every ``K``-th step, and faults at random times
(exponential gaps). Each fault is one of

- ``node_loss``: a host dies; the hang detector reports it (HANG + ALERT) and
  names the host at once; the job is cordoned and restarted;
- ``comm_hang``: a rank never enters a collective; detected and named at once;
- ``noncomm_hang``: every rank stalls outside communication; the first HANG
  row suspects every rank (nothing named), a second one names the rank later;
- ``crash``: the process exits (its exporter's ``close()`` sends a last
  heartbeat); no alert; the scheduler restarts the job;
- ``transient``: a communication hang that clears by itself: the same
  attempt makes progress again, nothing restarts.

A restart registers a new attempt, which loads the last complete checkpoint
(CHECKPOINT load rows) and runs from the step after it; with probability
``p_failed_reinit`` that attempt dies before its first step and another one
follows. The stream is what the pipeline would hold: JOB,
CHECKPOINT (rank 0 and rank 1 of every save and load), HEARTBEAT (rank 0,
every ``heartbeat_s``, with ``step_done`` and ``step_done_ns``), HANG and
ALERT rows, as Arrow tables of ``core.schema``.

``DowntimeFleet.truth`` holds one row per incident (DOWNTIME fields, plus
``resume_ns``) with the categories of ``analyzers/downtime.py`` computed
from the simulated timeline itself: fault start = end of the last completed
step (or of its save), ``resume_ns`` = the real start of the first step the
next attempt (or the cleared attempt) runs, lost progress = the summed real
durations of the steps redone. The accountant sees none of these directly:
it estimates step times from heartbeats and extrapolates the resume from
the first completed step it hears of. Faults are only placed where their
incident closes before the week ends.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np
import pyarrow as pa

from core import codec, jsonutil
from core import schema as S

_NS = 1_000_000_000
FAULT_KINDS = ("node_loss", "comm_hang", "noncomm_hang", "crash", "transient")
FAULT_P = (0.3, 0.25, 0.2, 0.15, 0.1)
START_NS = 1_700_000_000 * _NS


@dataclasses.dataclass(frozen=True)
class DowntimeFleet:
    registrations: pa.Table
    checkpoints: pa.Table
    heartbeats: pa.Table
    hangs: pa.Table
    alerts: pa.Table
    truth: list[dict]
    start_ns: int
    end_ns: int

    def tables(self) -> list[pa.Table]:
        return [self.registrations, self.checkpoints, self.heartbeats, self.hangs, self.alerts]

    def chunks(self, chunk_s: float = 3600.0) -> Iterator[tuple[int, list[pa.Table]]]:
        """(chunk end, tables) in time order: each record in the chunk of the moment it is sent
        (a checkpoint when it finished)."""
        times = [self.registrations["ts_ns"].to_numpy(),
                 self.checkpoints["ts_ns"].to_numpy() + self.checkpoints["duration_ns"].to_numpy(),
                 self.heartbeats["ts_ns"].to_numpy(), self.hangs["hang_id"].to_numpy(),
                 self.alerts["ts_ns"].to_numpy()]
        step = int(chunk_s * _NS)
        for lo in range(self.start_ns, self.end_ns + step, step):
            out = []
            for t, ts in zip(self.tables(), times):
                idx = np.flatnonzero((ts >= lo) & (ts < lo + step))
                if len(idx):
                    out.append(t.take(idx))
            yield lo + step, out


@dataclasses.dataclass
class _Run:
    """The steps one attempt ran: numbers, real start and end of each (ns), in blocks."""

    blocks: list = dataclasses.field(default_factory=list)  # (steps, starts, ends) arrays

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.blocks:
            return (np.zeros(0, np.int64),) * 3
        if len(self.blocks) > 1:
            self.blocks = [tuple(np.concatenate(c) for c in zip(*self.blocks))]
        return self.blocks[0]


class _JobSim:
    def __init__(self, job_id: str, rng: np.random.Generator, start_ns: int, end_ns: int, heartbeat_s: float,
                 p_failed_reinit: float):
        self.job_id, self.rng, self.end_ns = job_id, rng, end_ns
        self.heartbeat_ns = int(heartbeat_s * _NS)
        self.p_failed_reinit = p_failed_reinit
        self.n_gpus = int(rng.choice([64, 128, 256, 512, 1024, 2048]))
        self.step_s = float(rng.uniform(2.0, 10.0))
        self.every = max(20, int(rng.uniform(15, 60) * 60 / self.step_s))  # checkpoint every K steps
        self.mean_gap_s = float(rng.uniform(0.7, 2.0)) * 86400
        self.params = int(rng.choice([7, 13, 34, 70])) * 10**9
        self.team = str(rng.choice(["llm", "vision", "speech"]))
        self.regs: list[dict] = []
        self.ckpts: list[dict] = []
        self.hangs: list[dict] = []
        self.alerts: list[dict] = []
        self.hb: list[pa.Table] = []
        self.truth: list[dict] = []
        self.t = start_ns

    # -- pieces -------------------------------------------------------------
    def _register(self, attempt: int, ts: int) -> None:
        self.regs.append(dict(
            job_id=self.job_id, attempt=attempt, ts_ns=ts, team=self.team, model=f"gpt-{self.params // 10**9}b",
            n_gpus=self.n_gpus, dp_size=self.n_gpus // 8, pp_size=8, tp_size=1, cp_size=1, vpp_size=1,
            num_microbatches=8, profiled_steps=10, gpu_type="H100", peak_flops=989e12, flops_per_token=0.0,
            tokens_per_step=4 << 20, params=self.params, seq_len=4096))

    def _ckpt(self, attempt: int, step: int, ts: int, dur: int, kind: str) -> None:
        # Rank 1 finishes its shard first; rank 0 (the coordinator) last.
        early = int(self.rng.uniform(0, min(2 * _NS, dur)))
        for rank, d in ((1, dur - early), (0, dur)):
            self.ckpts.append(dict(job_id=self.job_id, attempt=attempt, rank=rank, step=step, ts_ns=ts,
                                   duration_ns=d, kind=kind))

    def _signal(self, attempt: int, ns: int, kind: str, since: int, missing: str, stuck: str, hosts: str,
                alert: bool) -> None:
        row = dict(job_id=self.job_id, attempt=attempt, hang_id=ns, kind=kind,
                   group="world" if kind == "comm_hang" else "", seq=-1, op="all_reduce" if missing else "",
                   stuck_ranks=stuck, missing_ranks=missing, suspect_hosts=hosts, since_ns=since,
                   duration_s=(ns - since) / _NS, evidence_json="{}")
        self.hangs.append(row)
        if alert:
            rule = "node_loss" if kind == "node_loss" else "hang"
            self.alerts.append(dict(
                alert_id=f"{self.job_id}/{attempt}/{rule}/{ns}", job_id=self.job_id, attempt=attempt, ts_ns=ns,
                rule=rule, severity="critical", summary=f"{self.job_id}: {kind}",
                details_json=jsonutil.dumps({k: row[k] for k in ("kind", "group", "seq", "op", "stuck_ranks",
                                                                 "missing_ranks", "suspect_hosts", "duration_s")})))

    def _heartbeats(self, attempt: int, t_from: int, t_to: int, run: _Run, extra: tuple[int, ...] = ()) -> None:
        phase = int(self.rng.uniform(0, self.heartbeat_ns))
        ts = np.concatenate([np.arange(t_from + phase, t_to, self.heartbeat_ns, dtype=np.int64),
                             np.asarray(extra, np.int64)])
        steps, _, ends = run.arrays()
        k = np.searchsorted(ends, ts, side="right") - 1
        done = np.where(k >= 0, steps[np.maximum(k, 0)] if len(steps) else -1, -1)
        done_ns = np.where(k >= 0, ends[np.maximum(k, 0)] if len(ends) else -1, -1)
        n = len(ts)
        if n == 0:
            return
        self.hb.append(pa.table({
            "job_id": [self.job_id] * n, "attempt": pa.array(np.full(n, attempt, np.int32)),
            "rank": pa.array(np.zeros(n, np.int32)), "host": ["node-0000"] * n,
            "pid": pa.array(np.full(n, 1000 + attempt, np.int64)), "ts_ns": pa.array(ts),
            "step": pa.array(np.where(done >= 0, done + 1, -1)),
            "last_op": pa.array(np.where(done >= 0, "optimizer", "")),
            "last_op_end_ns": pa.array(done_ns), "inflight_op": [""] * n, "inflight_group": [""] * n,
            "inflight_seq": pa.array(np.full(n, -1, np.int64)), "inflight_since_ns": pa.array(np.full(n, -1, np.int64)),
            "clock_offset_ns": pa.array(np.zeros(n, np.int64)), "stack": [""] * n,
            "step_done": pa.array(done), "step_done_ns": pa.array(done_ns)}))

    def _run_until(self, attempt: int, run: _Run, first_step: int, start: int, until: int) -> list[tuple]:
        """Run steps from ``first_step`` at ``start`` while they end by ``until``; saves after every K-th.

        Returns the saves started: (step, start ns, duration ns)."""
        saves, t, s = [], start, first_step
        while True:
            n = max(64, int((until - t) / (self.step_s * _NS) * 1.05) + 8)
            d = (self.step_s * self.rng.uniform(0.95, 1.05, n) * _NS).astype(np.int64)
            steps = s + np.arange(n, dtype=np.int64)
            save = (steps + 1) % self.every == 0
            stall = np.where(save, (self.rng.uniform(20, 90, n) * _NS).astype(np.int64), 0)
            starts = t + np.concatenate([[0], np.cumsum(d + stall)[:-1]])
            ends = starts + d
            m = int(np.searchsorted(ends, until, side="right"))
            if m:
                run.blocks.append((steps[:m], starts[:m], ends[:m]))
                saves += [(int(steps[i]), int(ends[i]), int(stall[i])) for i in np.flatnonzero(save[:m])]
            if m < n:
                return saves
            t, s = int(ends[-1] + stall[-1]), s + n

    # -- one job ------------------------------------------------------------
    def simulate(self) -> None:
        rng, attempt, t = self.rng, 0, self.t
        self._register(0, t)
        resume_step, saved = 0, -1  # the next step to run; the last complete save
        run_start = t + int(rng.uniform(120, 480) * _NS)
        run, reg_ns = _Run(), t
        while True:
            t_fault = run_start + int(max(1200.0, rng.exponential(self.mean_gap_s)) * _NS)
            if t_fault > self.end_ns - 6 * 3600 * _NS:
                for s, ts, d in self._run_until(attempt, run, resume_step, run_start, self.end_ns):
                    if ts + d <= self.end_ns:
                        self._ckpt(attempt, s, ts, d, "save")
                self._heartbeats(attempt, reg_ns, self.end_ns, run)
                return
            kind = str(rng.choice(FAULT_KINDS, p=FAULT_P))
            saves = self._run_until(attempt, run, resume_step, run_start, t_fault)
            if kind == "transient" and saves and saves[-1][1] <= t_fault < saves[-1][1] + saves[-1][2]:
                t_fault = saves[-1][1] + saves[-1][2]  # a hang that clears starts after the save
            steps, starts, ends = run.arrays()
            fault_step, t0 = int(steps[-1]), int(ends[-1])
            for s, ts, d in saves:
                if ts + d <= t_fault:
                    self._ckpt(attempt, s, ts, d, "save")
                    saved = s
                    if s == fault_step:
                        t0 = ts + d
            # The attempt began after the checkpoint it loaded: every step it ran after ``saved`` is redone.
            lost_s = float((ends - starts)[steps > saved].sum()) / _NS
            # Detection, naming, isolation.
            culprit = int(rng.integers(8, self.n_gpus))
            host = f"node-{culprit // 8:04d}"
            truth = dict(job_id=self.job_id, attempt=attempt, kind={"crash": "restart", "node_loss": "node_loss"}.get(
                kind, "hang"), fault_start_ns=t0, fault_step=fault_step, n_gpus=self.n_gpus, alert_ns=-1,
                diagnosed_ns=-1, restart_ns=-1)
            if kind == "crash":
                end_attempt = t_fault
                restart = t_fault + int(rng.uniform(60, 600) * _NS)
                self._heartbeats(attempt, reg_ns, end_attempt, run, extra=(t_fault,))
            else:
                d = t0 + int(rng.uniform(120, 1800 if kind != "transient" else 600) * _NS)
                everyone = f"0-{self.n_gpus - 1}"
                if kind == "node_loss":
                    lost = f"{culprit // 8 * 8}-{culprit // 8 * 8 + 7}"
                    self._signal(attempt, d, "node_loss", t0, lost, everyone, host, alert=True)
                    named = d
                elif kind in ("comm_hang", "transient"):
                    self._signal(attempt, d, "comm_hang", t0, str(culprit), everyone, host, alert=True)
                    named = d
                else:
                    self._signal(attempt, d, "noncomm_hang", t0, "", everyone, "", alert=True)
                    named = d + int(rng.uniform(600, 3 * 3600) * _NS)
                    self._signal(attempt, named, "noncomm_hang", t0, "", str(culprit), host, alert=False)
                truth.update(alert_ns=d, diagnosed_ns=named)
                if kind == "transient":
                    resume = named + int(rng.uniform(60, 1200) * _NS)
                    truth.update(resume_ns=resume, last_checkpoint_step=saved, lost_steps=0, restart_ns=-1,
                                 restart_attempt=-1, _cat=(d - t0, named - d, resume - named, 0, 0.0))
                    self.truth.append(truth)
                    resume_step, run_start = fault_step + 1, resume  # the stuck step runs again from resume
                    continue
                restart = named + int(rng.uniform(300, 3600) * _NS)
                end_attempt = restart - int(rng.uniform(10, 60) * _NS)
                self._heartbeats(attempt, reg_ns, end_attempt, run)
            # Restart: maybe a failed re-init first, then an attempt that loads and runs.
            attempt += 1
            self._register(attempt, restart)
            reg_ns = restart
            if rng.random() < self.p_failed_reinit:
                died = reg_ns + int(rng.uniform(60, 300) * _NS)
                self._heartbeats(attempt, reg_ns, died, _Run())
                attempt += 1
                reg_ns = died + int(rng.uniform(120, 600) * _NS)
                self._register(attempt, reg_ns)
            load_at = reg_ns + int(rng.uniform(30, 120) * _NS)
            load_dur = int(rng.uniform(30, 180) * _NS)
            if saved >= 0:
                self._ckpt(attempt, saved, load_at, load_dur, "load")
            run_start = load_at + load_dur + int(rng.uniform(10, 60) * _NS)
            truth.update(restart_ns=restart, restart_attempt=attempt, last_checkpoint_step=saved,
                         lost_steps=fault_step - saved, resume_ns=run_start)
            alert, named = truth["alert_ns"], truth["diagnosed_ns"]
            if kind == "crash":
                cats = (restart - t0, 0, 0, run_start - restart, lost_s)
            else:
                cats = (alert - t0, named - alert, restart - named, run_start - restart, lost_s)
            truth["_cat"] = cats
            self.truth.append(truth)
            resume_step, run = saved + 1, _Run()

    def finish_truth(self) -> None:
        for tr in self.truth:
            det, diag, iso, reinit, lost_s = tr.pop("_cat")
            det, diag, iso, reinit = (x / _NS for x in (det, diag, iso, reinit))
            total = det + diag + iso + reinit + lost_s
            gh = self.n_gpus / 3600.0
            tr.update(detect_s=det, diagnose_s=diag, isolate_s=iso, reinit_s=reinit, lost_progress_s=lost_s,
                      total_s=total, detect_gpu_hours=det * gh, diagnose_gpu_hours=diag * gh,
                      isolate_gpu_hours=iso * gh, reinit_gpu_hours=reinit * gh, lost_progress_gpu_hours=lost_s * gh,
                      total_gpu_hours=total * gh)


def generate_downtime_fleet(n_jobs: int = 12, days: float = 7.0, seed: int = 0, heartbeat_s: float = 30.0,
                            p_failed_reinit: float = 0.1) -> DowntimeFleet:
    """A fleet of ``n_jobs`` jobs over ``days`` with faults, checkpoints, restarts and exact truth."""
    end_ns = START_NS + int(days * 86400 * _NS)
    sims = []
    for j in range(n_jobs):
        rng = np.random.default_rng([seed, j])
        sim = _JobSim(f"dt-{seed}-{j:03d}", rng, START_NS + int(rng.uniform(0, 6 * 3600) * _NS), end_ns,
                      heartbeat_s, p_failed_reinit)
        sim.simulate()
        sim.finish_truth()
        sims.append(sim)
    hb = pa.concat_tables([t for s in sims for t in s.hb])
    return DowntimeFleet(
        registrations=codec.from_rows(S.JOB, [r for s in sims for r in s.regs]),
        checkpoints=codec.from_rows(S.CHECKPOINT, [r for s in sims for r in s.ckpts]),
        heartbeats=codec.conform(hb, S.HEARTBEAT),
        hangs=codec.from_rows(S.HANG, [r for s in sims for r in s.hangs]),
        alerts=codec.from_rows(S.ALERT, [r for s in sims for r in s.alerts]),
        truth=[t for s in sims for t in s.truth], start_ns=START_NS, end_ns=end_ns,
    )
