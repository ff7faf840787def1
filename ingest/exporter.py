"""The per-rank exporter: op spans, collective records and heartbeats of one training process.

Contract with the training loop: nothing here blocks it or raises into it.

- ``exporter.step(n)`` marks a step (context manager). Only sampled steps are
  profiled (NDTimeline-style: ``profile_steps`` consecutive steps every
  ``every`` steps; a profiling session is one analysis window whose id is its
  first step). Outside sampled steps ``op()`` costs one branch.
- ``exporter.op(optype, mb_id=...)`` times one op (context manager). On a CUDA
  device it records a pair of CUDA events on the current stream and a resolver
  thread turns them into times later (no synchronisation on the training
  thread) and sends them at most ``send_every_s`` later, at no fixed point of
  the step; on CPU it reads ``time.perf_counter_ns``.
- ``instrument_distributed(exporter)`` wraps ``torch.distributed`` collectives
  and point-to-point calls into CCL records (group, per-group sequence
  number, bytes, peers, enter/exit) and tracks the op in flight.
- ``exporter.follow_control(bootstrap)`` follows the control topic on a daemon
  thread (``ingest.control``): a change of this job's sampling, a pause of
  profiling or a new heartbeat period made with `stragglerscope control`
  applies at the next step end, or, when the change names the step it starts
  from, at the end of the step before it on every rank; the training thread
  only reads one attribute.
- ``exporter.checkpoint(step, kind)`` (or ``with exporter.checkpointing(step):``)
  reports a finished checkpoint save or load (CHECKPOINT record): the
  downtime accounting needs where a restarted job resumes from.
- A heartbeat thread reports progress (the last completed step and when its
  ``step()`` block exited, host time; the last op) and the op in flight every
  ``heartbeat_s`` (2 s); ``close()`` sends a last one, marked ``finished``,
  so the final progress of a process that exits is exact and a rank that
  ended early is not taken for a lost one. Each heartbeat also carries the
  rank's pace: the longest time between two of its ops ending over its
  recent steps (``quiet_ns``), which the hang threshold adapts to. When no op
  has ended on this rank for 1.5 times that (at least ``dump_min_s``; before
  the pace is known, ``hang_dump_s``), or ``request_stacks()`` was called, it
  attaches the Python stacks of every thread, folded, so a hang can be
  localised even when the main thread sits inside a C call, and what
  PyTorch's Flight Recorder holds of the process groups' last collectives
  (``ingest.flight_recorder``): once per stall, before the hang is named. On a
  GPU the op in flight is also the collective the GPU reached and has not
  finished (NCCL's calls return at once, the host is elsewhere). A watch
  process (``ingest.rank_watch``), when one is attached, hears every
  heartbeat and speaks for the rank when it cannot: stopped, exited, its
  heartbeat thread held.

Times are int64 ns on the job clock: this process's wall clock plus
``clock_offset_ns``, which ``estimate_clock_offset`` measures against rank 0
at start and again every ``offset_every_s``.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

import pyarrow as pa

from core import codec
from core import schema as S
from core.layout import fold_ranks  # noqa: F401  (re-exported: exporters name groups with it)
from ingest import flight_recorder
from ingest.nvml import NO_SAMPLE

log = logging.getLogger(__name__)

_STEP_END = object()
"""Queued behind a sampled step's last CUDA event pair: the resolver then sends the step."""

QUIET_STEPS = 64
"""Steps over which a rank's pace (the longest wait between two of its ops) is taken."""
QUIET_SKIP_STEPS = 2
"""Its first steps are left out: compilation, DDP's bucket rebuild and first communicator set-up are not its
pace."""

_CHAIN_MAX_NS = 10 * 10**9
"""Anchors are carried from one step to the next by GPU time only across gaps shorter than this: the GPU's
and the host's clocks drift apart by some parts per million."""


class _GpuMark:
    """A collective on device tensors as the stream meets it: ``enter`` completes when the GPU reached the
    call, ``exit`` (once the host left it) when the collective was done."""

    __slots__ = ("op", "group", "seq", "enter", "exit", "timed", "seen_ns")

    def __init__(self, op: str, group: str, seq: int, enter, timed: bool):
        self.op, self.group, self.seq, self.enter, self.timed = op, group, seq, enter, timed
        self.exit = None
        self.seen_ns = -1


class _GpuCall:
    """A collective's record waiting for its mark's two events, placed by the step's anchor ``ref``."""

    __slots__ = ("mark", "ref", "row")

    def __init__(self, mark: _GpuMark, ref, row: dict):
        self.mark, self.ref, self.row = mark, ref, row


class _StepAnchor:
    """Where a sampled step's reference event sits on the host clock; the step's CUDA spans are placed by it.

    The training thread records the event when the step starts; the GPU reaches it only once the work
    queued before it is done, which is later by the queue's depth when the loop runs ahead of the GPU.
    The resolver thread fixes ``perf_ns`` (see ``_anchor``): until then it is the record time, a lower
    bound."""

    __slots__ = ("ev", "recorded_ns", "perf_ns")

    def __init__(self, ev, recorded_ns: int):
        self.ev, self.recorded_ns, self.perf_ns = ev, recorded_ns, recorded_ns


def place_anchor(recorded_ns: int, seen_done_ns: int, waited: bool, chained_ns: int | None) -> int:
    """Host time (perf_counter ns) at which a step's reference event completed, from what the resolver saw.

    - ``waited``: the resolver blocked on the event while it was pending and woke at ``seen_done_ns``: that
      is when it completed, to within the wake-up latency (tens of microseconds).
    - Otherwise it had completed some time between its record (``recorded_ns``: an event cannot complete
      before the host records it) and ``seen_done_ns``. ``chained_ns``, the previous step's anchor plus the
      GPU time between the two events, is a second lower bound; it is the exact one while the GPU keeps
      running ahead of the host, where the record time is early by the queue's depth.
    """
    if waited:
        return seen_done_ns
    low = recorded_ns if chained_ns is None else max(recorded_ns, chained_ns)
    return min(low, seen_done_ns)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Profile ``profile_steps`` consecutive steps out of every ``every`` (default 10%)."""

    profile_steps: int = 10
    every: int = 100

    def __post_init__(self) -> None:
        if not 1 <= self.profile_steps <= self.every:
            raise ValueError(f"need 1 <= profile_steps <= every, got {self.profile_steps}, {self.every}")

    def window_of(self, step: int) -> int | None:
        """The window (its first step) that ``step`` belongs to, or None when not profiled."""
        first = step - step % self.every
        return first if step - first < self.profile_steps else None


def _plan_at(plan: tuple, step: int):
    """The sampling a plan holds for ``step``: that of the last entry whose step is at most ``step``."""
    sampling = plan[0][1]
    for first, s in plan[1:]:
        if first > step:
            break
        sampling = s
    return sampling


def folded_stacks(skip_thread: int | None = None) -> str:
    """Python stacks of all threads, one line each: 'thread-name;outer;...;inner'."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        if ident == skip_thread:
            continue
        frames = [f"{os.path.basename(fs.filename)}:{fs.name}:{fs.lineno}" for fs in traceback.extract_stack(frame)]
        lines.append(";".join([names.get(ident, str(ident))] + frames))
    return "\n".join(sorted(lines))


@dataclasses.dataclass
class ExporterStats:
    ops: int = 0
    ccl: int = 0
    heartbeats: int = 0
    checkpoints: int = 0
    batches: int = 0
    errors: int = 0
    tcp_flows: int = 0
    port_counters: int = 0
    control_late: int = 0
    """Sampling changes heard of after the step they were to start from: taken at the next step end instead."""


class RankExporter:
    """Telemetry of one rank. ``sink(table)`` receives OP_SPAN, CCL_RECORD, HEARTBEAT and CHECKPOINT tables
    (a ``TelemetryProducer.send``); it must not block. Call ``close()`` at the end of training."""

    def __init__(self, job_id: str, rank: int, dp_rank: int, pp_rank: int, sink: Callable[[pa.Table], Any], *,
                 attempt: int = 0, sampling: Sampling = Sampling(), heartbeat_s: float = 2.0,
                 hang_dump_s: float = 30.0, dump_min_s: float = 4.0, use_cuda: bool | None = None, mc: int = 0, gmc: int | None = None,
                 host: str | None = None, send_every_s: float = 1.0, tcp_flows: bool = True, nvml=None,
                 peer_timings=None, port_counters=None):
        """``tcp_flows``: read this process's TCP connections at the start and end of every profiled step and send
        their counters (``ingest.tcp_flows``), on a thread of their own. ``nvml``: the NVML module the GPU is
        sampled through with every heartbeat (``ingest.nvml``; default pynvml, where a CUDA device is in use;
        False: none). ``peer_timings``: where NCCL's profiler plugin reports each peer's share of a collective
        (an ``ingest.nccl_peers.PeerTimingFeed``; default: the one ``STRAGGLERSCOPE_NCCL_PEERS_DIR`` names, if
        set). ``port_counters``: the sampler of this host's InfiniBand/RoCE ports, read with every heartbeat
        (``ingest.port_counters.PortCounterSampler``); default: one, in the process that is its host's local rank
        0 (``reports_ports``); False: none."""
        self.job_id, self.rank, self.dp_rank, self.pp_rank, self.attempt = job_id, rank, dp_rank, pp_rank, attempt
        self.sink = sink
        self.sampling = sampling
        # What the control topic asks for (``offer_plan``, from the follower's thread): ((from step, sampling),
        # ...), steps increasing, the first 0; taken at a step end, replaced whole, never changed in place.
        self._wanted_plan: tuple = ((0, sampling),)
        self._plan = self._wanted_plan
        self._first_step: int | None = None
        self._said_late = False
        self.control = None  # ingest.control.ControlFollower, once follow_control started one
        self.heartbeat_s = heartbeat_s
        self.hang_dump_s = hang_dump_s
        self.dump_min_s = dump_min_s
        self.send_every_s = send_every_s
        self.mc = mc
        self.gmc = pp_rank if gmc is None else gmc
        self.host = host or socket.gethostname()
        self.stats = ExporterStats()
        self.clock_offset_ns = 0
        # The what-if model folds TP and CP into the (dp, pp) worker: one rank of the worker sends its op
        # spans, the others only collectives and heartbeats (two ranks' spans under one worker make a cycle).
        self.worker_spans = True
        # perf_counter is monotonic and precise; anchor it to the wall clock once.
        self._anchor_ns = time.time_ns() - time.perf_counter_ns()
        self._cuda = self._cuda_module(use_cuda)
        self._step = -1
        self._step_done = (-1, -1)  # (last completed step, when), replaced as one tuple: no lock needed
        self._window: int | None = None
        self._seq: dict[str, int] = {}
        self._ops: list[tuple] = []
        self._ccl: list[dict] = []
        self._lock = threading.Lock()
        self._inflight: tuple[str, str, int, int] | None = None  # op, group, seq, since_ns
        self._paused: tuple[str, str, int, int] | None = None    # in_flight: a checkpoint save the rank is in
        # Collectives on device tensors in the order the stream meets them, until the GPU is past them
        # (``gpu_mark``, ``_gpu_inflight``): what a rank's GPU is inside while its host has moved on.
        self._gpu_calls: collections.deque[_GpuMark] = collections.deque(maxlen=4096)
        self._last_op = ("", -1)
        # The rank's pace: the longest gap between two progress events (an op ending) in the step in progress,
        # and those of its recent completed steps; a high quantile of them is its heartbeats' quiet_ns.
        self._gap_in_step = 0
        self._step_gaps: collections.deque[int] = collections.deque(maxlen=QUIET_STEPS)
        self._steps_done = 0
        self._quiet_ns = -1
        self._watch = None  # ingest.rank_watch.RankWatch, when the session started one (attach_watch)
        self._stacks_requested = threading.Event()
        self._dumped_for: tuple | None = None
        self._closed = threading.Event()
        self._pending_cuda: queue.Queue = queue.Queue()
        self._step_ref: _StepAnchor | None = None
        self._last_anchor: _StepAnchor | None = None  # the resolver's: the previous step's, for chaining
        threading.Thread(target=self._heartbeat_loop, name="ss-heartbeat", daemon=True).start()
        self._gpu = None
        if nvml is not False and (nvml is not None or self._cuda is not None):
            from ingest.nvml import NvmlSampler

            self._gpu = NvmlSampler(nvml)
        self._tcp_marks: queue.SimpleQueue | None = None
        self._tcp_thread = None
        self.probe = None  # ingest.path_probe.PathProbe, attached once the ranks traded addresses (attach_probe)
        if tcp_flows:
            from ingest.tcp_flows import TcpFlowSampler

            self._tcp = TcpFlowSampler()
            if not self._tcp.unavailable:
                self._tcp_marks = queue.SimpleQueue()
                self._tcp_thread = threading.Thread(target=self._tcp_loop, name="ss-tcp-flows", daemon=True)
                self._tcp_thread.start()
        if peer_timings is None:
            from ingest.nccl_peers import PeerTimingFeed

            peer_timings = PeerTimingFeed.from_env()
        self.peer_timings = peer_timings
        if port_counters is None or port_counters is True:
            from ingest.port_counters import PortCounterSampler, reports_ports

            # The ports are the host's: one rank per host reads them, the others would send the same rows again.
            port_counters = PortCounterSampler() if port_counters or reports_ports() else None
        self._ports = port_counters or None
        self._resolver = None
        if self._cuda is not None:
            self._resolver = threading.Thread(target=self._resolve_loop, name="ss-cuda-events", daemon=True)
            self._resolver.start()

    # -- progress -----------------------------------------------------------
    def _progress(self, op: str, now_ns: int | None = None, counts: bool = True) -> None:
        """An op ended: the rank made progress (what the hang detector watches). ``counts`` False for the end
        of a pause the job makes on purpose (a checkpoint save), which is not its pace."""
        now = self.now_ns() if now_ns is None else now_ns
        prev = self._last_op[1]
        if counts and prev >= 0 and now - prev > self._gap_in_step:
            self._gap_in_step = now - prev
        self._last_op = (op, now)

    def _step_paced(self) -> None:
        """A step completed: its longest gap joins the rank's pace (its first steps are left out)."""
        self._steps_done += 1
        if self._steps_done > QUIET_SKIP_STEPS:
            self._step_gaps.append(self._gap_in_step)
            if len(self._step_gaps) >= 3:
                gaps = sorted(self._step_gaps)
                self._quiet_ns = gaps[int(0.9 * (len(gaps) - 1))]  # p90: a checkpoint or two do not set it
        self._gap_in_step = 0

    # -- clocks -------------------------------------------------------------
    def now_ns(self) -> int:
        return time.perf_counter_ns() + self._anchor_ns + self.clock_offset_ns

    def _to_job_clock(self, perf_ns: int) -> int:
        return perf_ns + self._anchor_ns + self.clock_offset_ns

    def _event(self):
        # blocking: the resolver sleeps in Event.synchronize instead of spinning a core for the whole step
        return self._cuda.Event(enable_timing=True, blocking=True)

    @staticmethod
    def _cuda_module(use_cuda: bool | None):
        if use_cuda is False:
            return None
        try:
            import torch
        except ImportError:
            return None
        if not torch.cuda.is_available():
            if use_cuda:
                raise RuntimeError("use_cuda=True but no CUDA device is available")
            return None
        return torch.cuda

    # -- marking ------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int):
        """Marks one training step; ops inside a sampled step are recorded."""
        self.start_step(step)
        completed = False
        try:
            yield self
            completed = True
        finally:
            self.finish_step(completed)

    def start_step(self, step: int) -> None:
        """Begin step ``step`` (for hooks that cannot wrap the step in a with-block)."""
        self._step = step
        if self._first_step is None:
            self._first_step = step
        if len(self._plan) > 1:  # a change from a step: the steps from it on, whatever steps the job skips
            self.sampling = _plan_at(self._plan, step)
        self._window = self.sampling.window_of(step)
        self._seq = {}
        if self._window is not None and self._tcp_marks is not None:
            self._tcp_marks.put((self._window, step, False))  # read by the flows' thread, not this one
        if self._window is not None and self._cuda is not None:
            ev = self._event()
            ev.record()
            self._step_ref = _StepAnchor(ev, time.perf_counter_ns())
            self._pending_cuda.put(self._step_ref)  # placed on the host clock by the resolver, before the ops

    def finish_step(self, completed: bool = True) -> None:
        """End the current step; ``completed`` False when it raised (it then does not count as done)."""
        if completed:
            self._step_done = (self._step, self.now_ns())
            self._step_paced()
        if self._window is not None:
            if self._tcp_marks is not None:
                self._tcp_marks.put((self._window, self._step, True))
            self._flush_step()
        self._window = None
        plan = self._wanted_plan  # one read: the follower may replace it at any moment
        if plan is not self._plan:
            self._take_plan(plan)
        # from the next step on; the step that just ended kept its window
        self.sampling = plan[0][1] if len(plan) == 1 else _plan_at(plan, self._step + 1)

    def _take_plan(self, plan: tuple) -> None:
        """Take a new plan at a step end: a step it names that this rank already ran (under the old plan) is a
        change heard of late, counted and said once (from the rank's first step on: before it, the rank was not
        running)."""
        known = {f for f, _ in self._plan}
        late = [f for f, _ in plan[1:] if f not in known and (self._first_step or 0) < f <= self._step]
        self._plan = plan
        if late:
            self.stats.control_late += len(late)
            if not self._said_late:
                self._said_late = True
                log.warning("control: rank %d of %s heard of a sampling change for step %d only after step %d: "
                            "applied from step %d (counted in control_late; said once)", self.rank, self.job_id,
                            late[0], self._step, self._step + 1)

    def offer_sampling(self, sampling) -> None:
        """The sampling to use from the next step end on (any thread; the training thread is not waited for)."""
        self._wanted_plan = ((0, sampling),)

    def offer_plan(self, plan: tuple) -> None:
        """Which sampling to use from which step, ((0, sampling), (step, sampling), ...), steps increasing; taken
        at the next step end (any thread; the training thread is not waited for)."""
        self._wanted_plan = plan

    def follow_control(self, bootstrap) -> None:
        """Follow the control topic at ``bootstrap`` (a ``KafkaConn`` or host:port) for this job's changes, on a
        daemon thread (``ingest.control``); idempotent. ``close()`` stops it."""
        if self.control is None:
            from ingest.control import ControlFollower

            self.control = ControlFollower.from_conn(self, bootstrap).start()

    @property
    def last_step_done(self) -> int:
        """The last step this rank completed, -1 before its first."""
        return self._step_done[0]

    @property
    def profiling(self) -> bool:
        """True inside a sampled step: what is timed now is recorded."""
        return self._window is not None

    @property
    def window(self) -> int | None:
        """The sampled window the current step belongs to (its first step), None outside sampled steps."""
        return self._window

    def relabel_buffered(self, mc: int, gmc: int) -> None:
        """Give the step's buffered spans this model chunk, learned after some of them began (a first stage's
        first forward comes before its first transfer says which stage it is). CPU-timed spans only:
        CUDA-timed ones are in the resolver's queue already, and keep what they began with."""
        with self._lock:
            self._ops = [op[:4] + (mc, gmc) + op[6:] for op in self._ops]

    def next_seq(self, optype: str) -> int:
        seq = self._seq.get(optype, 0)
        self._seq[optype] = seq + 1
        return seq

    @contextlib.contextmanager
    def op(self, optype: str, mb_id: int = -1, mc: int | None = None, gmc: int | None = None):
        """Times one op of the what-if model (docs/whatif.md, section 1) in the current step."""
        if self._window is None:
            with self._track(optype):
                yield
            return
        token = self.begin_op(optype, mb_id, mc, gmc)
        try:
            yield
        finally:
            self.end_op(token)

    def begin_op(self, optype: str, mb_id: int = -1, mc: int | None = None, gmc: int | None = None):
        """Start timing one op; returns a token for ``end_op`` (None outside sampled steps)."""
        self._inflight = (optype, "", -1, self.now_ns())
        if self._window is None:
            return None
        meta = (optype, self.next_seq(optype), self.mc if mc is None else mc, self.gmc if gmc is None else gmc,
                mb_id, self._step, self._window)
        if self._cuda is not None:
            ev = self._event()
            ev.record()
            return (ev, meta)
        return (time.perf_counter_ns(), meta)

    def end_op(self, token, end_perf_ns: int | None = None) -> None:
        """Finish the op of ``token``; ``end_perf_ns`` (CPU timing only) ends it earlier than now."""
        self._inflight = None
        if token is None:
            self._progress(self._last_op[0])
            return
        start, meta = token
        self._progress(meta[0])
        if self._cuda is not None:
            end = self._event()
            end.record()
            self._pending_cuda.put((start, end, self._step_ref, meta))
            return
        t1 = time.perf_counter_ns() if end_perf_ns is None else end_perf_ns
        with self._lock:
            self._ops.append((self._to_job_clock(start), max(0, t1 - start)) + meta)

    def record_op(self, optype: str, start_perf_ns: int, end_perf_ns: int, mb_id: int = -1, mc: int | None = None,
                  gmc: int | None = None) -> None:
        """Record an op timed by the caller on ``time.perf_counter_ns`` (e.g. split off another span)."""
        if self._window is None:
            return
        meta = (optype, self.next_seq(optype), self.mc if mc is None else mc, self.gmc if gmc is None else gmc,
                mb_id, self._step, self._window)
        if self._cuda is not None:
            # Host time and GPU time are different clocks: the GPU runs behind the host by whatever is
            # queued. A host-timed op (a GC pause, an empty optimizer) is placed where the stream is now,
            # so it keeps its order among the CUDA-timed ops; it keeps its host duration.
            at = self._event()
            at.record()
            self._pending_cuda.put((at, max(0, end_perf_ns - start_perf_ns), self._step_ref, meta))
            return
        with self._lock:
            self._ops.append((self._to_job_clock(start_perf_ns), max(0, end_perf_ns - start_perf_ns)) + meta)

    @contextlib.contextmanager
    def _track(self, optype: str, group: str = "", seq: int = -1):
        self._inflight = (optype, group, seq, self.now_ns())
        try:
            yield
        finally:
            self._inflight = None
            self._progress(optype)

    # -- collectives (called by the wrappers of instrument_distributed) ------
    def ccl_enter(self, op: str, group: str, group_ranks: list[int], seq: int) -> int:
        self._inflight = (op, group, seq, self.now_ns())
        return self.now_ns()

    def gpu_mark(self, op: str, group: str, seq: int) -> "_GpuMark | None":
        """An event recorded on the current stream now, for a collective on device tensors (None without
        CUDA). NCCL returns from a call at once, so the host's enter and exit say nothing of the collective;
        this event completes when the GPU reached the call, and ``ccl_exit``'s when the collective was done
        (after the call, or ``wait()``, the current stream waits on NCCL's). In sampled steps the two time
        the record; in every step they tell the heartbeats which collective the GPU is inside."""
        if self._cuda is None:
            return None
        timed = self._window is not None
        ev = self._event() if timed else self._cuda.Event()  # an untimed event costs less to record
        ev.record()
        mark = _GpuMark(op, group, seq, ev, timed)
        self._gpu_calls.append(mark)
        return mark

    def _gpu_inflight(self) -> tuple[str, str, int, int] | None:
        """The oldest collective this rank's GPU reached and has not finished: (op, group, seq, since_ns),
        since when a heartbeat first saw it entered. None when the GPU is inside none (a GPU stuck in a
        kernel before collective n has not entered it: the hang detector names it as missing)."""
        calls = self._gpu_calls
        try:
            while calls:
                m = calls[0]
                if m.exit is not None and m.exit.query():
                    calls.popleft()
                elif m.exit is None and len(calls) > 1 and calls[1].enter.query():
                    calls.popleft()  # async and never waited on: the stream went past it, its end is unknown
                else:
                    break
            if not calls or not calls[0].enter.query():
                return None
        except Exception as e:  # a broken event: the host's view stands
            self.stats.errors += 1
            log.warning("reading the GPU's collectives failed: %s", e)
            return None
        m = calls[0]
        if m.seen_ns < 0:
            m.seen_ns = self.now_ns()
        return m.op, m.group, m.seq, m.seen_ns

    def ccl_failed(self) -> None:
        """The call raised: it is not in flight (nor recorded as done)."""
        self._inflight = None

    def ccl_exit(self, op: str, group: str, group_ranks: list[int], seq: int, enter_ns: int, nbytes: int,
                 peers: list[int], algorithm: str = "", peer_transfer_ns: list[int] | None = None,
                 peer_bytes: list[int] | None = None, recv_wait_ns: int = -1, gpu_enter=None) -> None:
        """Record one call's exit. ``peer_transfer_ns`` and ``peer_bytes`` (one per peer) and
        ``recv_wait_ns`` only where the collective library timed each peer itself (a profiler plugin):
        the link diagnosis then reads its matrix directly (analyzers/links/reported.py). ``gpu_enter``
        (``gpu_mark`` at the call): the record's enter and exit are the GPU's, placed on the host clock by
        the resolver thread as op spans are."""
        if peer_transfer_ns is not None and len(peer_transfer_ns) != len(peers):
            raise ValueError(f"{len(peer_transfer_ns)} per-peer transfer times for {len(peers)} peers")
        exit_ns = self.now_ns()
        self._inflight = None
        self._progress(op, exit_ns)
        end = None
        if gpu_enter is not None:
            end = self._event() if gpu_enter.timed else self._cuda.Event()
            end.record()
            gpu_enter.exit = end
        if self._window is None:
            return
        row = dict(
            job_id=self.job_id, attempt=self.attempt, rank=self.rank, window_id=self._window, step=self._step,
            group=group, group_ranks=list(group_ranks), seq=seq, op=op, algorithm=algorithm, nbytes=nbytes,
            # Without the library's per-peer timing only enter and exit are known, and the link
            # diagnosis pairs them across ranks (analyzers/links/measured.py).
            enter_ns=enter_ns, exit_ns=exit_ns, peers=list(peers), peer_transfer_ns=list(peer_transfer_ns or []),
            peer_bytes=list(peer_bytes or []), recv_wait_ns=recv_wait_ns,
        )
        if end is not None and gpu_enter.timed:
            self._pending_cuda.put(_GpuCall(gpu_enter, self._step_ref, row))
            return
        with self._lock:
            self._ccl.append(row)

    # -- output -------------------------------------------------------------
    def _flush_step(self) -> None:
        if self._cuda is not None:
            # The resolver emits the step once its CUDA events complete, with the host-timed ops
            # and collectives of the step: a marker behind the step's last event pair tells it when.
            self._pending_cuda.put(_STEP_END)
            return
        self._emit_buffered()

    def _emit_buffered(self, resolved: list[tuple] | None = None) -> None:
        """Send CUDA-resolved ops (if any), the host-timed ops and the collectives buffered so far."""
        with self._lock:
            ops, self._ops = self._ops, []
        self._emit_ops((resolved or []) + ops)
        self._emit_ccl()

    def _emit_ops(self, ops: list[tuple]) -> None:
        if not ops or not self.worker_spans:
            return
        cols = list(zip(*ops))
        n = len(ops)
        table = pa.table({
            "job_id": [self.job_id] * n, "attempt": pa.array([self.attempt] * n, pa.int32()),
            "rank": pa.array([self.rank] * n, pa.int32()), "dp_rank": pa.array([self.dp_rank] * n, pa.int32()),
            "pp_rank": pa.array([self.pp_rank] * n, pa.int32()), "window_id": pa.array(cols[8], pa.int64()),
            "step": pa.array(cols[7], pa.int64()), "optype": pa.array(cols[2], pa.string()),
            "start_ns": pa.array(cols[0], pa.int64()), "duration_ns": pa.array(cols[1], pa.int64()),
            "seq_id": pa.array(cols[3], pa.int32()), "mc": pa.array(cols[4], pa.int16()),
            "gmc": pa.array(cols[5], pa.int16()), "mb_id": pa.array(cols[6], pa.int32()),
        }, schema=S.OP_SPAN)
        self.stats.ops += n
        self.send(table)

    def _emit_ccl(self) -> None:
        with self._lock:
            rows, self._ccl = self._ccl, []
        if rows:
            self.stats.ccl += len(rows)
            self.send(codec.from_rows(S.CCL_RECORD, self._with_peer_times(rows)))

    def send(self, table: pa.Table) -> None:
        """Hand ``table`` to the sink; a failing sink is counted and logged, never raised (training goes on)."""
        try:
            self.sink(table)
            self.stats.batches += 1
        except Exception as e:  # telemetry must never take training down
            self.stats.errors += 1
            log.warning("telemetry sink failed: %s", e)

    def _resolve_loop(self) -> None:
        """Turn CUDA event pairs into spans off the training thread, and send them.

        Only this thread waits on events (``Event.synchronize`` waits for one event, not the device).
        What is resolved is sent ``send_every_s`` after the first of it, not when a step ends: a step's
        last events complete when the training loop syncs with the GPU, the one moment the GPU idles
        until the host launches the next step, and building and sending tables then would hold the GIL
        against that launch (2-3% of a 120 ms H100 step, measured). A step's host-timed ops and
        collectives go with the first send after its end marker.
        """
        batch: list[tuple] = []
        due: float | None = None  # when what is resolved must be sent
        while not (self._closed.is_set() and self._pending_cuda.empty()):
            wait = 0.2 if due is None else max(0.0, due - time.monotonic())
            try:
                item = self._pending_cuda.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is not None and item is not _STEP_END:
                if due is not None and not self._ready_before(item, due):
                    # Still running on the GPU when a send is due (the next step's work, or a hung
                    # collective): send what is resolved first, a hang's evidence included.
                    self._emit_buffered(batch)
                    batch, due = [], None
                if isinstance(item, _StepAnchor):
                    self._anchor(item)
                else:
                    self._resolve(item, batch)
            if due is None and (batch or item is _STEP_END):
                due = time.monotonic() + self.send_every_s
            if due is not None and (time.monotonic() >= due or len(batch) >= 4096):
                self._emit_buffered(batch)
                batch, due = [], None
        self._emit_buffered(batch)

    @staticmethod
    def _ready_before(item: tuple, due: float) -> bool:
        """Whether the item's last event completes before ``due`` (polled: ``synchronize`` cannot time out)."""
        last = item.ev if isinstance(item, _StepAnchor) else item.mark.exit if isinstance(item, _GpuCall) \
            else item[0] if isinstance(item[1], int) else item[1]
        try:
            while not last.query():
                if time.monotonic() >= due:
                    return False
                time.sleep(0.002)
        except Exception:  # a broken event: _resolve counts and logs it
            pass
        return True

    def _anchor(self, ref: _StepAnchor) -> None:
        """Place a step's reference event on the host clock (``place_anchor``); on failure it keeps its
        record time, which places the step's spans as if the GPU had been idle when the step began."""
        try:
            waited = not ref.ev.query()
            if waited:
                ref.ev.synchronize()
            seen = time.perf_counter_ns()
            chained = None
            prev = self._last_anchor
            if prev is not None:
                gap = int(prev.ev.elapsed_time(ref.ev) * 1e6)
                if 0 <= gap < _CHAIN_MAX_NS:
                    chained = prev.perf_ns + gap
            ref.perf_ns = place_anchor(ref.recorded_ns, seen, waited, chained)
            self._last_anchor = ref
        except Exception as e:
            self.stats.errors += 1
            log.warning("CUDA step anchor failed: %s", e)

    def _resolve(self, item: tuple, batch: list[tuple]) -> None:
        if isinstance(item, _GpuCall):
            self._resolve_call(item)
            return
        start, end, ref, meta = item
        try:
            t0, dur = self._place(start, end, ref)
            batch.append((t0, dur) + meta)
        except Exception as e:
            self.stats.errors += 1
            log.warning("CUDA event resolution failed: %s", e)

    def _resolve_call(self, item: "_GpuCall") -> None:
        """A collective's GPU enter and exit, on the host clock: sent with the ops resolved with it."""
        try:
            t0, dur = self._place(item.mark.enter, item.mark.exit, item.ref)
            row = dict(item.row, enter_ns=t0, exit_ns=t0 + max(0, dur))
            with self._lock:
                self._ccl.append(row)
        except Exception as e:
            self.stats.errors += 1
            log.warning("CUDA event resolution of a collective failed: %s", e)

    def _with_peer_times(self, rows: list[dict]) -> list[dict]:
        """The records with each peer's share, where NCCL's profiler plugin reported them (``ingest.nccl_peers``;
        read once a step, as the records are sent); the records as they were otherwise, or if that failed."""
        if self.peer_timings is None:
            return rows
        try:
            return self.peer_timings.fill_rows(rows)
        except Exception as e:  # a bonus: the records go as they were
            self.stats.errors += 1
            log.warning("per-peer times of collectives failed: %s", e)
            return rows

    def _place(self, start, end, ref: _StepAnchor) -> tuple[int, int]:
        """(start on the job clock, duration ns) of an event pair, placed by its step's anchor; ``end`` an
        int is a host-timed op's duration (placed where the stream was when it was recorded). Waits for the
        last event: the resolver thread only."""
        if isinstance(end, int):
            start.synchronize()
            dur = end
        else:
            end.synchronize()
            dur = int(start.elapsed_time(end) * 1e6)
        return self._to_job_clock(ref.perf_ns + int(ref.ev.elapsed_time(start) * 1e6)), dur

    # -- checkpoints --------------------------------------------------------
    def checkpoint(self, step: int, kind: str = "save", *, start_ns: int | None = None,
                   duration_ns: int = 0) -> None:
        """Report a finished checkpoint ``kind`` (save or load) holding the state after ``step``.

        Call it once the save is durable (or the load done); a save that failed
        must not be reported. ``start_ns`` defaults to now minus ``duration_ns``
        (job clock). One CHECKPOINT row goes to the sink at once, which never
        blocks (``TelemetryProducer.send``); bad arguments are logged and
        counted in ``stats.errors``, never raised into training. Every rank may
        report its own shard; rank 0 reports last (it finishes the checkpoint's
        metadata), and the accounting takes rank 0's record as "complete".
        """
        try:
            if kind not in S.CHECKPOINT_KINDS:
                raise ValueError(f"checkpoint kind must be one of {S.CHECKPOINT_KINDS}, got {kind!r}")
            step, duration_ns = int(step), int(duration_ns)
            if step < 0 or duration_ns < 0:
                raise ValueError(f"checkpoint step and duration must be >= 0, got {step}, {duration_ns}")
            start = self.now_ns() - duration_ns if start_ns is None else int(start_ns)
            table = codec.from_rows(S.CHECKPOINT, [dict(
                job_id=self.job_id, attempt=self.attempt, rank=self.rank, step=step, ts_ns=start,
                duration_ns=duration_ns, kind=kind)])
        except Exception as e:  # telemetry must never take training down
            self.stats.errors += 1
            log.warning("checkpoint record dropped: %s", e)
            return
        self.stats.checkpoints += 1
        self.send(table)

    @contextlib.contextmanager
    def checkpointing(self, step: int, kind: str = "save"):
        """Times a checkpoint save or load; reports it only if the block completes without raising.

        While it runs the heartbeats say ``checkpoint-save`` (or ``-load``) is in flight: the hang
        detector gives a save minutes (``hang.checkpoint_s``), not the 45 s of a stalled step."""
        t0 = self.now_ns()
        with self.in_flight(f"checkpoint-{kind}"):
            yield
        self.checkpoint(step, kind, start_ns=t0, duration_ns=self.now_ns() - t0)

    @contextlib.contextmanager
    def in_flight(self, op: str):
        """Tell the heartbeats ``op`` is in flight (no span is timed): what a rank is doing while no step
        moves, such as a checkpoint save (``checkpoint-save``), which the hang detector waits longer for.
        It stays what the heartbeats say until it ends, whatever the rank calls inside it (a sharded save's
        own collectives). Its end counts as progress."""
        before, self._paused = self._paused, (op, "", -1, self.now_ns())
        try:
            yield
        finally:
            self._paused = before
            self._progress(op, counts=not op.startswith("checkpoint-"))

    def waiting_in(self, op: str, group: str) -> None:
        """Tell the heartbeats this rank now waits in collective ``op`` of ``group`` whose sequence number it
        cannot know (DDP's gradient all-reduce, run by its C++ reducer after the last gradient is ready),
        until the op in flight ends (``end_op``): a rank that never comes is then the one awaited."""
        self._inflight = (op, group, -1, self.now_ns())

    # -- heartbeats ---------------------------------------------------------
    def request_stacks(self) -> None:
        """Attach stacks to the next heartbeat (e.g. when the pipeline suspects a hang)."""
        self._stacks_requested.set()

    def _dump_after_ns(self) -> float:
        """No op ended on this rank for this long: its stacks go with the next heartbeat, once per stall, so
        that they are there when the pipeline names the hang (at 2.5 times the job's pace, at least 8 s)."""
        if self._quiet_ns < 0:
            return self.hang_dump_s * 1e9
        return max(self.dump_min_s * 1e9, 1.5 * self._quiet_ns)

    def heartbeat(self, proc_state: str = "") -> pa.Table:
        # A pause the rank makes on purpose (a checkpoint save) is what it is in, whatever it calls meanwhile:
        # torch.distributed.checkpoint's own collectives ran inside it and left the heartbeats saying nothing
        # (a 40 s sharded save was called a hang at 8.8 s).
        inflight = self._paused or self._inflight
        if inflight is None or not inflight[1]:
            # Not blocked in a collective on the host (NCCL's calls return at once): the one the GPU is
            # inside, if any, is what this rank waits on.
            inflight = self._gpu_inflight() or inflight
        now = self.now_ns()
        stack = recorder = ""
        last_end = self._last_op[1]
        quiet_since = last_end if last_end >= 0 else (inflight[3] if inflight is not None else -1)
        stuck = quiet_since >= 0 and now - quiet_since > self._dump_after_ns()
        if self._stacks_requested.is_set() or (stuck and self._dumped_for != (last_end, inflight)):
            stack = folded_stacks(skip_thread=threading.get_ident())
            recorder = flight_recorder.summary()
            self._stacks_requested.clear()
            self._dumped_for = (last_end, inflight)
        op, group, seq, since = inflight or ("", "", -1, -1)
        step_done, step_done_ns = self._step_done
        gpu = self._gpu.sample() if self._gpu is not None else None
        return codec.from_rows(S.HEARTBEAT, [dict(
            job_id=self.job_id, attempt=self.attempt, rank=self.rank, host=self.host, pid=os.getpid(), ts_ns=now,
            step=self._step, last_op=self._last_op[0], last_op_end_ns=self._last_op[1], inflight_op=op,
            inflight_group=group, inflight_seq=seq, inflight_since_ns=since, clock_offset_ns=self.clock_offset_ns,
            stack=stack, step_done=step_done, step_done_ns=step_done_ns, **(gpu.fields() if gpu else NO_SAMPLE),
            flight_recorder=recorder, proc_state=proc_state, heartbeat_s=float(self.heartbeat_s),
            quiet_ns=self._quiet_ns,
        )])

    def attach_watch(self, watch) -> None:
        """Tell ``watch`` (``ingest.rank_watch.RankWatch``) of every heartbeat from now on; it is closed with
        the exporter, after the last one."""
        self._watch = watch

    def _beat(self, proc_state: str = "") -> None:
        hb = self.heartbeat(proc_state)
        self.stats.heartbeats += 1
        self.send(hb)
        if self._watch is not None:
            self._watch.beat(hb)
        self._send_ports()

    def _send_ports(self) -> None:
        """This host's port counters since the last heartbeat (PORT_COUNTER), after the heartbeat itself: a slow or
        failing read never delays or loses a heartbeat."""
        ports = getattr(self, "_ports", None)  # the heartbeat thread starts before __init__ has made it
        if ports is None:
            return
        try:
            rows = ports.sample()
            if not rows:
                return
            ident = dict(job_id=self.job_id, attempt=self.attempt, rank=self.rank, host=self.host, ts_ns=self.now_ns())
            table = codec.from_rows(S.PORT_COUNTER, [dict(r, **ident) for r in rows])
        except Exception as e:  # telemetry must never take training down, nor stop its heartbeats
            self.stats.errors += 1
            log.warning("port counters dropped: %s", e)
            return
        self.stats.port_counters += table.num_rows
        self.send(table)

    @property
    def probing(self) -> bool:
        """Whether this exporter can carry a path probe: it reads its TCP connections."""
        return self._tcp_marks is not None

    def attach_probe(self, probe) -> None:
        """Fire ``probe`` (``ingest.path_probe.PathProbe``) once a window, in the window's first profiled step,
        and send what it measured with the connections' records; it is closed with the exporter. Its own
        connections are left out of the job's (they are measured by the probe, and marked so)."""
        self._tcp.ignore = frozenset(probe.endpoints())
        self.probe = probe

    def _tcp_loop(self) -> None:
        """Read the connections at each profiled step's start and end marks; send the step's differences.

        A reading lags its mark by this thread's wake-up (well under a millisecond when idle); the step's
        start reading is the previous step's end reading when the steps follow each other. The path probe,
        if any, is fired right after a window's first start reading, from this thread.
        """
        from ingest.tcp_flows import delta

        last: tuple | None = None  # (window, step, ended, reading) of the latest reading
        probed = None              # the window the probe was last fired in
        while True:
            mark = self._tcp_marks.get()
            if mark is None:  # close(): every mark before it is done
                return
            window, step, ended = mark
            try:
                if not ended:
                    if last is None or not (last[2] and last[0] == window and last[1] == step - 1):
                        last = (window, step, False, self._tcp.read())
                    if self.probe is not None and probed != window:
                        probed = window
                        self.probe.fire(window, step)
                    continue
                before = last[3] if last is not None and last[1] in (step, step - 1) else None
                last = (window, step, True, self._tcp.read())
                rows = delta(before, last[3]) if before is not None else []
                if self.probe is not None:
                    rows += self.probe.take_rows()  # each names its own window and step
                if rows:
                    ident = dict(job_id=self.job_id, attempt=self.attempt, rank=self.rank, window_id=window,
                                 step=step)
                    self.stats.tcp_flows += len(rows)
                    self.send(codec.from_rows(S.TCP_FLOW, [dict(ident, **r) for r in rows]))
            except Exception as e:  # telemetry must never take training down
                self.stats.errors += 1
                log.warning("reading TCP connections failed: %s", e)

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(self.heartbeat_s):
            try:
                self._beat()
            except Exception as e:  # telemetry must never take training down, nor stop its heartbeats
                self.stats.errors += 1
                log.warning("heartbeat failed: %s", e)

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is buffered (waiting up to ``timeout`` s for pending CUDA events) and send a last
        heartbeat (the final progress); idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._pending_cuda.put(_STEP_END)  # wakes the resolver: it sends what is left and stops
        if self._resolver is not None and self._resolver is not threading.current_thread():
            self._resolver.join(timeout)  # the last CUDA-timed ops are emitted by the resolver
        if self._tcp_thread is not None:
            self._tcp_marks.put(None)  # the last step's connections are read and sent first
            self._tcp_thread.join(min(timeout, 5.0))
        if self.probe is not None:
            self.probe.close()
        self._emit_buffered()
        self._beat("finished")
        if self.control is not None:
            self.control.close()
        if self._watch is not None:
            self._watch.close()


def estimate_clock_offset(exporter: RankExporter, rounds: int = 5, group=None) -> int:
    """Offset of this rank's clock to rank 0's, via torch.distributed (all ranks must call it).

    Each round: a barrier, then every rank reads its clock and all-gathers it;
    the barrier's exit skew bounds the error. The median over rounds is kept.
    ``group``: a CPU (gloo) group of every rank, rank 0 first, where the job's own backend is NCCL (whose
    collectives would touch a device the script may not have chosen yet).
    """
    import torch
    import torch.distributed as dist

    offsets = []
    host = host_id()
    same_host = False
    for _ in range(rounds):
        dist.barrier(group=group)
        t = torch.tensor([time.perf_counter_ns() + exporter._anchor_ns, host], dtype=torch.int64)
        out = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t, group=group)
        offsets.append(int(out[0][0].item() - t[0].item()))
        same_host = int(out[0][1].item()) == host
    offsets.sort()
    # A rank on rank 0's machine reads the same clock: any offset measured is the barrier's own skew (0.05-0.5
    # ms, a few ms under load), which put receives before their sends in the what-if.
    exporter.clock_offset_ns = 0 if same_host else offsets[len(offsets) // 2]
    return exporter.clock_offset_ns


def host_id() -> int:
    """This machine as a number: its host name and the kernel's boot id (two containers of one host share the
    boot id and the clock, names aside: the boot id decides where it is readable)."""
    import hashlib

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            who = f.read().strip()
    except OSError:
        who = socket.gethostname()
    return int.from_bytes(hashlib.blake2b(who.encode(), digest_size=8).digest(), "little", signed=True)
