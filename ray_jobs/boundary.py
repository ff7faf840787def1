"""Semantic checks on decoded input records, at the shard's boundary.

``core.codec.decode`` guarantees structure: a known kind and version, the
columns and types of its schema, valid Arrow buffers. This module guarantees
meaning, so that no record can turn into an absurd stored result: a record
belongs to the job its Kafka key names (a job's records must all reach one
shard), job ids are short and printable, durations and times are within the
bounds of ``[validation]``, ranks fit the registered layout, and a
registration declares a layout that exists.

Each check splits a table into the rows it keeps and the rows it refuses,
with one reason per refused group ("3 op_span rows: duration over 21600 s");
the shard dead-letters the refused rows with those reasons and goes on with
the rest. A bad row never costs its neighbours their place.

Clocks: heartbeats and collectives are live records, stamped on the job clock,
which the exporters align to wall time. A rank whose clock is off by more than
``max_clock_skew_s`` (a host without NTP, a reset RTC) gets its skew estimated
from its heartbeats, against its peers' clocks, and subtracted from its
heartbeats, collectives and checkpoints (``ClockGuard``), so that a rank
running three hours ahead can neither hide a hang nor fake one, nor make a
healthy peer look lost.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.config import ValidationConfig
from core.layout import JobLayout
from core.schema import CHECKPOINT_KINDS

_NS = 1_000_000_000
JOB_ID_CHARS = "A-Z a-z 0-9 . _ - : / @ + ="
_JOB_ID = re.compile(r"[A-Za-z0-9._:/@+=-]+")
TIME_MAX_NS = 1 << 62
"""Times at or past this (year 2116) are not times; it also keeps start + duration inside int64."""


def job_id_problem(job_id: Any, max_len: int) -> str:
    """Why ``job_id`` is not an acceptable job id, or "" when it is."""
    if not isinstance(job_id, str) or not job_id:
        return "job id is empty"
    if len(job_id) > max_len:
        return f"job id longer than {max_len} characters"
    if not _JOB_ID.fullmatch(job_id):
        return f"job id {job_id[:80]!r} has characters outside {JOB_ID_CHARS}"
    return ""


@dataclasses.dataclass
class Split:
    """The rows kept and, per reason, how many rows were refused."""

    good: pa.Table
    refused: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def reason(self) -> str:
        return "; ".join(f"{n} {why}" for n, why in self.refused)


def _apply(table: pa.Table, kind: str, rules: list[tuple[Any, str]]) -> Split:
    """Keep the rows no rule flags; each refused row is counted under the first rule that flags it."""
    if table.num_rows == 0:
        return Split(table)
    taken = np.zeros(table.num_rows, dtype=bool)
    refused = []
    for mask, why in rules:
        if isinstance(mask, (pa.Array, pa.ChunkedArray)):  # Arrow masks: a null compares as refused
            mask = pc.fill_null(mask, True).to_numpy(zero_copy_only=False)
        new = np.asarray(mask, dtype=bool) & ~taken
        n = int(new.sum())
        if n:
            refused.append((n, f"{kind} rows: {why}"))
            taken |= new
    if not refused:
        return Split(table)
    return Split(table.filter(pa.array(~taken)), refused)


def _col(table: pa.Table, name: str) -> np.ndarray:
    return table[name].to_numpy(zero_copy_only=False)


def _key_rules(table: pa.Table, key: str | None, limits: ValidationConfig) -> list[tuple[Any, str]]:
    """Rows must carry the job id their Kafka key names, and a valid one; attempts are not negative."""
    rules: list[tuple[Any, str]] = []
    problem = job_id_problem(key, limits.max_job_id_len) if key is not None else "no Kafka key"
    if problem:
        rules.append((np.ones(table.num_rows, dtype=bool), f"{problem} (Kafka key)"))
    else:
        rules.append((pc.not_equal(table["job_id"], key),
                      f"job_id differs from the Kafka key {key!r} (a job's records must share one key)"))
    rules.append((pc.less(table["attempt"], 0), "negative attempt"))
    return rules


def _layout_rules(table: pa.Table, layout: JobLayout | None, limits: ValidationConfig,
                  workers: bool) -> list[tuple[Any, str]]:
    """Ranks inside the registered layout (or, before a registration, inside the largest allowed)."""
    world = layout.world_size if layout is not None else limits.max_world_size
    where = f"the registered layout (world size {world})" if layout is not None else \
        f"validation.max_world_size ({world})"
    rules: list[tuple[Any, str]] = [
        (pc.or_(pc.less(table["rank"], 0), pc.greater_equal(table["rank"], world)), f"rank outside {where}")]
    if workers:
        dp = layout.dp_size if layout is not None else limits.max_world_size
        pp = layout.pp_size if layout is not None else limits.max_world_size
        rules.append((pc.or_(pc.less(table["dp_rank"], 0), pc.greater_equal(table["dp_rank"], dp)),
                      f"dp_rank outside 0..{dp - 1}"))
        rules.append((pc.or_(pc.less(table["pp_rank"], 0), pc.greater_equal(table["pp_rank"], pp)),
                      f"pp_rank outside 0..{pp - 1}"))
    return rules


def check_op_spans(table: pa.Table, key: str | None, layout: JobLayout | None, limits: ValidationConfig) -> Split:
    max_ns = int(limits.max_op_duration_s * _NS)
    start, dur = _col(table, "start_ns"), _col(table, "duration_ns")
    return _apply(table, "op_span", _key_rules(table, key, limits) + _layout_rules(table, layout, limits, True) + [
        (dur < 0, "negative duration"),
        (dur > max_ns, f"duration over validation.max_op_duration_s ({limits.max_op_duration_s:g} s)"),
        ((start < 0) | (start >= TIME_MAX_NS), "start_ns outside 0..2^62"),
        (pc.less(table["step"], 0), "negative step"),
        (pc.or_(pc.less(table["mc"], -1), pc.less(table["gmc"], -1)), "model chunk below -1"),
        (pc.less(table["mb_id"], -1), "microbatch below -1"),
    ])


def check_checkpoints(table: pa.Table, key: str | None, layout: JobLayout | None, limits: ValidationConfig) -> Split:
    max_ns = int(limits.max_op_duration_s * _NS)
    dur, ts = _col(table, "duration_ns"), _col(table, "ts_ns")
    return _apply(table, "checkpoint", _key_rules(table, key, limits) + _layout_rules(table, layout, limits, False) + [
        (pc.invert(pc.is_in(table["kind"], pa.array(CHECKPOINT_KINDS))), "kind other than save or load"),
        (pc.less(table["step"], 0), "negative step"),
        ((dur < 0) | (dur > max_ns), f"duration negative or over {limits.max_op_duration_s:g} s"),
        ((ts < 0) | (ts >= TIME_MAX_NS), "ts_ns outside 0..2^62"),
    ])


def check_ccl(table: pa.Table, key: str | None, layout: JobLayout | None, limits: ValidationConfig,
              wall_ns: int) -> Split:
    """Collectives: exit after enter (or -1 while in flight), bounded length, enter near the wall clock.

    Call after ``ClockGuard.correct_ccl``: a skewed rank's times are corrected by then.
    """
    max_ns = int(limits.max_op_duration_s * _NS)
    enter, exit_ = _col(table, "enter_ns"), _col(table, "exit_ns")
    done = exit_ != -1
    future = wall_ns + int(limits.max_clock_skew_s * _NS)
    return _apply(table, "ccl_record", _key_rules(table, key, limits) + _layout_rules(table, layout, limits, False) + [
        ((enter < 0) | (enter >= TIME_MAX_NS), "enter_ns outside 0..2^62"),
        (done & (exit_ < enter), "exit_ns before enter_ns"),
        (done & (exit_ - enter > max_ns), f"longer than validation.max_op_duration_s ({limits.max_op_duration_s:g} s)"),
        (~done & (enter < wall_ns - int(limits.max_record_age_s * _NS)),
         f"in flight since more than validation.max_record_age_s ({limits.max_record_age_s:g} s)"),
        (enter > future, f"enter_ns more than validation.max_clock_skew_s ({limits.max_clock_skew_s:g} s) "
                         "ahead of the wall clock"),
        (pc.less(table["nbytes"], 0), "negative nbytes"),
    ])


def check_tcp_flows(table: pa.Table, key: str | None, layout: JobLayout | None, limits: ValidationConfig) -> Split:
    """Connection counters: differences over one step, so never negative, and no longer than an op may be."""
    max_ns = int(limits.max_op_duration_s * _NS)
    counters = ("bytes_acked", "bytes_received", "busy_us", "rwnd_limited_us", "sndbuf_limited_us", "rtt_us",
                "min_rtt_us", "retrans", "notsent_bytes")
    elapsed = _col(table, "elapsed_ns")
    rules = _key_rules(table, key, limits) + _layout_rules(table, layout, limits, False) + [
        ((elapsed < 0) | (elapsed > max_ns), f"elapsed_ns outside 0..validation.max_op_duration_s "
                                             f"({limits.max_op_duration_s:g} s)"),
        (_col(table, "busy_us") > elapsed // 1000 + 1_000_000, "busy_us longer than the time it was read over"),
    ]
    rules += [(_col(table, c) < 0, f"negative {c}") for c in counters]
    rules.append((pc.or_(pc.equal(pc.utf8_length(table["local"]), 0), pc.equal(pc.utf8_length(table["remote"]), 0)),
                  "a connection without its endpoints"))
    return _apply(table, "tcp_flow", rules)


def check_port_counters(table: pa.Table, key: str | None, layout: JobLayout | None,
                        limits: ValidationConfig) -> Split:
    """A host's port counters: differences (-1 where unknown, never below), over a time no longer than the oldest
    record kept, with the port named; the driver counters' JSON short (a fixed list is read)."""
    max_ns = int(limits.max_record_age_s * _NS)
    elapsed, ts = _col(table, "elapsed_ns"), _col(table, "ts_ns")
    counters = ("xmit_wait", "xmit_discards", "rcv_discards", "symbol_errors", "rcv_errors", "link_downed",
                "link_error_recovery", "xmit_bytes", "rcv_bytes")
    rules = _key_rules(table, key, limits) + _layout_rules(table, layout, limits, False) + [
        ((elapsed < 0) | (elapsed > max_ns), f"elapsed_ns outside 0..validation.max_record_age_s "
                                             f"({limits.max_record_age_s:g} s)"),
        ((ts < 0) | (ts >= TIME_MAX_NS), "ts_ns outside 0..2^62"),
        (pc.or_(pc.equal(pc.utf8_length(table["device"]), 0), pc.less(table["port"], 0)), "a port without its name"),
        (pc.greater(pc.utf8_length(table["hw_counters_json"]), 4096), "hw_counters_json over 4096 characters"),
    ]
    rules += [(_col(table, c) < -1, f"{c} below -1") for c in counters]
    return _apply(table, "port_counter", rules)


def check_heartbeats(table: pa.Table, key: str | None, layout: JobLayout | None, limits: ValidationConfig,
                     wall_ns: int) -> Split:
    """Heartbeats after ``ClockGuard.correct_heartbeats``: times plausible and consistent with ``ts_ns``."""
    ahead = int(limits.max_clock_skew_s * _NS)
    age = int(limits.max_record_age_s * _NS)
    ts = _col(table, "ts_ns")
    rules = _key_rules(table, key, limits) + _layout_rules(table, layout, limits, False) + [
        ((ts > wall_ns + ahead) | (ts < wall_ns - age), "ts_ns outside the wall clock's bounds"),
    ]
    for name in ("last_op_end_ns", "inflight_since_ns", "step_done_ns"):
        v = _col(table, name)
        rules.append(((v > ts + ahead) | ((v > 0) & (v < ts - age)), f"{name} outside the heartbeat's time range"))
    return _apply(table, "heartbeat", rules)


def check_registration(row: Mapping[str, Any], key: str | None, limits: ValidationConfig, *,
                       stored: bool = False) -> str:
    """Why a JOB row cannot be accepted, or "" (then ``Registration.from_row`` cannot fail).

    A registration from Kafka needs the key its job id names, as every other record does: keyless, it could
    land on another shard than the job's records and register the job where none of them is. ``stored``: the
    row was read back from the store, where registrations have no key (it was checked when it arrived).
    """
    problem = job_id_problem(row.get("job_id"), limits.max_job_id_len)
    if problem:
        return problem
    if not stored:
        problem = job_id_problem(key, limits.max_job_id_len) if key is not None else "no Kafka key"
        if problem:
            return f"{problem} (Kafka key)"
        if row["job_id"] != key:
            return f"job_id differs from the Kafka key {key!r} (a job's records must share one key)"
    if row.get("attempt", 0) < 0:
        return "negative attempt"
    sizes = {k: row.get(k) for k in ("dp_size", "pp_size", "tp_size", "cp_size", "vpp_size")}
    bad = [f"{k}={v}" for k, v in sizes.items() if not isinstance(v, int) or v < 1]
    if bad:
        return f"layout sizes must be at least 1: {', '.join(bad)}"
    world = sizes["dp_size"] * sizes["pp_size"] * sizes["tp_size"] * sizes["cp_size"]
    if world > limits.max_world_size:
        return f"world size {world} over validation.max_world_size ({limits.max_world_size})"
    n_gpus = row.get("n_gpus") or 0
    if n_gpus and n_gpus != world:
        return f"n_gpus {n_gpus} differs from the layout's world size {world} (dp x pp x tp x cp)"
    for k in ("num_microbatches", "profiled_steps", "tokens_per_step", "params", "seq_len", "num_layers"):
        if (row.get(k) or 0) < 0:
            return f"negative {k}"
    for k in ("peak_flops", "flops_per_token"):
        v = row.get(k) or 0.0
        if not math.isfinite(v) or v < 0:
            return f"{k} must be a finite number >= 0, got {v}"
    if not 0 <= (row.get("ts_ns") or 0) < TIME_MAX_NS:
        return "ts_ns outside 0..2^62"
    return ""


class ClockGuard:
    """Clocks that cannot be right, corrected in heartbeats, collectives and checkpoints.

    Heartbeats are live, so a heartbeat stamped more than ``max_clock_skew_s``
    ahead of the wall clock, or more than ``max_record_age_s`` behind it (no
    backlog is that old; a reset RTC says 1970), comes from a wrong clock. That
    rank's skew is subtracted from every time of its heartbeats, collectives
    and checkpoints until a heartbeat within bounds arrives. Offsets inside
    those bounds are left alone: a backlog replayed after a restart is
    legitimately hours behind. A rank a few minutes behind its peers is not
    caught here (that needs the peers' step times; see the window's check).

    The skew is the heartbeat's offset to the wall clock at arrival *minus the
    delay of the input it came with*: the delay of the latest heartbeats of the
    job's ranks whose clocks are plausible (one Kafka key, one partition, one
    lag), or of any job when none of its clocks is. Measured against arrival
    alone, a corrected rank would read as fresher than its peers by the input's
    delay: under a lag longer than the heartbeat timeout its healthy peers
    looked lost (the node-loss page named the wrong host), a backlog read in a
    burst made a lost rank look alive, and the hang monitor's evaluation clock,
    held back to the newest heartbeat, was pushed to the wall for every job.
    Before the first plausible heartbeat (a shard that starts on a backlog)
    there is nothing to measure against: a wrong clock's heartbeats are left
    as they are, so ``check_heartbeats`` refuses them, until one arrives or
    ``_BLIND_ROWS`` heartbeats went by without one (every clock the shard
    hears is wrong: arrival is then the only reference).
    """

    _HB_TIMES = ("ts_ns", "last_op_end_ns", "inflight_since_ns", "step_done_ns")
    _CCL_TIMES = ("enter_ns", "exit_ns")
    _CKPT_TIMES = ("ts_ns",)
    _PEERS = 8
    """Plausible ranks per job whose delays are kept: the median of a few is not fooled by one odd clock."""
    _BLIND_ROWS = 64
    """Heartbeats with no plausible clock among them after which arrival is taken as the reference."""

    def __init__(self, limits: ValidationConfig, max_ranks: int = 1_000_000, max_jobs: int = 100_000):
        self.ahead_ns = int(limits.max_clock_skew_s * _NS)
        self.behind_ns = int(limits.max_record_age_s * _NS)
        self.skew: dict[tuple[str, int, int], int] = {}  # (job, attempt, rank) -> ns to subtract
        self._jobs: dict[str, int] = {}  # job -> ranks of it in ``skew``: other jobs' batches skip the row loop
        self._max = max_ranks
        self._delay: dict[str, dict[int, int]] = {}  # job -> {plausible rank: arrival minus ts of its latest}
        self._max_jobs = max_jobs
        self._input_delay: int | None = None  # the same, of the latest plausible heartbeat of any job
        self._blind = 0  # heartbeats seen before any plausible one
        self.corrected_rows = 0

    def correct_heartbeats(self, table: pa.Table, wall_ns: int) -> pa.Table:
        if table.num_rows == 0:
            return table
        ts = _col(table, "ts_ns")
        off = ts - wall_ns
        wrong = (off > self.ahead_ns) | (off < -self.behind_ns)
        self._note_delays(table, -off, wrong)
        if not wrong.any() and not any(j in self._jobs for j in pc.unique(table["job_id"]).to_pylist()):
            return table
        keys = _rank_keys(table)
        # One skew per rank and table, from its newest heartbeat: a table's heartbeats keep their spacing.
        newest: dict[tuple[str, int, int], int] = {}
        for i, k in enumerate(keys):
            if wrong[i] and (k not in newest or ts[i] > ts[newest[k]]):
                newest[k] = i
        if self._input_delay is None:
            self._blind += int(wrong.sum())
        for k, i in list(newest.items()):
            ref = self._reference_delay(k[0])
            if ref is None:
                del newest[k]  # nothing to measure against yet: left as it is, refused by the checks
                continue
            if k not in self.skew:
                if len(self.skew) >= self._max:
                    self._forget(next(iter(self.skew)))
                self._jobs[k[0]] = self._jobs.get(k[0], 0) + 1
            self.skew[k] = int(off[i]) + ref
        for k in {k for i, k in enumerate(keys) if not wrong[i]} - newest.keys():
            if k in self.skew:
                self._forget(k)  # its clock is plausible again: trust it
        delta = np.array([self.skew[k] if wrong[i] and k in newest else 0 for i, k in enumerate(keys)],
                         dtype=np.int64)
        return self._shift(table, delta, self._HB_TIMES)

    def _note_delays(self, table: pa.Table, delay: np.ndarray, wrong: np.ndarray) -> None:
        """Remember how late the heartbeats of plausible clocks arrive, per job: the reference of a skewed peer."""
        if table.num_rows == 1:  # the usual message: one rank's heartbeat
            if not wrong[0]:
                self._input_delay = max(int(delay[0]), 0)  # a clock a little ahead: no negative delay
                self._remember(table["job_id"][0].as_py(), [(table["rank"][0].as_py(), self._input_delay)])
            return
        rows = np.flatnonzero(~wrong)
        if not len(rows):
            return
        delay = np.maximum(delay, 0)
        self._input_delay = int(delay[rows[-1]])
        rank = _col(table, "rank")
        jobs = table["job_id"].combine_chunks().dictionary_encode()
        job_of = jobs.indices.to_numpy(zero_copy_only=False)[rows]
        for j, job in enumerate(jobs.dictionary.to_pylist()):
            mine = rows[job_of == j][::-1]  # newest first
            if not len(mine):
                continue
            _, first = np.unique(rank[mine], return_index=True)  # each rank's newest row
            newest = mine[np.sort(first)[:self._PEERS]][::-1]  # the last few ranks heard, oldest first
            self._remember(job, list(zip(rank[newest].tolist(), delay[newest].tolist())))

    def _remember(self, job: str, delays: list[tuple[int, int]]) -> None:
        """(rank, delay) of the job's newest plausible heartbeats, oldest first, into the job's few kept."""
        known = self._delay.pop(job, None)  # re-inserted last: the dict's order is least recently heard first
        if known is None:
            known = {}
            if len(self._delay) >= self._max_jobs:
                del self._delay[next(iter(self._delay))]
        for rank, d in delays:
            known.pop(rank, None)
            known[rank] = int(d)
        while len(known) > self._PEERS:
            del known[next(iter(known))]
        self._delay[job] = known

    def _reference_delay(self, job: str) -> int | None:
        """How late the job's input arrives now: the median delay of its plausible ranks, else of the input's
        latest plausible heartbeat; None while no plausible heartbeat was seen at all."""
        peers = self._delay.get(job)
        if peers:
            return int(np.median(list(peers.values())))
        if self._input_delay is None:
            return 0 if self._blind > self._BLIND_ROWS else None
        return self._input_delay

    def _forget(self, k: tuple[str, int, int]) -> None:
        del self.skew[k]
        self._jobs[k[0]] -= 1
        if not self._jobs[k[0]]:
            del self._jobs[k[0]]

    def correct_ccl(self, table: pa.Table) -> pa.Table:
        return self._shift_known(table, self._CCL_TIMES)

    def correct_checkpoints(self, table: pa.Table) -> pa.Table:
        """Checkpoint times of a rank whose heartbeats showed a wrong clock: a save stamped 1970 would otherwise
        last 55 years in the downtime accountant (which takes a save's start as its earliest rank's)."""
        return self._shift_known(table, self._CKPT_TIMES)

    def _shift_known(self, table: pa.Table, fields: tuple[str, ...]) -> pa.Table:
        if table.num_rows == 0 or not self.skew:
            return table
        delta = np.array([self.skew.get(k, 0) for k in _rank_keys(table)], dtype=np.int64)
        return self._shift(table, delta, fields)

    def _shift(self, table: pa.Table, delta: np.ndarray, fields: tuple[str, ...]) -> pa.Table:
        if not delta.any():
            return table
        self.corrected_rows += int((delta != 0).sum())
        for name in fields:
            v = _col(table, name)
            fixed = np.where(v <= 0, v, v - delta)  # -1 (and 0) mean "none" and stay so
            i = table.column_names.index(name)
            table = table.set_column(i, table.field(i), pa.array(fixed, type=pa.int64()))
        return table


def _rank_keys(table: pa.Table) -> list[tuple[str, int, int]]:
    return list(zip(table["job_id"].to_pylist(), _col(table, "attempt").tolist(), _col(table, "rank").tolist()))
