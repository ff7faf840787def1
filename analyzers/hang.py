"""Hang detection from heartbeats and CCL records: a reducer with explicit state, per job.

``HangTracker`` keeps, per rank, its latest heartbeat (progress, the op in
flight and since when, host, dumped stacks) and, per (group, rank), the last
collective sequence number it entered and the last it completed (Flight
Recorder's view). ``evaluate(now_ns)`` decides:

- **node_loss**: some ranks' heartbeats stopped (``heartbeat_timeout_s``
  older than the job's newest heartbeat) while others still report: those
  ranks are missing, their hosts the suspects. Every rank silent for the
  timeout at ``now`` is node loss too, while the caller's input lives.
- otherwise, when no rank has made progress for the hang threshold
  ``max(floor_s, k x median step time)`` (``max(floor_s, startup_s)`` while
  no rank has begun its first step, at least ``checkpoint_s`` while a rank
  is inside a checkpoint save or load):
  - **comm_hang**: some ranks are inside collective n of a group and others
    never entered it: the latter are missing (the suspects), the former stuck;
    if every member entered, the collective itself is stuck (a link or NIC):
    no rank is missing and the group is the suspect.
  - **noncomm_hang**: no rank is inside a collective: the ranks with the
    oldest op in flight (compute, data loading) are the suspects; with none in
    flight, the whole job is.

Defaults and why: ``floor_s = 45`` so that a job whose steps take under 5 s
is named hung within a minute of its onset (PyTorch's NCCL watchdog waits
10 minutes): any op that ends is progress, so an evaluation loop is not a
stall, and a rank inside a checkpoint save or load (its heartbeats say
``checkpoint-save``/``-load`` is in flight: the exporter's ``checkpointing``,
the tracer's ``torch.distributed.checkpoint``) gets ``checkpoint_s = 900``,
as a save of a large model legitimately takes minutes; ``k = 10`` so a job
whose steps take 30 s is not called hung before 5 minutes; ``heartbeat_timeout_s = 30``,
six missed 5 s heartbeats, well beyond GC or scheduling jitter;
``startup_s = 600`` because before the first step there is no step time to
scale by, and start-up (imports, rendezvous, communicator set-up, checkpoint
load) legitimately stalls for minutes while some ranks already report. All
four are parameters (``HangParams``) set from the pipeline configuration.

``evaluate`` also builds the evidence: the wait chain (for each rank, what it
waits on and for whom, and the root of the chain) and the merged stacks of
every rank that dumped them (``analyzers.stacks``). ``to_tables(hangs, now_ns)``
converts hangs to HANG rows, as every analyzer's ``to_tables`` does.
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
from core.layout import fold_ranks

_NS = 1_000_000_000
MAX_RECORDERS = 64
"""Ranks whose Flight Recorder summary a hang's evidence keeps (a few hundred bytes each)."""


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
class HangParams:
    floor_s: float = 45.0
    k_steps: float = 10.0
    heartbeat_timeout_s: float = 30.0
    startup_s: float = 600.0
    checkpoint_s: float = 900.0


@dataclasses.dataclass(frozen=True)
class Hang:
    job_id: str
    attempt: int
    kind: str  # comm_hang | noncomm_hang | node_loss
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


def hang_summary(row: dict) -> str:
    """One line for an on-call engineer, from a HANG row (what the alert says)."""
    what = {"comm_hang": "communication hang", "noncomm_hang": "non-communication hang",
            "node_loss": "node loss"}.get(row["kind"], row["kind"])
    where = f" in {row['op']} #{row['seq']} of group {row['group']}" if row["group"] else ""
    missing = f"; missing ranks {row['missing_ranks']}" if row["missing_ranks"] else ""
    hosts = [h for h in row["suspect_hosts"].split(",") if h]
    on = f" on {', '.join(hosts[:4])}" if hosts else ""
    return f"{row['job_id']}: {what}{where} for {row['duration_s']:.0f} s{missing}{on}"


@dataclasses.dataclass
class _Rank:
    ts: int = -1
    host: str = ""
    step: int = -1
    step_changed_ns: int = -1
    last_progress_ns: int = -1
    inflight_op: str = ""
    inflight_group: str = ""
    inflight_seq: int = -1
    inflight_since_ns: int = -1
    stack: str = ""
    last_op: str = ""
    flight_recorder: str = ""


class HangTracker:
    """Hang state of one job attempt. Feed it tables; ask ``evaluate(now)``."""

    def __init__(self, job_id: str, attempt: int = 0, params: HangParams = HangParams(), world_size: int = 0):
        self.job_id, self.attempt, self.params = job_id, attempt, params
        self.world_size = world_size
        self.ranks: dict[int, _Rank] = {}
        self.entered: dict[str, dict[int, int]] = {}
        self.completed: dict[str, dict[int, int]] = {}
        self.group_ranks: dict[str, set[int]] = {}
        self.step_times: list[float] = []
        self.reported: tuple | None = None
        self._started = False  # some rank has begun a step (see threshold_s)

    # -- input --------------------------------------------------------------
    def add_heartbeats(self, hb: pa.Table) -> None:
        for row in hb.to_pylist():
            r = self.ranks.setdefault(row["rank"], _Rank())
            if row["ts_ns"] < r.ts:
                continue  # out of order: an older heartbeat says nothing new
            if row["step"] != r.step:
                # Heartbeats are sparser than steps: a step time is the time between two
                # heartbeats over the steps made in between.
                if r.step >= 0 and row["step"] > r.step and r.step_changed_ns > 0:
                    self.step_times.append((row["ts_ns"] - r.step_changed_ns) / _NS / (row["step"] - r.step))
                    del self.step_times[:-64]
                r.step, r.step_changed_ns = row["step"], row["ts_ns"]
            r.ts, r.host = row["ts_ns"], row["host"]
            r.last_progress_ns = max(r.last_progress_ns, row["last_op_end_ns"])
            r.inflight_op, r.inflight_group = row["inflight_op"], row["inflight_group"]
            r.inflight_seq, r.inflight_since_ns = row["inflight_seq"], row["inflight_since_ns"]
            r.last_op = row.get("last_op") or r.last_op
            if row["stack"]:
                r.stack = row["stack"]
            if row.get("flight_recorder"):
                r.flight_recorder = row["flight_recorder"]
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

    # -- output -------------------------------------------------------------
    def threshold_s(self) -> float:
        if not self._started:
            # Still starting: heartbeats report step -1 until the first step begins. Once a rank
            # has stepped the job has started for good, so the scan over ranks stops then.
            self._started = any(st.step >= 0 for st in self.ranks.values())
            if not self._started:
                return max(self.params.floor_s, self.params.startup_s)
        med = float(np.median(self.step_times)) if self.step_times else 0.0
        threshold = max(self.params.floor_s, self.params.k_steps * med)
        if any(st.inflight_op.startswith("checkpoint-") for st in self.ranks.values()):
            threshold = max(threshold, self.params.checkpoint_s)
        return threshold

    def evaluate(self, now_ns: int, input_alive: bool = False) -> Hang | None:
        """A hang if there is one now; the same hang is reported once (``None`` after).

        ``input_alive``: the caller still receives heartbeats of other jobs, so a
        job whose every rank fell silent lost its nodes (else our input may have
        stopped, and silence proves nothing).
        """
        if not self.ranks:
            return None
        hang = self._node_loss(now_ns, input_alive) or self._stall(now_ns)
        if hang is None:
            self.reported = None
            return None
        key = (hang.kind, hang.group, hang.seq, tuple(hang.missing_ranks))
        if key == self.reported:
            return None
        self.reported = key
        return hang

    def _node_loss(self, now_ns: int, input_alive: bool) -> Hang | None:
        timeout = self.params.heartbeat_timeout_s * _NS
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
        lost = sorted(r for r, st in self.ranks.items() if st.ts >= 0 and newest - st.ts > timeout)
        alive = [r for r in self.ranks if r not in lost]
        if not lost or (not alive and not input_alive):
            return None
        # A silent process on a host whose other ranks still report is a hung (or stopped)
        # process, not a lost node: the stall analysis names it as missing.
        alive_hosts = {self.ranks[r].host for r in alive}
        lost = [r for r in lost if self.ranks[r].host not in alive_hosts]
        if not lost:
            return None
        since = min(self.ranks[r].ts for r in lost)
        hosts = sorted({self.ranks[r].host for r in lost})
        evidence = self._evidence(now_ns, missing=lost)
        return Hang(self.job_id, self.attempt, "node_loss", "", -1, "", sorted(alive), lost, hosts, since,
                    (now_ns - since) / _NS, evidence)

    def _stall(self, now_ns: int) -> Hang | None:
        last = max(st.last_progress_ns for st in self.ranks.values())
        stalled_s = (now_ns - last) / _NS
        if last < 0 or stalled_s < self.threshold_s():
            return None
        # A silent rank's last heartbeat is stale: where it says it is proves nothing now.
        timeout = self.params.heartbeat_timeout_s * _NS
        live = {r: st for r, st in self.ranks.items() if st.ts >= 0 and now_ns - st.ts <= timeout}
        inside = {r: st for r, st in live.items() if st.inflight_group and st.inflight_seq >= 0
                  and self.completed.get(st.inflight_group, {}).get(r, -1) < st.inflight_seq}
        if inside:
            # The collective the longest-waiting rank sits in is where the chain starts.
            first = min(inside.values(), key=lambda st: st.inflight_since_ns)
            grp, seq, missing = self._follow_chain(first.inflight_group, first.inflight_seq, inside)
            stuck = sorted(inside)
            op = next(st.inflight_op for st in inside.values() if st.inflight_group == grp)
            hosts = sorted({self.ranks[r].host for r in missing if r in self.ranks})
            return Hang(self.job_id, self.attempt, "comm_hang", grp, int(seq), op, stuck, missing, hosts, last,
                        stalled_s, self._evidence(now_ns, missing=missing, group=grp, seq=seq))
        busy = {r: st for r, st in live.items() if st.inflight_op and st.inflight_since_ns >= 0}
        if busy:
            oldest = min(st.inflight_since_ns for st in busy.values())
            suspects = sorted(r for r, st in busy.items() if st.inflight_since_ns - oldest < 1 * _NS)
            op = busy[suspects[0]].inflight_op
        else:
            suspects, op = sorted(self.ranks), ""
        hosts = sorted({self.ranks[r].host for r in suspects})
        return Hang(self.job_id, self.attempt, "noncomm_hang", "", -1, op, suspects, [], hosts, last, stalled_s,
                    self._evidence(now_ns, missing=[]))

    def _missing(self, grp: str, seq: int) -> list[int]:
        members = self.group_ranks.get(grp) or group_members(grp, self.ranks)
        ent = self.entered.get(grp, {})
        return sorted(r for r in members if ent.get(r, -1) < seq)

    def _follow_chain(self, grp: str, seq: int, inside: dict) -> tuple[str, int, list[int]]:
        """From a collective someone waits in to the one whose absent ranks wait for nobody.

        The ranks absent from collective n are the culprits only if they are not
        themselves waiting inside another collective (then they are victims too,
        and the chain goes on through theirs).
        """
        seen = {(grp, seq)}
        missing = self._missing(grp, seq)
        while missing and all(m in inside for m in missing):
            st = inside[missing[0]]
            nxt = (st.inflight_group, st.inflight_seq)
            if nxt in seen:
                break  # a cycle of waits: report where it was entered
            seen.add(nxt)
            grp, seq = nxt
            missing = self._missing(grp, seq)
        return grp, seq, missing

    def _evidence(self, now_ns: int, missing: list[int], group: str = "", seq: int = -1) -> dict[str, Any]:
        chain = self.wait_chain(missing, group, seq, now_ns)
        stacks = {r: st.stack for r, st in self.ranks.items() if st.stack}
        merged = merge_stacks(stacks, all_ranks=sorted(self.ranks)) if stacks else None
        return {"threshold_s": self.threshold_s(), "wait_chain": chain,
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

    def wait_chain(self, missing: list[int], group: str, seq: int, now_ns: int | None = None) -> dict[str, Any]:
        """For each rank: the op it waits on and the ranks it waits for; the root of the chain. With
        ``now_ns``, each row also says its ranks' last finished op, how long the oldest of them has been in
        its op (``age_s``) and since its last heartbeat (``silent_s``): the console's picture of the hang."""
        waits: dict[int, dict] = {}
        ent = self.entered.get(group, {})
        members = self.group_ranks.get(group, set())
        absent: dict[tuple[str, int], str] = {}  # (group, seq) -> members that never entered it
        for r, st in sorted(self.ranks.items()):
            if st.inflight_group and st.inflight_seq >= 0:
                gs = (st.inflight_group, st.inflight_seq)
                if gs not in absent:
                    g_ent = self.entered.get(gs[0], {})
                    g_mem = self.group_ranks.get(gs[0]) or group_members(gs[0], self.ranks)
                    absent[gs] = fold_ranks(m for m in g_mem if g_ent.get(m, -1) < gs[1])
                waits[r] = {"op": st.inflight_op, "group": gs[0], "seq": gs[1], "waits_for": absent[gs]}
            else:
                waits[r] = {"op": st.inflight_op or "(none)", "group": "", "seq": -1, "waits_for": ""}
        members = members or group_members(group, self.ranks)
        root = missing or sorted(m for m in members if ent.get(m, -1) < seq)
        # Collapse identical rows so an 8,192-rank chain stays readable: ranks -> what they wait on.
        groups: dict[tuple, list[int]] = {}
        for r, w in waits.items():
            groups.setdefault((w["op"], w["group"], w["seq"], w["waits_for"]), []).append(r)
        rows = []
        for k, rs in sorted(groups.items(), key=lambda kv: kv[1][0]):
            row = {"ranks": fold_ranks(rs), "op": k[0], "group": k[1], "seq": k[2], "waits_for": k[3]}
            if now_ns is not None:
                sts = [self.ranks[r] for r in rs]
                since = [st.inflight_since_ns for st in sts if st.inflight_since_ns >= 0]
                seen = [st.ts for st in sts if st.ts >= 0]
                row.update(last_op=next((st.last_op for st in sts if st.last_op), ""),
                           age_s=round((now_ns - min(since)) / _NS, 3) if since else -1.0,
                           silent_s=round((now_ns - min(seen)) / _NS, 3) if seen else -1.0)
            rows.append(row)
        return {"root": fold_ranks(root), "rows": rows}
