"""One traced training process: settings, the moment of instrumentation, the exporter's life.

``instrument(...)`` (or ``arm_from_env()``, what ``stragglerscope trace``'s
``sitecustomize`` calls) wraps ``torch.distributed.init_process_group``. When
the process initialises torch.distributed, a ``TraceSession`` starts: its
producer (never blocking, spooling on a broker outage), its ``RankExporter``,
the wrapped collectives and the framework hooks (``ingest.autotrace.tracer``).
At exit it flushes and writes a small report for the launcher. A process that
never initialises torch.distributed (the ``torchrun`` agent, data workers) is
left alone.

Settings come from keyword arguments or from ``STRAGGLERSCOPE_TRACE_*``
environment variables, which every child process inherits.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
import threading
from pathlib import Path

from core.kafka_conn import KafkaConn
from core.layout import JobLayout
from ingest.autotrace.layout import DEFAULT_ORDER, LayoutError, coords_in_order, parse_order
from ingest.exporter import Sampling

log = logging.getLogger(__name__)

ENV = "STRAGGLERSCOPE_TRACE"
_LAYOUT_KEYS = {"dp": "dp_size", "pp": "pp_size", "tp": "tp_size", "cp": "cp_size", "vpp": "vpp_size"}


class SettingsError(ValueError):
    """A --layout, --sample or other trace setting that cannot be used."""


def parse_layout(text: str) -> dict[str, int | str]:
    """``dp=2,pp=2,tp=1`` -> {'dp_size': 2, 'pp_size': 2, 'tp_size': 1}; only the sizes named.

    ``order=A,B,...`` (the items after ``order=`` up to the next ``NAME=``) states the rank order, outermost
    dimension first, as a DeviceMesh's shape lists them: ``order=dp,pp`` numbers ranks dp-major (``dp_rank,
    stage = divmod(rank, pp)``), ``order=pp,dp,tp`` is Megatron's. It is kept as ``{'order': 'dp,pp'}``.
    """
    out: dict[str, int | str] = {}
    order: list[str] | None = None
    for part in filter(None, (p.strip() for p in text.split(","))):
        if order is not None and "=" not in part:
            order.append(part)  # the next dimension of order=...
            continue
        m = re.fullmatch(r"order\s*=\s*([\w\-/ ]*)", part)
        if m:
            order = [m.group(1)] if m.group(1) else []
            continue
        if order is not None:
            out["order"], order = _order_text(order), None
        m = re.fullmatch(r"(dp|pp|tp|cp|vpp)\s*=\s*(\d+)", part)
        if not m or int(m.group(2)) < 1:
            raise SettingsError(f"bad layout item {part!r}: want NAME=N with NAME in dp, pp, tp, cp, vpp and N >= 1, "
                                "or order=A,B,... with A, B, ... among dp, pp, tp, cp (outermost first)")
        out[_LAYOUT_KEYS[m.group(1)]] = int(m.group(2))
    if order is not None:
        out["order"] = _order_text(order)
    return out


def _order_text(names: list[str]) -> str:
    try:
        return ",".join(parse_order(",".join(names)))
    except LayoutError as e:
        raise SettingsError(str(e)) from None


def layout_sizes(layout: dict) -> dict[str, int]:
    """The sizes a parsed --layout names, without its rank order."""
    return {k: v for k, v in layout.items() if k in _SIZE_NAMES}


def layout_order(layout: dict) -> tuple[str, ...] | None:
    """The rank order a parsed --layout states, outermost first; None when it states none."""
    text = layout.get("order")
    return parse_order(text) if text else None


def parse_sample(text: str) -> Sampling:
    """``K/N``: profile K consecutive steps out of every N."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise SettingsError(f"bad sampling {text!r}: want K/N, e.g. 10/100")
    try:
        return Sampling(int(m.group(1)), int(m.group(2)))
    except ValueError as e:
        raise SettingsError(f"bad sampling {text!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class TraceSettings:
    job_id: str
    bootstrap: str
    layout: dict[str, int | str] = dataclasses.field(default_factory=dict)  # what --layout named (parse_layout)
    sampling: Sampling = Sampling()
    attempt: int = 0
    spool_dir: str = ""
    run_dir: str = ""          # where each rank writes its report at exit (the launcher reads them)
    heartbeat_s: float = 2.0
    hang_dump_s: float = 30.0
    team: str = ""
    model: str = ""
    kafka_transport: str = ""  # KafkaConn.to_json(): TLS/SASL settings, no secret; empty = plaintext
    peak_flops: float = 0.0    # peak FLOP/s of one device for MFU; 0: from the device's name (analyzers.mfu)
    probe_kb: int = 256        # KB each rank's path probe sends a window (ingest/path_probe.py); 0: no probe
    watch: bool = True         # a watch process beside each rank speaks for it when it cannot (ingest/rank_watch.py)

    def conn(self) -> KafkaConn:
        """The producer's Kafka connection."""
        return KafkaConn.from_json(self.bootstrap, self.kafka_transport)

    def to_env(self) -> dict[str, str]:
        layout = ",".join(f"{k}={self.layout[v]}" for k, v in _LAYOUT_KEYS.items() if v in self.layout)
        if self.layout.get("order"):
            layout = ",".join(filter(None, (layout, f"order={self.layout['order']}")))
        # The peak travels only when set: a STRAGGLERSCOPE_TRACE_PEAK_FLOPS of the user's own shell then
        # reaches the ranks unchanged.
        peak = {f"{ENV}_PEAK_FLOPS": repr(self.peak_flops)} if self.peak_flops else {}
        return {**peak, ENV: "1", f"{ENV}_JOB_ID": self.job_id, f"{ENV}_BOOTSTRAP": self.bootstrap,
                f"{ENV}_LAYOUT": layout,
                f"{ENV}_SAMPLE": f"{self.sampling.profile_steps}/{self.sampling.every}",
                f"{ENV}_ATTEMPT": str(self.attempt), f"{ENV}_SPOOL_DIR": self.spool_dir,
                f"{ENV}_RUN_DIR": self.run_dir, f"{ENV}_HEARTBEAT_S": str(self.heartbeat_s),
                f"{ENV}_HANG_DUMP_S": str(self.hang_dump_s), f"{ENV}_TEAM": self.team, f"{ENV}_MODEL": self.model,
                f"{ENV}_KAFKA_TRANSPORT": self.kafka_transport, f"{ENV}_PROBE_KB": str(self.probe_kb),
                f"{ENV}_WATCH": "1" if self.watch else "0"}

    @classmethod
    def from_env(cls, env=os.environ) -> "TraceSettings":
        def get(key: str, default: str = "") -> str:
            return env.get(f"{ENV}_{key}", default) or default
        if not get("JOB_ID") or not get("BOOTSTRAP"):
            raise SettingsError(f"{ENV}_JOB_ID and {ENV}_BOOTSTRAP must be set")
        return cls(job_id=get("JOB_ID"), bootstrap=get("BOOTSTRAP"), layout=parse_layout(get("LAYOUT")),
                   sampling=parse_sample(get("SAMPLE", "10/100")), attempt=int(get("ATTEMPT", "0")),
                   spool_dir=get("SPOOL_DIR"), run_dir=get("RUN_DIR"), heartbeat_s=float(get("HEARTBEAT_S", "2")),
                   hang_dump_s=float(get("HANG_DUMP_S", "30")), team=get("TEAM"), model=get("MODEL"),
                   kafka_transport=get("KAFKA_TRANSPORT"), peak_flops=_peak(get("PEAK_FLOPS", "0")),
                   probe_kb=_probe_kb(get("PROBE_KB", "256")), watch=get("WATCH", "1") != "0")


def _probe_kb(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise SettingsError(f"bad {ENV}_PROBE_KB {text!r}: want KB a rank's path probe sends a window, 0: none") \
            from None
    if not 0 <= value <= 65536:
        raise SettingsError(f"bad {ENV}_PROBE_KB {text!r}: want 0 (no probe) to 65536")
    return value


def _peak(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SettingsError(f"bad {ENV}_PEAK_FLOPS {text!r}: want FLOP/s of one device, e.g. 989e12") from None
    if not value >= 0 or value == float("inf"):
        raise SettingsError(f"bad {ENV}_PEAK_FLOPS {text!r}: want a finite number >= 0")
    return value


_armed: TraceSettings | None = None
_session: "TraceSession | None" = None
_lock = threading.Lock()


def current() -> "TraceSession | None":
    """The running session of this process, if torch.distributed was initialised under instrumentation."""
    return _session


def arm_from_env() -> None:
    """Called by the ``sitecustomize`` of ``stragglerscope trace``: arm with the inherited settings."""
    arm(TraceSettings.from_env())


def arm(settings: TraceSettings) -> None:
    """Instrument this process once it initialises torch.distributed (now, if it already has)."""
    global _armed
    _armed = settings
    from ingest.autotrace.imports import when_imported

    when_imported("torch.distributed.distributed_c10d", _patch_init)
    # DeviceMesh captured init_process_group by name when it was imported.
    when_imported("torch.distributed.device_mesh", _patch_init)
    when_imported("torch.distributed.device_mesh", _patch_mesh)


def _patch_mesh(module) -> None:
    """Tell the session of every DeviceMesh made over the job. Wrapped when arming, not when the session
    starts: ``init_device_mesh`` before ``init_process_group`` starts the session from inside the mesh's own
    constructor, which a wrapper installed then would miss (torchtitan's way: the layout went unread)."""
    cls = getattr(module, "DeviceMesh", None)
    orig = getattr(cls, "__init__", None)
    if orig is None or getattr(orig, "_stragglerscope", False):
        return

    def __init__(mesh, *args, **kwargs):
        orig(mesh, *args, **kwargs)
        session = _session
        if session is not None and kwargs.get("_root_mesh") is None:  # a slice says nothing new
            tracer = getattr(session, "tracer", None)
            if tracer is not None:
                tracer.on_mesh(mesh)  # guarded: never raises
    __init__.__wrapped__ = orig
    __init__.__doc__ = orig.__doc__
    __init__._stragglerscope = True
    cls.__init__ = __init__


def _patch_init(module) -> None:
    orig = getattr(module, "init_process_group", None)
    if orig is None or getattr(orig, "_stragglerscope", False):
        return

    def init_process_group(*args, **kwargs):
        _arm_nccl(args, kwargs)  # before NCCL can make a communicator (eager init does it in there)
        out = orig(*args, **kwargs)
        _start()
        return out
    init_process_group.__wrapped__ = orig
    init_process_group.__doc__ = orig.__doc__
    init_process_group._stragglerscope = True
    module.init_process_group = init_process_group
    if module.__name__ == "torch.distributed.distributed_c10d":
        # torch.distributed may still be importing (it imports distributed_c10d): it copies the
        # patched name from here; when it is done, it is patched too, in case it was not.
        import sys as _sys

        dist = _sys.modules.get("torch.distributed")
        if dist is not None and getattr(dist, "init_process_group", None) is orig:
            dist.init_process_group = init_process_group
        if module.is_initialized():
            _start()


_nccl_checked = False
_nccl_note: str | None = None  # why the NCCL profiler plugin was not armed, for the session's warnings


def _uses_cuda(args: tuple, kwargs: dict) -> bool:
    """Whether ``init_process_group(*args, **kwargs)`` sets up NCCL: a backend naming it, a CUDA
    ``device_id``, or no backend on a machine where PyTorch would pick NCCL itself."""
    device = kwargs.get("device_id")
    if device is not None and getattr(device, "type", None) == "cuda":
        return True
    backend = kwargs.get("backend", args[0] if args else None)
    if backend not in (None, "", "undefined"):
        return "nccl" in str(backend).lower()
    import torch
    import torch.distributed as dist

    return bool(dist.is_nccl_available() and torch.cuda.is_available())


def _arm_nccl(args: tuple = (), kwargs: dict | None = None, known: bool | None = None) -> None:
    """Point NCCL at our profiler plugin (``ingest.nccl_profiler``) when this job uses CUDA, once per
    process: each collective's per-peer times then reach its records (``ingest.nccl_peers``). Environment
    only: NCCL reads it when it makes its first communicator, and the exporter when it starts. Never fails
    the job; a missing plugin becomes one warning of the session."""
    global _nccl_checked, _nccl_note
    settings = _armed
    if _nccl_checked or settings is None:
        return
    try:
        if not (_uses_cuda(args, kwargs or {}) if known is None else known):
            return
        _nccl_checked = True
        from ingest.nccl_profiler import arm as arm_plugin

        peers_dir = (os.path.join(settings.run_dir, "nccl-peers") if settings.run_dir else
                     os.path.join(tempfile.gettempdir(), f"stragglerscope-nccl-{settings.job_id}-{settings.attempt}"))
        _nccl_note = arm_plugin(os.environ, peers_dir)
    except Exception as e:  # a bonus: the job runs without it
        _nccl_checked = True
        _nccl_note = f"the NCCL profiler plugin was not armed ({e!r}): per-peer link times are off"


def _start() -> None:
    """Start this process's session (once); never raises into training."""
    global _session
    with _lock:
        if _session is not None or _armed is None:
            return
        if not _nccl_checked:  # initialised before we could wrap it: NCCL may still make its communicators lazily
            try:
                import torch.distributed as dist

                _arm_nccl(known="nccl" in str(dist.get_backend()).lower())
            except Exception:
                pass
        try:
            _session = TraceSession(_armed)
        except Exception as e:
            print(f"stragglerscope trace: instrumentation disabled in rank process {os.getpid()}: {e!r}",
                  file=sys.stderr)


def instrument(job_id: str, bootstrap: str | KafkaConn, *, layout: str | dict | None = None,
               sample: str | Sampling = "10/100", attempt: int = 0, spool_dir: str = "", team: str = "",
               model: str = "", peak_flops: float = 0.0) -> None:
    """Instrument this training process with no other change to its code (the one-call API).

    Call it before or after ``torch.distributed.init_process_group``. Steps,
    forward and backward per microbatch, pipeline transfers, collectives,
    optimizer, GC pauses and checkpoints are then recorded as
    ``stragglerscope trace`` records them, and exported to ``bootstrap`` (a
    host:port list, or an ``core.kafka_conn.KafkaConn`` for TLS/SASL).
    ``layout``: ``--layout``'s text (sizes, ``order=...``); ``peak_flops``: one
    device's peak FLOP/s for MFU, 0 to take it from the device's name.
    """
    transport = bootstrap.to_json() if isinstance(bootstrap, KafkaConn) else ""
    lay = parse_layout(layout) if isinstance(layout, str) else dict(layout or {})
    sampling = parse_sample(sample) if isinstance(sample, str) else sample
    arm(TraceSettings(job_id=job_id, bootstrap=str(bootstrap), layout=lay, sampling=sampling, attempt=attempt,
                      spool_dir=spool_dir, team=team, model=model, kafka_transport=transport,
                      peak_flops=float(peak_flops)))


class TraceSession:
    """Producer, exporter and hooks of one rank; closed at interpreter exit."""

    def __init__(self, settings: TraceSettings):
        import torch.distributed as dist

        from ingest.autotrace.tracer import Tracer
        from ingest.exporter import RankExporter, estimate_clock_offset
        from ingest.producer import TelemetryProducer
        from ingest.torch_ccl import instrument_distributed

        self.settings = settings
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.warnings: list[str] = []
        if _nccl_note:  # said once for the job: the launcher prints the ranks' warnings deduplicated
            self.warnings.append(_nccl_note)
            if self.rank == 0:
                print(f"stragglerscope trace: warning: {_nccl_note}", file=sys.stderr, flush=True)
        self.problems: list[str] = []   # what no source can reconcile: the registration is flagged with them
        self.order = layout_order(settings.layout)
        self.layout = JobLayout(self.world, 1)
        self.relayout()  # --layout alone, until the processes say more
        dp_rank, pp_rank, speaks = self.order_coords(self.rank, quiet=True)
        spool = os.path.join(settings.spool_dir, f"rank{self.rank}") if settings.spool_dir else None
        self.producer = TelemetryProducer(settings.conn(), client_id=f"trace-{settings.job_id}-{self.rank}",
                                          spool_dir=spool)
        self.exporter = RankExporter(settings.job_id, self.rank, dp_rank, pp_rank, self.producer.send,
                                     attempt=settings.attempt, sampling=settings.sampling,
                                     heartbeat_s=settings.heartbeat_s, hang_dump_s=settings.hang_dump_s)
        self.exporter.worker_spans = speaks
        # `stragglerscope control` changes this job's sampling and heartbeats at run time (a daemon thread).
        self.exporter.follow_control(settings.conn())
        if settings.watch:
            from ingest.rank_watch import RankWatch

            watch = RankWatch.start(bootstrap=settings.bootstrap, transport=settings.kafka_transport,
                                    period_s=settings.heartbeat_s)
            if watch is not None:
                self.exporter.attach_watch(watch)
        self.side_group = self._side_group(dist)
        # Every rank is inside init_process_group now, so a collective here cannot deadlock. With a GPU
        # backend the default group's would touch a device the script may not have chosen yet: the clocks
        # are compared over our own gloo group instead (ranks on other hosts are off by their NTP error).
        if dist.get_backend() == "gloo":
            estimate_clock_offset(self.exporter)
        elif self.side_group is not None:
            try:
                estimate_clock_offset(self.exporter, group=self.side_group)
            except Exception as e:
                self.warn(f"clock offsets not measured ({e!r}): ranks on other hosts keep their NTP error")
        self.tracer = Tracer(self)
        self.undo_ccl = instrument_distributed(self.exporter, observer=self.tracer)
        self.tracer.install()
        from ingest.autotrace.checkpoints import CheckpointWatch

        self.checkpoints = CheckpointWatch(self.exporter, self.tracer._failed)
        self.checkpoints.install()
        self._closed = False
        # Flush before the Kafka client's own atexit handler closes it: threading's exit hooks run
        # before atexit's.
        register = getattr(threading, "_register_atexit", atexit.register)
        try:
            register(self.close)
        except RuntimeError:  # interpreter already shutting down
            atexit.register(self.close)

    def _side_group(self, dist):
        """A gloo group of every rank, ours alone: after step 0 each rank's claim (its worker, the sizes it
        sees, its FLOPs) goes to every other through one all-gather on it, posted and polled so that training
        never waits on it. Made here because every rank is in this call (a group's creation is collective)
        and before the job makes its own groups. None where it cannot be made: no cross-rank check then."""
        if self.world == 1:
            return None
        try:
            return dist.new_group(backend="gloo")
        except Exception as e:
            self.warn(f"no side group for the layout check and MFU ({e!r}): each rank's layout goes unchecked")
            return None

    def order_coords(self, rank: int, quiet: bool = False) -> tuple[int, int, bool]:
        """(dp_rank, pp_rank, sends its worker's spans) of ``rank`` by rank order alone: the order --layout
        states, else Megatron's (TP fastest, then CP, DP, PP slowest). ``quiet``: a provisional reading,
        before the processes said what they know (an order that leaves out a size is no news then)."""
        lay = self.layout
        sizes = {"dp": lay.dp_size, "pp": lay.pp_size, "tp": lay.tp_size, "cp": lay.cp_size}
        try:
            c = coords_in_order(rank, sizes, self.order or DEFAULT_ORDER)
        except LayoutError as e:
            if not quiet:
                self.warn(f"--layout {e}; Megatron's order is used")
            c = coords_in_order(rank, sizes, DEFAULT_ORDER)
        return c["dp"], c["pp"], c["tp"] == 0 and c["cp"] == 0

    def relayout(self, pp: int | None = None, vpp: int | None = None, mesh: dict[str, int] | None = None,
                 source: str = "the DeviceMesh") -> None:
        """The layout again, from --layout and what the processes report: a pipeline's ``pp`` and ``vpp``,
        sizes of a DeviceMesh or of the groups the job uses (``mesh``, told by ``source``). What they report
        beats --layout (a contradiction is a warning and the contradicted names are dropped); where the mesh
        and the pipeline disagree, the pipeline, which runs the schedule, wins and the mesh's sizes are not
        used. When nothing makes the world (a pipeline whose size does not divide it), it is a problem: the
        registration is flagged and its windows are not analysed."""
        named = layout_sizes(self.settings.layout)
        mesh = {k: v for k, v in (mesh or {}).items() if pp is None or k != "pp_size"}
        told = set(mesh) | {k for k, v in (("pp_size", pp), ("vpp_size", vpp)) if v is not None}
        unnamed = {k: v for k, v in named.items() if k not in told and k != "dp_size"}
        attempts = ((named, mesh, "using what the processes report"),
                    (unnamed, mesh, f"{source}'s sizes are not used"),
                    (unnamed, {}, "the sizes --layout names are not used"), ({}, {}, ""))
        for sizes, reported, fallback in attempts:
            try:
                self.layout = resolve_layout(sizes, self.world, pp=pp, vpp=vpp, reported=reported, source=source)
                return
            except SettingsError as e:
                if fallback:
                    self.warn(f"{e}; {fallback}")
                    continue
                self.problem(str(e))
                self.layout = JobLayout(self.world, 1)

    def problem(self, msg: str) -> None:
        """A contradiction nothing reconciles: a warning now, and the registration carries it."""
        if msg not in self.problems:
            self.problems.append(msg)
        self.warn(f"layout conflict: {msg}")

    def warn(self, msg: str, now: bool = True) -> None:
        """A clear line in the trace log, once per message; never an exception in training. Every warning is
        in the rank's report, which ``trace``'s summary prints once per job; ``now``: printed by the rank as
        it happens too (what the user should act on while the job runs), else only there."""
        if msg not in self.warnings:
            self.warnings.append(msg)
            if now:
                print(f"stragglerscope trace: rank {self.rank}: warning: {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.checkpoints.undo()
            self.tracer.close()
            self.exporter.close()
            self.producer.close(30)
        except Exception as e:
            print(f"stragglerscope trace: rank {self.rank}: flushing failed: {e!r}", file=sys.stderr)
        self._write_report()

    def _write_report(self) -> None:
        if not self.settings.run_dir:
            return
        st = self.producer.stats
        report = dict(rank=self.rank, world=self.world, job_id=self.settings.job_id, attempt=self.settings.attempt,
                      windows=sorted(self.tracer.windows), steps=self.tracer.step,
                      layout=dataclasses.asdict(self.layout), layout_problems=self.problems,
                      records_sent=st.records_sent, records_dropped=st.records_dropped,
                      records_spooled=self.producer.spooled, errors=self.exporter.stats.errors,
                      warnings=self.warnings)
        try:
            path = Path(self.settings.run_dir) / f"rank{self.rank}.json"
            path.write_text(json.dumps(report))
        except OSError as e:
            print(f"stragglerscope trace: rank {self.rank}: cannot write its report: {e}", file=sys.stderr)


_SIZE_NAMES = {"dp_size": "dp", "pp_size": "pp", "tp_size": "tp", "cp_size": "cp", "vpp_size": "vpp"}


def resolve_layout(named: dict, world: int, pp: int | None = None, vpp: int | None = None,
                   reported: dict[str, int] | None = None, source: str = "the framework") -> JobLayout:
    """The job's layout from what the user named and what the framework reports.

    ``pp`` and ``vpp`` come from the pipeline's stages and schedule, ``reported`` from a DeviceMesh's named
    dimensions (``{"dp_size": 2, "tp_size": 2, ...}``, told by ``source``). Data parallel is whatever the
    world leaves over unless reported. A contradiction raises SettingsError; the caller turns it into a
    warning and keeps the framework's word.
    """
    sizes = layout_sizes(named)
    told = dict(reported or {})
    if pp is not None:
        told["pp_size"] = pp
    if vpp is not None:
        told["vpp_size"] = vpp
    for key, value in told.items():
        if key in sizes and sizes[key] != value:
            what = ("the pipeline stages report" if key == "pp_size" and pp is not None else
                    "the schedule runs" if key == "vpp_size" and vpp is not None else
                    f"{source} {'say' if source.endswith('groups') else 'says'}")
            raise SettingsError(f"--layout says {_SIZE_NAMES[key]}={sizes[key]} but {what} "
                                f"{_SIZE_NAMES[key]}={value}")
        sizes[key] = value
    rest = sizes.get("pp_size", 1) * sizes.get("tp_size", 1) * sizes.get("cp_size", 1)
    if "dp_size" not in sizes:
        sizes["dp_size"] = max(1, world // rest)
    lay = JobLayout(**{k: sizes.get(k, 1) for k in ("dp_size", "pp_size", "tp_size", "cp_size", "vpp_size")})
    if lay.world_size != world:
        raise SettingsError(f"layout dp={lay.dp_size} pp={lay.pp_size} tp={lay.tp_size} cp={lay.cp_size} "
                            f"is {lay.world_size} ranks, but the job has {world}")
    return lay


def coords_of(rank: int, layout: JobLayout) -> tuple[int, int]:
    """(dp_rank, pp_rank) of a global rank in Megatron's order: TP fastest, then CP, DP, PP slowest."""
    inner = layout.tp_size * layout.cp_size
    return (rank // inner) % layout.dp_size, rank // (inner * layout.dp_size)
