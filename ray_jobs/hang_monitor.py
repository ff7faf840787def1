"""Hang monitoring inside a shard: one ``HangTracker`` per job attempt it owns.

A reducer (``ray_jobs.checkpoint.Reducer``): heartbeats and CCL records are
added as they arrive; ``due(now)`` evaluates at most every ``every_s`` and
emits the new hangs as a unit of HANG rows (their alerts are the alert
reducer's, which reads the rows). "Now" for stalls is the wall clock (job clocks are aligned to wall time
by the exporters). A job whose heartbeats all stopped counts as node loss
only while the shard still hears other jobs (``input_alive``), so a broken
input does not page anyone about every job at once. Jobs silent for
``forget_after_s`` are dropped so memory stays bounded.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from analyzers.hang import HangParams, HangTracker, to_tables
from analyzers.recovery_basis import RecoveryBasis
from core.control import layered
from core import codec
from core import schema as S
from ray_jobs.checkpoint import Clock, Unit

log = logging.getLogger(__name__)

GPU_FIELDS = ("gpu_sm_mhz", "gpu_mem_mhz", "gpu_power_w", "gpu_power_limit_w", "gpu_temp_c", "gpu_throttle",
              "gpu_ecc_uncorrected", "gpu_pcie_replays")

_NS = 1_000_000_000
INPUT_GRACE_S = 3.0
"""How far past the newest heartbeat of any job the hang clock runs when no more arrive. Heartbeats come every
2 s from every rank (their watches speak for stopped ones), so an input silent for longer has stopped (a
broker or consumer outage): judged as of its last records, a job whose longest normal wait is q is then
stalled at most q + 3 s, under its threshold max(8 s, 2.5 q)."""


class HangReducer:
    consumes = frozenset({"heartbeat", "ccl_record", "job"})

    def __init__(self, params: HangParams = HangParams(), every_s: float = 1.0, forget_after_s: float = 3600.0,
                 clock: Clock = Clock(), gpu_every_s: float = 60.0,
                 recovery_of: Callable[[str, int], RecoveryBasis | None] | None = None):
        """``recovery_of(job, attempt)``: what a recovery plan needs of the job's last window analysed whole
        (``WindowReducer.recovery_of``); a node loss is stored and paged with the plan made from it."""
        self.params = params
        # Run-time changes (core.control): the configured thresholds, the fleet's and each job's overrides.
        self.base_params = params
        self.job_params: dict[str, HangParams] = {}
        self.recovery_of = recovery_of
        self.clock = clock
        self.every_s = every_s
        self.forget_after_s = forget_after_s
        self.trackers: dict[tuple[str, int], HangTracker] = {}
        self._last_seen: dict[tuple[str, int], float] = {}
        self._last_eval = 0.0
        self.last_input = 0.0
        self._freshest_ns = 0  # newest heartbeat seen from any job (job clock)
        self._freshest_arrived_ns = 0  # when it arrived (wall clock)
        # The same per input partition, and the partition each job's heartbeats come from (keyed by job: one
        # partition a job). In a backlog the partitions are read unevenly: judged by a clock another partition
        # had moved on, a job whose "finished" heartbeats were not read yet read as silent on every rank and
        # was paged as a node loss (every traced job of one test module, by the next module's pipeline, which
        # read the shared broker from its start: 9 critical pages for jobs that had ended).
        # A partition whose reading is done (nothing unread) has no clock of its own: a job on it whose every
        # rank fell silent must still be judged by the time the other partitions show (a node lost).
        self._inputs: dict[Any, list[int]] = {}  # partition -> [newest heartbeat ns, its arrival wall ns]
        self._input_of: dict[tuple[str, int], Any] = {}
        self.unread: set = set()  # partitions with records not read yet (the shard sets it from its source)
        self.hangs = 0  # stored
        self.heartbeat_age_s = 0.0  # wall clock minus the newest heartbeat, at its arrival
        # The latest GPU sample per (job, attempt, rank), stored at most every gpu_every_s (the heartbeats
        # carry one every 5 s; a row a minute per rank is what the fleet statistics need).
        self.gpu_every_s = gpu_every_s
        self.max_gpu_ranks = 1_000_000
        self._gpu: dict[tuple[str, int, int], dict] = {}
        self._gpu_sent: dict[tuple[str, int, int], int] = {}
        self._gpu_next = 0.0
        self.clock_held_back_s = 0.0  # wall clock minus the evaluation time, at the last evaluation
        # Where each rank runs (RANK_HOST rows): stored once per (job, attempt, rank, host), so a finding
        # about a rank or a worker can name its machine across jobs (lemon hosts).
        self._hosts_seen: dict[tuple[str, int, int, str], None] = {}
        self._hosts_new: list[dict] = []
        self.max_hosts_seen = 1_000_000

    def _by_job(self, table: pa.Table):
        jobs = pc.unique(table["job_id"]).to_pylist()
        for job in jobs:
            part = table if len(jobs) == 1 else table.filter(pc.equal(table["job_id"], job))
            for attempt in pc.unique(part["attempt"]).to_pylist():
                sub = part.filter(pc.equal(part["attempt"], attempt)) if part.num_rows else part
                key = (job, attempt)
                tr = self.trackers.get(key)
                if tr is None:
                    tr = self.trackers[key] = HangTracker(job, attempt, self.params_for(job))
                yield key, tr, sub

    def params_for(self, job_id: str) -> HangParams:
        """The thresholds ``job_id`` is judged by: its own run-time change, else the fleet's, else the configured."""
        return self.job_params.get(job_id, self.params)

    def set_overrides(self, fleet: dict, jobs: dict[str, dict]) -> None:
        """Thresholds changed at run time (``core.control.hang_overrides``): ``fleet`` for every job, ``jobs`` per
        job over the fleet's. Replaces the previous overrides whole (an ended change restores the configured
        value), and applies from the next evaluation on, to the jobs tracked now and to those to come."""
        self.params, self.job_params = layered(self.base_params, fleet, jobs)
        for (job, _), tr in self.trackers.items():
            tr.params = self.params_for(job)

    def _gpu_samples(self, table: pa.Table) -> None:
        """The latest GPU sample of each rank that reported one, for the next GPU_SAMPLE unit."""
        if "gpu_sm_mhz" not in table.column_names:
            return
        sampled = table.filter(pc.greater_equal(table["gpu_sm_mhz"], 0))
        for row in sampled.select(["job_id", "attempt", "rank", "host", "ts_ns", *GPU_FIELDS]).to_pylist():
            key = (row["job_id"], row["attempt"], row["rank"])
            if row["ts_ns"] > self._gpu.get(key, {}).get("ts_ns", -1):
                if key not in self._gpu and len(self._gpu) >= self.max_gpu_ranks:
                    del self._gpu[next(iter(self._gpu))]
                self._gpu[key] = row

    def hosts_of(self, job_id: str, attempt: int) -> dict[int, str]:
        """Where each rank of a job attempt runs, as its heartbeats say (rank -> host)."""
        tr = self.trackers.get((job_id, attempt))
        return tr.rank_hosts() if tr is not None else {}

    def gpu_of(self, job_id: str, attempt: int) -> dict[int, dict]:
        """The latest GPU sample of each rank of a job attempt (rank -> GPU_SAMPLE fields): hardware evidence."""
        return {k[2]: {n.removeprefix("gpu_"): v for n, v in row.items()}
                for k, row in self._gpu.items() if k[:2] == (job_id, attempt)}

    def _gpu_due(self, now: float) -> pa.Table | None:
        if now < self._gpu_next or not self._gpu:
            return None
        self._gpu_next = now + self.gpu_every_s
        rows = [{n.removeprefix("gpu_"): v for n, v in row.items()} for k, row in self._gpu.items()
                if row["ts_ns"] > self._gpu_sent.get(k, -1)]
        for k, row in self._gpu.items():
            self._gpu_sent[k] = row["ts_ns"]
        return codec.from_rows(S.GPU_SAMPLE, rows) if rows else None

    def _rank_hosts(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        cols = [table[c].to_pylist() for c in ("job_id", "attempt", "rank", "host", "ts_ns")]
        for job, attempt, rank, host, ts in zip(*cols):
            key = (job, attempt, rank, host)
            if key in self._hosts_seen:
                continue
            self._hosts_seen[key] = None
            if len(self._hosts_seen) > self.max_hosts_seen:  # bounded: the oldest go (the table keeps them)
                del self._hosts_seen[next(iter(self._hosts_seen))]
            self._hosts_new.append(dict(job_id=job, attempt=attempt, rank=rank, host=host, seen_ns=ts))

    def add_heartbeats(self, table: pa.Table, now: float, source=None) -> None:
        """``source``: the input partition the table was read from (None: not known, judged by the newest
        heartbeat of any partition)."""
        self.last_input = now
        self._gpu_samples(table)
        self._rank_hosts(table)
        if table.num_rows:
            newest = int(pc.max(table["ts_ns"]).as_py())
            wall = self.clock.wall_ns()
            if newest > self._freshest_ns:
                self._freshest_ns, self._freshest_arrived_ns = newest, wall
            if source is not None and newest > self._inputs.get(source, (0, 0))[0]:
                self._inputs[source] = [newest, wall]
            # How stale the input is on arrival (exporter -> broker -> here); hang detection waits for it.
            self.heartbeat_age_s = (wall - newest) / _NS
        for key, tr, sub in self._by_job(table):
            tr.add_heartbeats(sub)
            self._last_seen[key] = now
            if source is not None:
                self._input_of[key] = source

    def add_ccl(self, table: pa.Table, now: float) -> None:
        for key, tr, sub in self._by_job(table):
            tr.add_ccl(sub)
            self._last_seen[key] = now

    def evaluate(self, now: float, now_ns: int | None = None) -> pa.Table:
        """HANG rows of hangs found since the last call (at most one evaluation per ``every_s``)."""
        if now - self._last_eval < self.every_s:
            return codec.empty(S.HANG)
        self._last_eval = now
        wall_ns = self.clock.wall_ns() if now_ns is None else now_ns
        now_ns = self._held_back(wall_ns, self._freshest_ns, self._freshest_arrived_ns)
        self.clock_held_back_s = (wall_ns - now_ns) / _NS
        input_alive = now - self.last_input < self.params.heartbeat_timeout_s
        hangs = []
        for key, tr in list(self.trackers.items()):
            if now - self._last_seen.get(key, now) > self.forget_after_s:
                del self.trackers[key]
                self._last_seen.pop(key, None)
                self._input_of.pop(key, None)
                continue
            src = self._input_of.get(key)
            read = self._inputs.get(src) if src in self.unread else None
            hang = tr.evaluate(self._held_back(wall_ns, *read) if read else now_ns, input_alive=input_alive)
            if hang is not None:
                if hang.kind == "node_loss":
                    self._with_recovery_plan(hang, tr)
                hangs.append(hang)
        return to_tables(hangs, now_ns)["hang"]

    def _held_back(self, wall_ns: int, freshest_ns: int, arrived_ns: int) -> int:
        """The clock a job is judged by: its input as of what it has reached. While the input lags (a backlog
        after a restart, a slow consumer) the newest records are older than the wall clock, and measuring
        stalls against the wall would call every job hung on stale state. The clock runs on from the newest
        heartbeat as the wall has since it arrived (so a steady lag of 45 s pages nobody: every rank is judged
        45 s behind), and at most INPUT_GRACE_S past it: an input that stopped proves nothing about the jobs,
        and a clock that ran on further would turn the stop into a stall of every job (thresholds are 8 s and
        up)."""
        if not freshest_ns:
            return wall_ns
        since = max(0, wall_ns - arrived_ns)
        grace_ns = int(min(self.params.heartbeat_timeout_s, INPUT_GRACE_S) * 1e9)
        return min(wall_ns, freshest_ns + min(since, grace_ns))

    def _with_recovery_plan(self, hang, tr: HangTracker) -> None:
        """A loss's page carries its recovery plan (``analyzers.remedies``), made from the job's last window
        analysed whole: a lost node's, the restart on the nodes left; a lost process's (its host still reports),
        the restart in place, with the plan without its host should that host be drained. Where there is none,
        ``recovery_plan_missing`` says why. Never costs the hang its row."""
        basis = self.recovery_of(hang.job_id, hang.attempt) if self.recovery_of is not None else None
        if basis is None:
            hang.evidence["recovery_plan_missing"] = "no window of this job was analysed whole before the loss"
            return
        try:
            # The what-if's imports: on a loss only.
            from analyzers.remedies.advise import node_loss_plan, plan_for_process_loss

            if hang.op == "host silent":
                plan, why = node_loss_plan(basis, tr.rank_hosts(), hang.suspect_hosts)
            else:
                plan, why = plan_for_process_loss(basis, tr.rank_hosts(), hang.missing_ranks, hang.suspect_hosts), ""
        except Exception as e:
            log.warning("the recovery plan of %s failed: %s: %s", hang.job_id, type(e).__name__, e)
            plan, why = None, f"the plan failed: {type(e).__name__}: {e}"
        if plan is not None:
            hang.evidence["recovery_plan"] = plan
        else:
            hang.evidence["recovery_plan_missing"] = why

    # -- the reducer interface ------------------------------------------------
    def add_registrations(self, table: pa.Table) -> None:
        """A job registering attempt n was restarted: its earlier attempts' ranks going silent is the restart,
        not node loss (their trackers are dropped; a hang found before stays stored)."""
        for job, attempt in zip(table["job_id"].to_pylist(), table["attempt"].to_pylist()):
            for key in [k for k in self.trackers if k[0] == job and k[1] < attempt]:
                del self.trackers[key]
                self._last_seen.pop(key, None)

    def add(self, kind: str, table: pa.Table, at=None, now: float = 0.0) -> None:
        if kind == "job":
            self.add_registrations(table)
        else:
            if kind == "heartbeat":
                self.add_heartbeats(table, now, at[0] if at else None)  # at: ((topic, partition), offset)
            else:
                self.add_ccl(table, now)

    def due(self, now: float) -> list[Unit]:
        """The hangs found since the last evaluation, as one unit (hangs never wait for a window); the GPU
        samples when due, and the ranks seen on a host for the first time, as others."""
        out = []
        gpu = self._gpu_due(now)
        if gpu is not None:
            out.append(Unit(f"{gpu.num_rows} GPU sample(s)", {"gpu_sample": gpu}))
        if self._hosts_new:
            rows, self._hosts_new = self._hosts_new, []
            out.append(Unit(f"{len(rows)} rank host(s)", {"rank_host": codec.from_rows(S.RANK_HOST, rows)}))
        hangs = self.evaluate(now)
        if not hangs.num_rows:
            return out

        def stored(n=hangs.num_rows):
            self.hangs += n
        return out + [Unit(f"{hangs.num_rows} hang(s)", {"hang": hangs}, on_stored=stored)]

    def state(self) -> dict:
        """What a restarted shard resumes from (``ray_jobs.state``): every job's tracker, as of now."""
        return {"trackers": [tr.state() for tr in self.trackers.values()], "freshest_ns": self._freshest_ns,
                "inputs": [(src, ns) for src, (ns, _) in self._inputs.items()],
                "input_of": [(key, src) for key, src in self._input_of.items() if key in self.trackers]}

    def restore(self, state: dict) -> None:
        now = self.clock.monotonic()
        # This process's settings, not those of the one that saved them.
        trackers = [HangTracker.from_state(st, self.params_for(st["job_id"])) for st in state["trackers"]]
        self.trackers = {(tr.job_id, tr.attempt): tr for tr in trackers}
        self._last_seen = {key: now for key in self.trackers}  # monotonic times do not cross processes
        wall = self.clock.wall_ns()
        if int(state["freshest_ns"]) > self._freshest_ns:  # its arrival is unknown here: as of now
            self._freshest_ns, self._freshest_arrived_ns = int(state["freshest_ns"]), wall
        # Each partition's clock too (states saved before they were kept have none: the newest of any then).
        for src, ns in state.get("inputs", []):
            if int(ns) > self._inputs.get(tuple(src), (0, 0))[0]:
                self._inputs[tuple(src)] = [int(ns), wall]
        self._input_of.update({tuple(key): tuple(src) for key, src in state.get("input_of", [])})

    def snapshot(self) -> dict:
        return dict(hangs=self.hangs, heartbeat_age_s=self.heartbeat_age_s,
                    heartbeat_silence_s=self.clock.monotonic() - self.last_input if self.last_input else 0.0,
                    hang_clock_held_back_s=self.clock_held_back_s)
