"""Hang detection from heartbeats and CCL records: a reducer with explicit state, per job.

``HangTracker`` keeps, per rank, its latest heartbeat (progress, the op in
flight and since when, host, dumped stacks, and what its watch process says of
it: stopped, exited, unresponsive) and, per (group, rank), the last collective
sequence number it entered and the last it completed (Flight Recorder's view).
``evaluate(now_ns)`` decides:

- **node_loss**: ranks that are gone while others still report: silent for
  ``heartbeat_timeout_s`` (no heartbeat of their own nor of their watch),
  stopped (SIGSTOP) that long, or exited without a goodbye while their peers
  still report ``exit_grace_s`` later. Their host is lost when none of its
  ranks reports (the row's ``op`` says ``host silent``), else the process is
  (``process stopped``, ``process exited``, ``process silent``). Every rank
  silent at ``now`` is node loss too, while the caller's input lives.
- otherwise, when no rank has made progress (no op ended on any rank) for the
  hang threshold:
  - **comm_hang**: some ranks are inside collective n of a group and others
    never entered it: the latter are missing (the suspects), the former stuck;
    a rank that waits in a collective whose sequence number it cannot know
    (DDP's gradient all-reduce, run by its C++ reducer) waits for the members
    that are not waiting in it. If every member entered, the collective
    itself is stuck (a link or NIC): no rank is missing, the group is the
    suspect.
  - **noncomm_hang**: no rank is inside a collective: the ranks with the
    oldest op in flight (compute, data loading) are the suspects; with none
    in flight, the whole job is.
  In both, a rank that is stopped, exited, finished or silent (for
  ``silent_s``, or three of its heartbeat periods) is missing, whatever its
  last heartbeat said: it is the one the others wait for.
- **hang_ended**: a stall that was reported is over (some rank made progress,
  or the lost ranks report again): its duration and what it was.

The threshold adapts to the job. Before any rank begins its first step it is
``max(floor_s, startup_s)`` (imports, rendezvous, checkpoint load take
minutes). Until the ranks know their own pace (each rank reports, from its
third step on, the longest time between two of its ops ending over its recent
steps: ``quiet_ns``) it is ``max(floor_s, k_steps x median step time)``.
Then it is ``max(min_s, quiet_factor x the median rank's quiet_ns)``: a job
whose steps take 0.5-5 s is named within about 15 s, while its own longest
ops (a backward waiting for the gradient reduction, the data loader between
steps) are never mistaken for a stall. Pauses the job makes on purpose get
longer: a rank inside a checkpoint save or load (its heartbeats say so: the
exporter's ``checkpointing``, ``torch.save`` and ``torch.distributed.checkpoint``
under ``trace``) gets ``checkpoint_s``; and a pause the job made before, at a
regular interval of steps (its own checkpoint written some other way, an
evaluation loop), is expected at its next turn and gets 1.5 times its length
plus ``min_s``.

``evaluate`` also builds the evidence: the wait chain (for each rank, what it
waits on and for whom, its state, and the root of the chain), the merged
stacks of every rank that dumped them (``analyzers.stacks``) and PyTorch's
Flight Recorder summaries. ``to_tables(hangs, now_ns)`` converts hangs to
HANG rows, as every analyzer's ``to_tables`` does.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from analyzers.stacks import merge_stacks
from core import codec, jsonutil
from core import schema as S
from core.config import HangConfig
from core.layout import fold_ranks

_NS = 1_000_000_000
MAX_RECORDERS = 64
"""Ranks whose Flight Recorder summary a hang's evidence keeps (a few hundred bytes each)."""
MAX_PAUSES = 16
"""Ended pauses a job remembers (the learned checkpoint interval needs the last few)."""
DEFAULT_PERIOD_S = 5.0
"""The heartbeat period of ranks that do not say theirs (exporters before schema 8)."""

HangParams = HangConfig
"""The detector's parameters are the pipeline's ``[hang]`` configuration (``core.config.HangConfig``)."""

GONE_STATES = ("stopped", "exited", "finished")
"""Watch and exporter states of a rank that will not take part until something outside the job acts."""


def group_members(name: str, job_ranks) -> set[int]:
    """Members of a group from its exporter name: 'world', 'ranks:0-3,8', 'p2p:3>5'."""
    if name.startswith("p2p:"):
        a, _, b = name[4:].partition(">")
        return {int(a), int(b)} if a.isdigit() and b.isdigit() else set()
    if name.startswith("ranks:"):
        out: set[int] = set()
        for part in name[6:].split(","):
            lo, _, hi = part.partition("-")
            if lo.isdigit():
                out.update(range(int(lo), int(hi or lo) + 1))
        return out
    return set(job_ranks)


@dataclasses.dataclass(frozen=True)
class Hang:
    job_id: str
    attempt: int
    kind: str  # comm_hang | noncomm_hang | node_loss | hang_ended
    group: str
    seq: int
    op: str
    stuck_ranks: list[int]
    missing_ranks: list[int]
    suspect_hosts: list[str]
    since_ns: int
    duration_s: float
    evidence: dict

    def summary(self) -> str:
        return hang_summary(_row(self, self.since_ns))


def _row(hang: Hang, now_ns: int) -> dict:
    """A row of ``core.schema.HANG``; ``now_ns`` (the detection time) is its ``hang_id``."""
    return dict(job_id=hang.job_id, attempt=hang.attempt, hang_id=now_ns, kind=hang.kind, group=hang.group,
                seq=hang.seq, op=hang.op, stuck_ranks=fold_ranks(hang.stuck_ranks),
                missing_ranks=fold_ranks(hang.missing_ranks), suspect_hosts=",".join(hang.suspect_hosts),
                since_ns=hang.since_ns, duration_s=hang.duration_s, evidence_json=jsonutil.dumps(hang.evidence))


def to_tables(hangs: Iterable[Hang], now_ns: int) -> dict[str, pa.Table]:
    """{"hang": HANG rows} of the hangs detected at ``now_ns`` (each row's ``hang_id``)."""
    return {"hang": codec.from_rows(S.HANG, [_row(h, now_ns) for h in hangs])}


def _evidence_of(row: dict) -> dict:
    """A HANG row's evidence, decoded; {} where it is missing or not a JSON object."""
    try:
        ev = json.loads(row.get("evidence_json") or "{}")
    except ValueError:
        return {}
    return ev if isinstance(ev, dict) else {}


def _states_of(row: dict) -> dict[str, str]:
    states = _evidence_of(row).get("states")
    return states if isinstance(states, dict) else {}


def recovery_plan_of(row: dict) -> dict | None:
    """The restart plan a node loss's HANG row carries (``ray_jobs.hang_monitor``), or None."""
    plan = _evidence_of(row).get("recovery_plan")
    return plan if isinstance(plan, dict) and plan.get("action") else None


def recovery_plan_missing(row: dict) -> str:
    """Why a loss's HANG row carries no restart plan ('' where it carries one, or says nothing)."""
    why = _evidence_of(row).get("recovery_plan_missing")
    return why if isinstance(why, str) else ""


def recovery_sentence(plan: dict) -> str:
    """'restart on the 3 surviving nodes as ...; predicted 1.92 s per step, 0.74 of the throughput before' ; a
    process loss's: 'restart in place ...; predicted ... as before; if h7 must be drained: restart ...'."""
    after = plan.get("step_time_after_s")
    if after is None:
        text = plan["action"]
    elif plan.get("in_place"):
        text = f"{plan['action']}; predicted {after:.3g} s per step, as before"
    else:
        text = (f"{plan['action']}; predicted {after:.3g} s per step, {plan.get('throughput_vs_before', 0):.2f} of "
                f"the throughput before the loss")
    if plan.get("in_place"):
        hosts = ", ".join(plan.get("drain_hosts") or []) or "its host"
        drained = plan.get("if_drained")
        if isinstance(drained, dict) and drained.get("action"):
            text += f"; if {hosts} must be drained: {recovery_sentence(drained)}"
        elif plan.get("if_drained_missing"):
            text += f"; no plan without {hosts}: {plan['if_drained_missing']}"
    return text


def hang_summary(row: dict) -> str:
    """One line for an on-call engineer, from a HANG row (what the alert says)."""
    kind = row["kind"]
    if kind == "hang_ended":
        return f"{row['job_id']}: {ended_sentence(row)}"
    if kind == "node_loss":
        what = "node loss" if row.get("op") in ("", "host silent") else "process loss"
    else:
        what = {"comm_hang": "communication hang", "noncomm_hang": "non-communication hang"}.get(kind, kind)
    seq = f" #{row['seq']}" if int(row.get("seq", -1)) >= 0 else ""
    where = f" in {row['op']}{seq} of group {row['group']}" if row["group"] else ""
    states = _states_of(row)
    missing = ""
    if row["missing_ranks"]:
        named = sorted({states[r] for r in states if states[r]})
        missing = f"; missing ranks {row['missing_ranks']}" + (f" ({', '.join(named)})" if named else "")
        if kind == "node_loss" and row.get("op") and row["op"] != "host silent":
            missing = f"; ranks {row['missing_ranks']}: {row['op']}"
    hosts = [h for h in row["suspect_hosts"].split(",") if h]
    on = f" on {', '.join(hosts[:4])}" if hosts else ""
    plan = recovery_plan_of(row) if kind == "node_loss" else None
    recovery = f"; recovery: {recovery_sentence(plan)}" if plan else ""
    if kind == "node_loss" and not plan and recovery_plan_missing(row):
        recovery = f"; no recovery plan: {recovery_plan_missing(row)}"
    return f"{row['job_id']}: {what}{where} for {row['duration_s']:.0f} s{missing}{on}{recovery}"


def ended_sentence(row: dict) -> str:
    """'the communication hang in barrier of group world ended after 70 s: ...' from a hang_ended row."""
    ev = _evidence_of(row)
    was = {"comm_hang": "communication hang", "noncomm_hang": "non-communication hang", "node_loss": "loss"}.get(
        ev.get("was", ""), "hang")
    where = f" in {row['op']} of group {row['group']}" if row.get("group") else ""
    what = f": {ev['what']}" if ev.get("what") else ""
    return f"the {was}{where} ended after {row['duration_s']:.0f} s{what}"


@dataclasses.dataclass
class _Rank:
    ts: int = -1
    host: str = ""
    step: int = -1
    step_done: int = -1
    step_changed_ns: int = -1
    last_progress_ns: int = -1
    inflight_op: str = ""
    inflight_group: str = ""
    inflight_seq: int = -1
    inflight_since_ns: int = -1
    stack: str = ""            # its Python stacks, dumped in the stall it is in now ('' when none, or stale)
    stack_ts: int = -1         # when it dumped them
    last_op: str = ""
    flight_recorder: str = ""
    proc_state: str = ""       # what its watch says (stopped, exited, unresponsive) or 'finished'; '' reporting
    state_since_ns: int = -1   # since when proc_state holds
    own_ts: int = -1           # its own newest heartbeat (not its watch's)
    period_s: float = 0.0      # its heartbeat period; 0: not said
    quiet_ns: int = -1         # its longest wait between two ops of its recent steps; -1: not known yet


class HangTracker:
    """Hang state of one job attempt. Feed it tables; ask ``evaluate(now)``."""

    def __init__(self, job_id: str, attempt: int = 0, params: HangConfig = HangConfig(), world_size: int = 0):
        self.job_id, self.attempt, self.params = job_id, attempt, params
        self.world_size = world_size
        self.ranks: dict[int, _Rank] = {}
        self.entered: dict[str, dict[int, int]] = {}
        self.completed: dict[str, dict[int, int]] = {}
        self.group_ranks: dict[str, set[int]] = {}
        self.step_times: list[float] = []
        self.reported: tuple | None = None
        self._started = False  # some rank has begun a step (see threshold_s)
        self._open: Hang | None = None   # the hang reported last, until it ends
        self._stall_from = -1            # the job's last progress when the current stall was first seen
        self._stall_seen_s = 0.0         # how long the current stall had lasted at the latest evaluation
        self._stall_what = ""            # what the ranks did in it (for a pause's description)
        self._step_done_at_stall = -1    # the job's last completed step when it began
        self.pauses: list[tuple[int, float, str]] = []  # ended pauses: (step done before it, seconds, what)

    # -- state for a shard to save -------------------------------------------------
    def state(self) -> dict:
        """Plain data (numbers, strings, lists, dicts) to resume from; the parameters are the restorer's."""
        return {"job_id": self.job_id, "attempt": self.attempt, "world_size": self.world_size,
                "ranks": [[r, dataclasses.asdict(st)] for r, st in self.ranks.items()],
                "entered": {g: list(m.items()) for g, m in self.entered.items()},
                "completed": {g: list(m.items()) for g, m in self.completed.items()},
                "group_ranks": {g: sorted(rs) for g, rs in self.group_ranks.items()},
                "step_times": list(self.step_times),
                "reported": None if self.reported is None else [*self.reported[:3], list(self.reported[3])],
                "started": self._started, "open": None if self._open is None else dataclasses.asdict(self._open),
                "stall_from": self._stall_from, "stall_seen_s": self._stall_seen_s, "stall_what": self._stall_what,
                "step_done_at_stall": self._step_done_at_stall, "pauses": [list(p) for p in self.pauses]}

    @classmethod
    def from_state(cls, st: dict, params: HangConfig) -> HangTracker:
        """A tracker as ``state`` left it, with this process's ``params``. A field a later version added
        takes its default."""
        t = cls(st["job_id"], st["attempt"], params, st.get("world_size", 0))
        known = {f.name for f in dataclasses.fields(_Rank)}
        t.ranks = {int(r): _Rank(**{k: v for k, v in d.items() if k in known}) for r, d in st["ranks"]}
        t.entered = {g: {int(r): int(n) for r, n in m} for g, m in st["entered"].items()}
        t.completed = {g: {int(r): int(n) for r, n in m} for g, m in st["completed"].items()}
        t.group_ranks = {g: set(rs) for g, rs in st["group_ranks"].items()}
        t.step_times = list(st["step_times"])
        rep = st.get("reported")
        t.reported = None if rep is None else (rep[0], rep[1], rep[2], tuple(rep[3]))
        t._started = bool(st.get("started", False))
        t._open = None if st.get("open") is None else Hang(**st["open"])
        t._stall_from, t._stall_seen_s = st.get("stall_from", -1), st.get("stall_seen_s", 0.0)
        t._stall_what, t._step_done_at_stall = st.get("stall_what", ""), st.get("step_done_at_stall", -1)
        t.pauses = [(int(a), float(b), str(c)) for a, b, c in st.get("pauses", [])]
        return t

    # -- input --------------------------------------------------------------
    def add_heartbeats(self, hb: pa.Table) -> None:
        cols = hb.column_names
        for row in hb.to_pylist():
            r = self.ranks.setdefault(row["rank"], _Rank())
            if row["ts_ns"] < r.ts:
                continue  # out of order: an older heartbeat says nothing new
            state = row.get("proc_state") or ""
            if state != r.proc_state:
                r.proc_state, r.state_since_ns = state, row["ts_ns"]
            if state in ("", "finished"):
                r.own_ts = row["ts_ns"]
            if row["step"] != r.step and state in ("", "finished"):
                # Heartbeats are sparser than steps: a step time is the time between two
                # heartbeats over the steps made in between.
                if r.step >= 0 and row["step"] > r.step and r.step_changed_ns > 0:
                    self.step_times.append((row["ts_ns"] - r.step_changed_ns) / _NS / (row["step"] - r.step))
                    del self.step_times[:-64]
                r.step, r.step_changed_ns = row["step"], row["ts_ns"]
            r.ts, r.host = row["ts_ns"], row["host"]
            r.step_done = max(r.step_done, row.get("step_done", -1) if "step_done" in cols else -1)
            r.last_progress_ns = max(r.last_progress_ns, row["last_op_end_ns"])
            r.inflight_op, r.inflight_group = row["inflight_op"], row["inflight_group"]
            r.inflight_seq, r.inflight_since_ns = row["inflight_seq"], row["inflight_since_ns"]
            r.last_op = row.get("last_op") or r.last_op
            if "heartbeat_s" in cols and row["heartbeat_s"] > 0:
                r.period_s = float(row["heartbeat_s"])
            if "quiet_ns" in cols and state == "":
                r.quiet_ns = int(row["quiet_ns"])
            if row["stack"]:
                r.stack, r.stack_ts = row["stack"], row["ts_ns"]
            if row.get("flight_recorder"):
                r.flight_recorder = row["flight_recorder"]
            if r.stack_ts >= 0 and r.last_progress_ns > r.stack_ts:
                # Dumped in an earlier pause it came out of (a slow first step, a rendezvous): not where it is
                # now. A stopped rank cannot dump; its stale stacks must not stand in for it.
                r.stack, r.flight_recorder, r.stack_ts = "", "", -1
            if r.inflight_group and r.inflight_seq >= 0:
                # Heartbeats are the live view: being inside collective n means having entered it.
                ent = self.entered.setdefault(r.inflight_group, {})
                ent[row["rank"]] = max(ent.get(row["rank"], -1), r.inflight_seq)

    def add_ccl(self, ccl: pa.Table) -> None:
        g = ccl["group"].to_pylist()
        rank = ccl["rank"].to_numpy()
        seq = ccl["seq"].to_numpy()
        exit_ns = ccl["exit_ns"].to_numpy()
        members = ccl["group_ranks"].to_pylist()
        for i in range(ccl.num_rows):
            grp, r, s = g[i], int(rank[i]), int(seq[i])
            ent = self.entered.setdefault(grp, {})
            ent[r] = max(ent.get(r, -1), s)
            if exit_ns[i] >= 0:
                done = self.completed.setdefault(grp, {})
                done[r] = max(done.get(r, -1), s)
                st = self.ranks.setdefault(r, _Rank())
                st.last_progress_ns = max(st.last_progress_ns, int(exit_ns[i]))
            gr = self.group_ranks.setdefault(grp, set())
            gr.add(r)
            if members[i]:
                gr.update(members[i])

    # -- the threshold --------------------------------------------------------
    def quiet_s(self) -> float | None:
        """The job's longest normal wait between two ops: the median over its ranks of what each reports;
        None until most ranks know theirs."""
        known = [st.quiet_ns for st in self.ranks.values() if st.quiet_ns >= 0]
        if not known or 2 * len(known) < len(self.ranks):
            return None
        return float(np.median(known)) / _NS

    def threshold_s(self) -> float:
        p = self.params
        if not self._started:
            # Still starting: heartbeats report step -1 until the first step begins. Once a rank
            # has stepped the job has started for good, so the scan over ranks stops then.
            self._started = any(st.step >= 0 for st in self.ranks.values())
            if not self._started:
                return max(p.floor_s, p.startup_s)
        quiet = self.quiet_s()
        if quiet is None:  # the first steps: the job's pace is not known yet
            med = float(np.median(self.step_times)) if self.step_times else 0.0
            threshold = max(p.floor_s, p.k_steps * med)
        else:
            threshold = max(p.min_s, p.quiet_factor * quiet)
        if any(st.inflight_op.startswith("checkpoint-") for st in self.ranks.values()):
            threshold = max(threshold, p.checkpoint_s)
        expected = self.expected_pause_s()
        if expected:
            threshold = max(threshold, 1.5 * expected + p.min_s)
        return threshold

    def _step_done(self) -> int:
        return max((st.step_done for st in self.ranks.values()), default=-1)

    def expected_pause_s(self) -> float:
        """The length of a pause the job has made before and is due to make now, else 0.

        A pause recurs at a regular interval of steps: after two, the interval between them; after one, at
        a multiple of its step count (a job that saves every N steps made its first at step N or N-1)."""
        if not self.pauses:
            return 0.0
        step = self._step_done()
        last_step, last_s, _ = self.pauses[-1]
        if step <= last_step:
            return 0.0
        if len(self.pauses) >= 2:
            every = last_step - self.pauses[-2][0]
            due = every > 0 and (step - last_step) % every == 0
            return max(last_s, self.pauses[-2][1]) if due else 0.0
        due = any(n >= 10 and (step + k) % n == 0 for n, k in ((last_step, 0), (last_step + 1, 1)))
        return last_s if due else 0.0

    def rank_hosts(self) -> dict[int, str]:
        """Where each rank of the job ran, as its heartbeats said."""
        return {r: st.host for r, st in self.ranks.items() if st.ts >= 0}

    # -- evaluation -----------------------------------------------------------
    def evaluate(self, now_ns: int, input_alive: bool = False) -> Hang | None:
        """A hang if there is one now (the same one is reported once: ``None`` after), or the end of the
        one reported last.

        ``input_alive``: the caller still receives heartbeats of other jobs, so a
        job whose every rank fell silent lost its nodes (else our input may have
        stopped, and silence proves nothing).
        """
        if not self.ranks:
            return None
        self._learn_pauses(now_ns)
        hang = self._node_loss(now_ns, input_alive) or self._stall(now_ns)
        if hang is None:
            self.reported = None
            return self._ended(now_ns)
        key = (hang.kind, hang.group, hang.seq, tuple(hang.missing_ranks))
        if key == self.reported:
            return None
        self.reported = key
        if self._open is None:
            self._open = hang
        return hang

    def _last_progress(self) -> int:
        return max(st.last_progress_ns for st in self.ranks.values())

    def _learn_pauses(self, now_ns: int) -> None:
        """Remember each long quiet the job came out of: the step before it, its length, what it was."""
        last = self._last_progress()
        if last < 0:
            return
        if self._stall_from >= 0 and last > self._stall_from:
            seen = self._stall_seen_s
            if seen >= max(self.params.min_s / 2, 1.0) and self._started:
                self.pauses.append((self._step_done_at_stall, (last - self._stall_from) / _NS, self._stall_what))
                del self.pauses[:-MAX_PAUSES]
            self._stall_from, self._stall_seen_s = -1, 0.0
        stalled = (now_ns - last) / _NS
        if stalled >= max(self.params.min_s / 2, 1.0):
            if self._stall_from < 0:
                self._stall_from, self._step_done_at_stall = last, self._step_done()
            self._stall_seen_s = max(self._stall_seen_s, stalled)
            self._stall_what = self._doing() or self._stall_what

    def _doing(self) -> str:
        """What the job's ranks are doing, briefly: 'checkpoint-save on rank 0; barrier (ranks 1-3)'."""
        by: dict[str, list[int]] = {}
        for r, st in sorted(self.ranks.items()):
            what = st.proc_state if st.proc_state in GONE_STATES else st.inflight_op
            if what:
                by.setdefault(what, []).append(r)
        return "; ".join(f"{op} (rank{'s' if len(rs) > 1 else ''} {fold_ranks(rs)})" for op, rs in by.items())

    def _ended(self, now_ns: int) -> Hang | None:
        """The end of the hang reported last: some rank progressed since it began, or the lost came back."""
        h = self._open
        if h is None:
            return None
        last = self._last_progress()
        if h.kind == "node_loss":
            back = all(self.ranks[r].proc_state == "" and self.ranks[r].own_ts > h.since_ns
                       for r in h.missing_ranks if r in self.ranks)
            if not back:
                return None
            end = max(self.ranks[r].own_ts for r in h.missing_ranks if r in self.ranks) \
                if h.missing_ranks else now_ns
        elif last > h.since_ns:
            end = last
        else:
            return None
        self._open = None
        what = h.evidence.get("doing") or ""
        evidence = {"was": h.kind, "hang_since_ns": h.since_ns, "ended_ns": end, "what": what,
                    "states": h.evidence.get("states", {})}
        return Hang(self.job_id, self.attempt, "hang_ended", h.group, h.seq, h.op, h.stuck_ranks, h.missing_ranks,
                    h.suspect_hosts, h.since_ns, max(0.0, (end - h.since_ns) / _NS), evidence)

    # -- who is gone ------------------------------------------------------------
    def _period_s(self, st: _Rank) -> float:
        return st.period_s if st.period_s > 0 else DEFAULT_PERIOD_S

    def _gone(self, now_ns: int) -> dict[int, str]:
        """Ranks that will not take part now: stopped, exited, finished (by their watch or their last
        heartbeat) or silent (no heartbeat at all for ``silent_s`` or three of their periods)."""
        out: dict[int, str] = {}
        for r, st in self.ranks.items():
            if st.ts < 0:
                continue
            if st.proc_state in GONE_STATES:
                out[r] = st.proc_state
            elif now_ns - st.ts > max(self.params.silent_s, 3 * self._period_s(st)) * _NS:
                out[r] = "silent"
        return out

    def _node_loss(self, now_ns: int, input_alive: bool) -> Hang | None:
        p = self.params
        timeout = p.heartbeat_timeout_s * _NS
        heard = [st.ts for st in self.ranks.values() if st.ts >= 0]
        if not heard:
            return None
        # Some ranks are lost when the job's other ranks reported for longer than the timeout after them: judged
        # against the job's own newest heartbeat, not the evaluation clock, so that an input late by any delay
        # (the job's heartbeats share one partition, hence one lag) cannot make a rank that reports read as
        # silent. Only when every rank fell silent does the clock decide, and then only while our input lives.
        # A stamp ahead of the clock counts as the clock: a peer's clock minutes fast (inside the tolerance the
        # boundary leaves alone) must not make the others look minutes silent.
        newest = min(max(heard), now_ns)
        if now_ns - newest > timeout:
            newest = now_ns
        lost: dict[int, str] = {}
        for r, st in self.ranks.items():
            if st.ts < 0 or st.proc_state == "finished":
                continue
            if st.proc_state == "exited":
                lost[r] = "exited"
            elif newest - st.ts > timeout:
                lost[r] = "silent"
            elif st.proc_state == "stopped" and newest - st.state_since_ns > timeout:
                lost[r] = "stopped"
        # The ranks of a lost host fall silent together, but their last heartbeats are up to a period apart, so
        # one of them passes the timeout first. Paged then, it would be a process loss on a host that still
        # reports (so was a real one: tests/netfaults/test_host_loss.py, before this rule), and the alert's
        # cool-down then held back the host's page.
        # A silent rank waits while a rank of its host is silent too (past silent_s or three of its periods):
        # that one passes the timeout within seconds, and the host is named as a whole.
        for r in [r for r, why in lost.items() if why == "silent"]:
            host = self.ranks[r].host
            if any(q not in lost and st.host == host and st.ts >= 0 and st.proc_state != "finished"
                   and newest - st.ts > max(p.silent_s, 3 * self._period_s(st)) * _NS
                   for q, st in self.ranks.items()):
                del lost[r]
        alive = [r for r in self.ranks if r not in lost and self.ranks[r].proc_state != "finished"]
        if not lost or (not alive and not input_alive):
            return None
        exited = [r for r, why in lost.items() if why == "exited"]
        if exited and len(exited) == len(lost):
            # A launcher that stops the job stops every rank within moments: that is the job's end. A rank
            # that exited while its peers still report a while later is lost.
            first = min(self.ranks[r].state_since_ns for r in exited)
            if not alive or max(self.ranks[r].ts for r in alive) - first < p.exit_grace_s * _NS:
                return None
        alive_hosts = {self.ranks[r].host for r in alive}
        whys = sorted(set(lost.values()))
        ranks = sorted(lost)
        hosts = sorted({self.ranks[r].host for r in ranks})
        if all(why == "silent" for why in whys) and not any(self.ranks[r].host in alive_hosts for r in ranks):
            op = "host silent"
        else:
            op = "process " + " or ".join(whys)
        since = min(self.ranks[r].state_since_ns if lost[r] in ("stopped", "exited") else self.ranks[r].ts
                    for r in ranks)
        evidence = self._evidence(now_ns, missing=ranks, states={r: lost[r] for r in ranks})
        return Hang(self.job_id, self.attempt, "node_loss", "", -1, op, sorted(alive), ranks, hosts, since,
                    (now_ns - since) / _NS, evidence)

    # -- stalls -------------------------------------------------------------------
    def _stall(self, now_ns: int) -> Hang | None:
        last = self._last_progress()
        stalled_s = (now_ns - last) / _NS
        if last < 0 or stalled_s < self.threshold_s():
            return None
        gone = self._gone(now_ns)
        live = {r: st for r, st in self.ranks.items() if st.ts >= 0 and r not in gone}
        if not live:
            return None  # every rank finished, exited or fell silent: the job's end or a loss, not a stall
        # Inside a collective: one with a sequence number it has not completed, or one whose number it cannot
        # know (DDP's gradient all-reduce: -1), which it waits in until every member comes.
        inside = {r: st for r, st in live.items() if st.inflight_group and (
            st.inflight_seq < 0 or self.completed.get(st.inflight_group, {}).get(r, -1) < st.inflight_seq)}
        states = {r: why for r, why in gone.items()}
        states.update({r: "unresponsive" for r, st in live.items() if st.proc_state == "unresponsive"})
        if inside:
            # The collective the longest-waiting rank sits in is where the chain starts.
            first = min(inside.values(), key=lambda st: st.inflight_since_ns)
            grp, seq, missing = self._follow_chain(first.inflight_group, first.inflight_seq, inside)
            # Ranks that are gone (stopped, exited, silent: a lost host's every rank) are missing too, whether
            # or not the chain reaches them: in a pipeline the stage waits for its own peer only, while that
            # peer's node took others with it; and where every member entered, the one that stopped inside the
            # collective is the one to look at.
            missing = sorted(set(missing) | set(gone))
            stuck = sorted(r for r in inside if r not in missing)
            op = next(st.inflight_op for st in inside.values() if st.inflight_group == grp)
            hosts = sorted({self.ranks[r].host for r in missing if r in self.ranks})
            return Hang(self.job_id, self.attempt, "comm_hang", grp, int(seq), op, stuck, missing, hosts, last,
                        stalled_s, self._evidence(now_ns, missing=missing, group=grp, seq=seq,
                                                  states=self._named(states, missing)))
        if gone:
            missing = sorted(gone)
            op = ""
            stuck = sorted(r for r in live)
            hosts = sorted({self.ranks[r].host for r in missing})
            return Hang(self.job_id, self.attempt, "noncomm_hang", "", -1, op, stuck, missing, hosts, last,
                        stalled_s, self._evidence(now_ns, missing=missing, states=self._named(states, missing)))
        busy = {r: st for r, st in live.items() if st.inflight_op and st.inflight_since_ns >= 0}
        unresponsive = sorted(r for r, st in live.items() if st.proc_state == "unresponsive")
        if unresponsive:
            # Its own heartbeats stopped while its watch sees it run: its thread (or the GIL) is held.
            suspects = unresponsive
            op = self.ranks[suspects[0]].inflight_op
        elif busy:
            oldest = min(st.inflight_since_ns for st in busy.values())
            suspects = sorted(r for r, st in busy.items() if st.inflight_since_ns - oldest < 1 * _NS)
            op = busy[suspects[0]].inflight_op
        else:
            suspects, op = sorted(self.ranks), ""
        hosts = sorted({self.ranks[r].host for r in suspects})
        return Hang(self.job_id, self.attempt, "noncomm_hang", "", -1, op, suspects, [], hosts, last, stalled_s,
                    self._evidence(now_ns, missing=[], states=self._named(states, suspects)))

    @staticmethod
    def _named(states: dict[int, str], ranks: list[int]) -> dict[int, str]:
        return {r: states[r] for r in ranks if r in states}

    def _missing(self, grp: str, seq: int, inside: dict | None = None) -> list[int]:
        members = self.group_ranks.get(grp) or group_members(grp, self.ranks)
        if seq < 0:
            # A collective of unknown number: the members not waiting in the same group are the ones awaited.
            waiting = {r for r, st in (inside or {}).items() if st.inflight_group == grp and st.inflight_seq < 0}
            return sorted(r for r in members if r not in waiting and r in self.ranks)
        ent = self.entered.get(grp, {})
        return sorted(r for r in members if ent.get(r, -1) < seq)

    def _follow_chain(self, grp: str, seq: int, inside: dict) -> tuple[str, int, list[int]]:
        """From a collective someone waits in to the one whose absent ranks wait for nobody.

        The ranks absent from collective n are the culprits only if they are not
        themselves waiting inside another collective (then they are victims too,
        and the chain goes on through theirs).
        """
        seen = {(grp, seq)}
        missing = self._missing(grp, seq, inside)
        while missing and all(m in inside for m in missing):
            st = inside[missing[0]]
            nxt = (st.inflight_group, st.inflight_seq)
            if nxt in seen:
                break  # a cycle of waits: report where it was entered
            seen.add(nxt)
            grp, seq = nxt
            missing = self._missing(grp, seq, inside)
        return grp, seq, missing

    def _evidence(self, now_ns: int, missing: list[int], group: str = "", seq: int = -1,
                  states: dict[int, str] | None = None) -> dict[str, Any]:
        chain = self.wait_chain(missing, group, seq, now_ns)
        # A rank its watch sees stopped or exited, or silent (no heartbeat for silent_s: stopped with no watch
        # beside it), dumped what it kept before that, not where it is: under load a rank dumped in a quiet spell,
        # went on without an op ending, then stopped, and its old stacks stood in for it in the picture (the
        # console's real-hang test, twice in whole-suite runs).
        stacks = {r: st.stack for r, st in self.ranks.items()
                  if st.stack and self._state_word(r, st, now_ns) not in ("stopped", "exited", "silent")}
        merged = merge_stacks(stacks, all_ranks=sorted(self.ranks)) if stacks else None
        return {"threshold_s": self.threshold_s(), "wait_chain": chain, "doing": self._doing(),
                "states": {str(r): s for r, s in sorted((states or {}).items())},
                "stacks_folded": merged.folded() if merged else "", "stacks_svg": merged.svg() if merged else "",
                "ranks_with_stacks": fold_ranks(stacks), "flight_recorder": self._recorders(missing)}

    def _recorders(self, missing: list[int]) -> dict[str, Any]:
        """What PyTorch's Flight Recorder said on each rank that dumped it (the collective library's own
        account: per group the last collective enqueued, started, completed; what is not done): the missing
        ranks first, at most ``MAX_RECORDERS``."""
        have = [r for r, st in self.ranks.items() if st.flight_recorder]
        have.sort(key=lambda r: (r not in missing, r))
        out = {}
        for r in have[:MAX_RECORDERS]:
            try:
                out[str(r)] = json.loads(self.ranks[r].flight_recorder)
            except ValueError:
                continue  # a malformed dump is no evidence
        return out

    def _state_word(self, r: int, st: _Rank, now_ns: int | None) -> str:
        if st.proc_state:
            return st.proc_state
        if now_ns is not None and st.ts >= 0 and now_ns - st.ts > max(self.params.silent_s,
                                                                      3 * self._period_s(st)) * _NS:
            return "silent"
        return ""

    def wait_chain(self, missing: list[int], group: str, seq: int, now_ns: int | None = None) -> dict[str, Any]:
        """For each rank: the op it waits on and the ranks it waits for, its state (stopped, exited, silent,
        ...; empty while it reports); the root of the chain. With ``now_ns``, each row also says its ranks'
        last finished op, how long the oldest of them has been in its op (``age_s``) and since its last
        heartbeat (``silent_s``): the console's picture of the hang."""
        waits: dict[int, dict] = {}
        ent = self.entered.get(group, {})
        members = self.group_ranks.get(group, set())
        absent: dict[tuple[str, int], str] = {}  # (group, seq) -> members that never entered it
        for r, st in sorted(self.ranks.items()):
            state = self._state_word(r, st, now_ns)
            if st.inflight_group:
                gs = (st.inflight_group, st.inflight_seq)
                if gs not in absent:
                    if gs[1] < 0:
                        absent[gs] = ""  # filled below, once every rank's wait is known
                    else:
                        g_ent = self.entered.get(gs[0], {})
                        g_mem = self.group_ranks.get(gs[0]) or group_members(gs[0], self.ranks)
                        absent[gs] = fold_ranks(m for m in g_mem if g_ent.get(m, -1) < gs[1])
                waits[r] = {"op": st.inflight_op, "group": gs[0], "seq": gs[1], "state": state}
            else:
                waits[r] = {"op": st.inflight_op or "(none)", "group": "", "seq": -1, "state": state}
        for gs in [k for k in absent if k[1] < 0]:
            g_mem = self.group_ranks.get(gs[0]) or group_members(gs[0], self.ranks)
            absent[gs] = fold_ranks(m for m in g_mem if m in waits and (waits[m]["group"], waits[m]["seq"]) != gs)
        for r, w in waits.items():
            w["waits_for"] = absent.get((w["group"], w["seq"]), "") if w["group"] else ""
        members = members or group_members(group, self.ranks)
        root = missing or (sorted(m for m in members if ent.get(m, -1) < seq) if seq >= 0 else [])
        # Collapse identical rows so an 8,192-rank chain stays readable: ranks -> what they wait on.
        groups: dict[tuple, list[int]] = {}
        for r, w in waits.items():
            groups.setdefault((w["op"], w["group"], w["seq"], w["waits_for"], w["state"]), []).append(r)
        rows = []
        for k, rs in sorted(groups.items(), key=lambda kv: kv[1][0]):
            row = {"ranks": fold_ranks(rs), "op": k[0], "group": k[1], "seq": k[2], "waits_for": k[3],
                   "state": k[4]}
            if now_ns is not None:
                sts = [self.ranks[r] for r in rs]
                since = [st.inflight_since_ns for st in sts if st.inflight_since_ns >= 0]
                seen = [st.own_ts if st.own_ts >= 0 else st.ts for st in sts if st.ts >= 0]
                row.update(last_op=next((st.last_op for st in sts if st.last_op), ""),
                           age_s=round((now_ns - min(since)) / _NS, 3) if since else -1.0,
                           silent_s=round((now_ns - min(seen)) / _NS, 3) if seen else -1.0)
            rows.append(row)
        return {"root": fold_ranks(root), "rows": rows}
