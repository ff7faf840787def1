"""The record schemas: the single source of truth for every record we move or store.

Producers, decoders (``core/codec.py``), the ClickHouse DDL (``storage/ddl.py``), the analyzers'
column contracts and the test factories all derive from the Arrow schemas
below. Every field carries its unit in the field metadata (``unit``) and every
schema carries ``SCHEMA_VERSION`` and its kind in the schema metadata, so a
decoder can reject what it does not know instead of misreading it.

Conventions
- Timestamps are int64 nanoseconds on the job-wide clock (each rank's exporter
  estimates its clock offset and reports aligned times).
- Durations are int64 nanoseconds.
- Worker coordinates follow docs/whatif.md: ``dp_rank``,
  ``pp_rank``; TP and CP ranks are folded into the worker. ``rank`` is the
  global rank of the process that reported the record.
- Op types are Megatron-LM names (``core.optypes.OPTYPES``), as in the golden traces.
- Versions: a field added after version 1 carries ``since`` and ``default``
  in its metadata and sits at the end of its schema. ``codec.decode`` reads every
  version from ``MIN_READ_VERSION`` to ``SCHEMA_VERSION``; ``conform`` and
  ``from_rows`` fill such a field with its default where a record lacks it
  (an older producer) or holds nulls there, so older records still decode.

Only pyarrow and the standard library are imported here: the analyzers import
this module and must stay free of Kafka, Ray, ClickHouse and Streamlit.
"""
from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 9
"""Bump on any change of a schema below; add a forward migration in storage/ where a table changes.

2: CHECKPOINT records, DOWNTIME and REMEDY results; JOB ``params``,
``seq_len`` and ``num_layers``; HEARTBEAT ``step_done`` and ``step_done_ns``; WINDOW
``mfu`` and ``mfu_ideal``.
3: kinds named as their tables: ``job``, ``window`` and ``step_slowdown`` (were
``job_registration``, ``window_result`` and ``step_result``; ``codec.KIND_ALIASES``
reads the old names). No table changed.
4: LINK_CELL results (the whole link matrix of a window). CCL_RECORD's
``peer_transfer_ns`` is empty where the library did not time each peer, and
``recv_wait_ns`` is -1 where unknown (the exporter used to repeat the op's
duration for every peer).
5: JOB ``layout_source`` and ``layout_problem`` (where the layout was read, and
what contradicts it); TCP_FLOW records (per-connection TCP counters of profiled steps); HEARTBEAT ``gpu_*``
(the rank's GPU as NVML reports it) and GPU_SAMPLE results (those samples, stored per rank).
6: HEARTBEAT ``flight_recorder`` (PyTorch's Flight Recorder, summarised, with a stack dump). No table changed.
7: TCP_FLOW ``probe`` rows (the path probe's own connection).
8: HEARTBEAT ``proc_state`` (what the rank's watch process sees of it: stopped, exited, unresponsive, finished),
``heartbeat_s`` (the period the rank reports at) and ``quiet_ns`` (its longest wait between two ops of its recent
steps: the hang threshold adapts to it); HANG kind ``hang_ended`` (a stall that ended, and what it was).
9: PORT_COUNTER records (a host's InfiniBand/RoCE port counters, as differences between two readings). No
other schema changed.
"""
MIN_READ_VERSION = 1
"""The oldest version ``decode`` still reads (fields added since get their defaults)."""


def _f(name: str, typ: pa.DataType, unit: str, doc: str, nullable: bool = False, *, since: int = 1,
       default: Any = None) -> pa.Field:
    """A documented field; one added after version 1 names its version and the default older records get."""
    md = {"unit": unit, "doc": doc}
    if since > 1:
        if default is None:
            raise ValueError(f"field {name!r} added in version {since} needs a default for older records")
        md.update(since=str(since), default=json.dumps(default))
    return pa.field(name, typ, nullable=nullable, metadata=md)


def default_of(field: pa.Field) -> tuple[bool, Any]:
    """(True, value) when ``field`` has a default for records that predate it, else (False, None)."""
    md = field.metadata or {}
    if b"default" not in md:
        return False, None
    return True, json.loads(md[b"default"])


def _schema(kind: str, doc: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(
        fields,
        metadata={
            "stragglerscope.kind": kind,
            "stragglerscope.version": str(SCHEMA_VERSION),
            "doc": doc,
        },
    )


_JOB = _f("job_id", pa.string(), "", "job identifier, unique in the fleet; also the Kafka key")
_ATTEMPT = _f("attempt", pa.int32(), "", "restart attempt of the job, 0 for the first launch")
_RANK = _f("rank", pa.int32(), "", "global rank of the reporting process")
_HOST = _f("host", pa.string(), "", "host name of the reporting process")

# --------------------------------------------------------------------------
# Input records (Kafka)
# --------------------------------------------------------------------------
OP_SPAN = _schema(
    "op_span",
    "One profiled op of one worker in one step (CUDA-event span or CPU timing).",
    [
        _JOB,
        _ATTEMPT,
        _RANK,
        _f("dp_rank", pa.int32(), "", "data-parallel rank of the worker"),
        _f("pp_rank", pa.int32(), "", "pipeline stage of the worker"),
        _f("window_id", pa.int64(), "", "profiling session: its first step (NDTimeline-style sampling)"),
        _f("step", pa.int64(), "", "training iteration"),
        _f("optype", pa.string(), "", "Megatron-LM op type, see OPTYPES"),
        _f("start_ns", pa.int64(), "ns", "op start on the job-wide clock"),
        _f("duration_ns", pa.int64(), "ns", "op duration"),
        _f("seq_id", pa.int32(), "", "order of ops of this type in this step on this worker"),
        _f("mc", pa.int16(), "", "model chunk inside the stage (VPP), 0 without VPP"),
        _f("gmc", pa.int16(), "", "global model chunk: mc * pp_size + pp_rank"),
        _f("mb_id", pa.int32(), "", "microbatch of a compute op, -1 for other ops"),
    ],
)

CCL_RECORD = _schema(
    "ccl_record",
    "One collective or point-to-point operation as one rank saw it.",
    [
        _JOB,
        _ATTEMPT,
        _RANK,
        _f("window_id", pa.int64(), "", "profiling session: its first step; -1 outside sessions"),
        _f("step", pa.int64(), "", "training iteration"),
        _f("group", pa.string(), "", "communication group name (e.g. dp:pp=0, pp:dp=1)"),
        _f("group_ranks", pa.list_(pa.int32()), "", "global ranks in the group, in group order"),
        _f("seq", pa.int64(), "", "sequence number of the op within the group"),
        _f("op", pa.string(), "", "all_reduce, reduce_scatter, all_gather, broadcast, barrier, send, recv"),
        _f("algorithm", pa.string(), "", "ring, tree, direct; empty if unknown"),
        _f("nbytes", pa.int64(), "bytes", "payload bytes"),
        _f("enter_ns", pa.int64(), "ns", "when this rank entered the op"),
        _f("exit_ns", pa.int64(), "ns", "when this rank completed the op; -1 while in flight", nullable=False),
        _f("peers", pa.list_(pa.int32()), "", "global ranks this rank exchanged data with"),
        _f("peer_transfer_ns", pa.list_(pa.int64()), "ns",
           "transfer time per peer as the library timed it, same order as peers; empty when not timed"),
        _f("peer_bytes", pa.list_(pa.int64()), "bytes", "bytes per peer, same order as peers; empty when unknown"),
        _f("recv_wait_ns", pa.int64(), "ns", "time spent waiting for the first byte from a peer; -1 when unknown"),
    ],
)

TCP_FLOW = _schema(
    "tcp_flow",
    "One TCP connection of one rank over one profiled step, from the kernel's TCP_INFO (gloo, NCCL over "
    "sockets): what the rank sent on it and how; both ends' records together give both directions.",
    [
        _JOB,
        _ATTEMPT,
        _RANK,
        _f("window_id", pa.int64(), "", "profiling session: its first step"),
        _f("step", pa.int64(), "", "training iteration the counters cover (from its start to its end)"),
        _f("local", pa.string(), "", "this rank's end of the connection, ip:port ([ip]:port for IPv6)"),
        _f("remote", pa.string(), "", "the other end, ip:port: the rank whose record has it as local"),
        _f("elapsed_ns", pa.int64(), "ns", "time between the two readings the counters are the difference of"),
        _f("bytes_acked", pa.int64(), "bytes", "data this rank sent that the peer acknowledged"),
        _f("bytes_received", pa.int64(), "bytes", "data this rank received"),
        _f("busy_us", pa.int64(), "us", "time this rank had unacknowledged data in flight on it (sending)"),
        _f("rwnd_limited_us", pa.int64(), "us", "... of it limited by the peer's receive window"),
        _f("sndbuf_limited_us", pa.int64(), "us", "... of it limited by this rank's send buffer"),
        _f("rtt_us", pa.int64(), "us", "smoothed round-trip time at the end"),
        _f("min_rtt_us", pa.int64(), "us", "lowest round-trip time the connection has seen"),
        _f("retrans", pa.int64(), "", "segments retransmitted"),
        _f("notsent_bytes", pa.int64(), "bytes", "data written but not yet sent, at the end"),
        _f("probe", pa.bool_(), "", "the rank's path probe (ingest/path_probe.py), not the job's own traffic: its "
           "step is the one it was sent in, its counters cover that one transfer", since=7, default=False),
    ],
)
"""Per-connection evidence for the link diagnosis (``analyzers/links/tcp.py``): a flat data-parallel ring has
no other observation that tells its slow element from the rest (every rank is in its one all-reduce)."""

PORT_COUNTER = _schema(
    "port_counter",
    "One InfiniBand/RoCE port of one host over the time between two readings of its sysfs counters "
    "(ingest/port_counters.py): differences, sent with the heartbeats by one rank per host.",
    [
        _JOB,
        _ATTEMPT,
        _f("rank", pa.int32(), "", "global rank of the process that read the host's ports"),
        _HOST,
        _f("device", pa.string(), "", "RDMA device, as under /sys/class/infiniband (e.g. mlx5_0)"),
        _f("port", pa.int32(), "", "port number on the device (1-based, as in sysfs)"),
        _f("ts_ns", pa.int64(), "ns", "the second reading, job clock"),
        _f("elapsed_ns", pa.int64(), "ns", "time between the two readings the counters are the difference of"),
        _f("state", pa.string(), "", "the port's state at the second reading (ACTIVE, DOWN, ...); '' unknown"),
        _f("xmit_wait", pa.int64(), "tick", "port_xmit_wait: ticks the port had data to send and could not "
           "(no credits: the link or the switch behind it is congested); -1 unknown"),
        _f("xmit_discards", pa.int64(), "", "port_xmit_discards: packets the port dropped on its way out; -1 unknown"),
        _f("rcv_discards", pa.int64(), "", "port_rcv_discards, where the driver has it; -1 unknown"),
        _f("symbol_errors", pa.int64(), "", "symbol_error: minor errors on the physical lanes; -1 unknown"),
        _f("rcv_errors", pa.int64(), "", "port_rcv_errors: packets received with errors; -1 unknown"),
        _f("link_downed", pa.int64(), "", "link_downed: the link went down (recovery failed); -1 unknown"),
        _f("link_error_recovery", pa.int64(), "", "link_error_recovery: the link retrained after errors (a flap); "
           "-1 unknown"),
        _f("xmit_bytes", pa.int64(), "bytes", "data sent: port_xmit_data, which counts 4-octet words, times 4; "
           "-1 unknown"),
        _f("rcv_bytes", pa.int64(), "bytes", "data received: port_rcv_data times 4; -1 unknown"),
        _f("hw_counters_json", pa.string(), "", "differences of the driver counters read from hw_counters (mlx5: "
           "out_of_buffer, np_cnp_sent, ...), name -> count, JSON; '{}' where none"),
        _f("reset", pa.bool_(), "", "a counter went backwards (reset or wrapped): it was counted from 0"),
    ],
)
"""Fabric evidence (``analyzers/fabric.py``): a link finding on a host whose port waits or errs says so, and port
errors count towards the host's lemon score."""

HEARTBEAT = _schema(
    "heartbeat",
    "Liveness and progress of one rank, sent every few seconds.",
    [
        _JOB,
        _ATTEMPT,
        _RANK,
        _HOST,
        _f("pid", pa.int64(), "", "process id"),
        _f("ts_ns", pa.int64(), "ns", "when the heartbeat was sent, job clock"),
        _f("step", pa.int64(), "", "last step started"),
        _f("last_op", pa.string(), "", "last op finished"),
        _f("last_op_end_ns", pa.int64(), "ns", "end of the last finished op"),
        _f("inflight_op", pa.string(), "", "op in flight, empty if none"),
        _f("inflight_group", pa.string(), "", "group of the collective in flight, empty if none"),
        _f("inflight_seq", pa.int64(), "", "sequence number of the collective in flight, -1 if none"),
        _f("inflight_since_ns", pa.int64(), "ns", "start of the op in flight, -1 if none"),
        _f("clock_offset_ns", pa.int64(), "ns", "estimated offset of this rank's clock to the job clock"),
        _f("stack", pa.string(), "", "folded Python stacks of all threads, only when dumped"),
        _f("step_done", pa.int64(), "", "last step this rank completed, -1 if none yet", since=2, default=-1),
        _f("step_done_ns", pa.int64(), "ns", "when step_done completed, job clock; -1 if none", since=2,
           default=-1),
        _f("gpu_sm_mhz", pa.int32(), "MHz", "the rank's GPU's SM clock (NVML); -1 where not sampled", since=5,
           default=-1),
        _f("gpu_mem_mhz", pa.int32(), "MHz", "its memory clock; -1 where not sampled", since=5, default=-1),
        _f("gpu_power_w", pa.float64(), "W", "its power draw; -1 where not sampled", since=5, default=-1.0),
        _f("gpu_power_limit_w", pa.float64(), "W", "its enforced power limit; -1 where not sampled", since=5,
           default=-1.0),
        _f("gpu_temp_c", pa.int32(), "C", "its temperature; -1 where not sampled", since=5, default=-1),
        _f("gpu_throttle", pa.string(), "", "what holds its clock down (power cap, thermal, ...), comma-separated",
           since=5, default=""),
        _f("gpu_ecc_uncorrected", pa.int64(), "", "uncorrected ECC errors since the driver loaded; -1 unknown",
           since=5, default=-1),
        _f("gpu_pcie_replays", pa.int64(), "", "PCIe replays; -1 unknown", since=5, default=-1),
        _f("flight_recorder", pa.string(), "", "PyTorch's Flight Recorder summarised (JSON; ingest.flight_recorder), "
           "with a stack dump only", since=6, default=""),
        _f("proc_state", pa.string(), "", "the process as its watch sees it when the rank's own heartbeats cannot "
           "tell (ingest.rank_watch): stopped, exited, unresponsive; finished in a rank's last heartbeat; "
           "empty while it reports itself", since=8, default=""),
        _f("heartbeat_s", pa.float64(), "s", "the period the rank sends heartbeats at; 0 unknown", since=8,
           default=0.0),
        _f("quiet_ns", pa.int64(), "ns", "the longest time between two ops ending on this rank over its recent "
           "steps (ingest.exporter); -1 until it completed a few steps", since=8, default=-1),
    ],
)

JOB = _schema(
    "job",
    "Sent once per job attempt by rank 0: the layout and ownership of the job.",
    [
        _JOB,
        _ATTEMPT,
        _f("ts_ns", pa.int64(), "ns", "registration time, job clock"),
        _f("team", pa.string(), "", "owning team"),
        _f("model", pa.string(), "", "model name"),
        _f("n_gpus", pa.int32(), "GPU", "GPUs of the job"),
        _f("dp_size", pa.int32(), "", "data parallel size"),
        _f("pp_size", pa.int32(), "", "pipeline parallel size"),
        _f("tp_size", pa.int32(), "", "tensor parallel size"),
        _f("cp_size", pa.int32(), "", "context parallel size"),
        _f("vpp_size", pa.int32(), "", "virtual pipeline (model chunks per stage)"),
        _f("num_microbatches", pa.int32(), "", "microbatches per step, 0 if unknown"),
        _f("profiled_steps", pa.int32(), "", "steps per profiling session (window length)"),
        _f("gpu_type", pa.string(), "", "GPU model, e.g. H100"),
        _f("peak_flops", pa.float64(), "FLOP/s", "peak dense FLOP/s of one GPU, 0 if unknown"),
        _f("flops_per_token", pa.float64(), "FLOP", "training FLOPs per token, 0 if unknown"),
        _f("tokens_per_step", pa.int64(), "token", "tokens per step, 0 if unknown"),
        _f("params", pa.int64(), "param", "model parameters; with flops_per_token 0, FLOPs per token = 6 x params",
           since=2, default=0),
        _f("seq_len", pa.int64(), "token", "training sequence length, 0 if unknown", since=2, default=0),
        _f("num_layers", pa.int32(), "", "transformer layers, 0 if unknown (layer repartition advice needs it)",
           since=2, default=0),
        _f("layout_source", pa.string(), "", "where the layout was read: the process groups the job uses, a "
           "DeviceMesh, --layout, or the rank order; '' if not said", since=5, default=""),
        _f("layout_problem", pa.string(), "", "what contradicts the layout (two ranks claiming one worker, a group "
           "that does not fit); '' if nothing: windows of a job with one are flagged, not analysed", since=5,
           default=""),
    ],
)

CHECKPOINT = _schema(
    "checkpoint",
    "A checkpoint save or load of one rank, sent once it finished (a failed save sends nothing).",
    [
        _JOB,
        _ATTEMPT,
        _RANK,
        _f("step", pa.int64(), "", "the checkpoint holds the state after this step completed"),
        _f("ts_ns", pa.int64(), "ns", "when the save or load started, job clock"),
        _f("duration_ns", pa.int64(), "ns", "how long the save or load took (training waited that long)"),
        _f("kind", pa.string(), "", "save or load"),
    ],
)
CHECKPOINT_KINDS = ("save", "load")

DEAD_LETTER = _schema(
    "dead_letter",
    "A message we could not decode or validate, kept with the reason.",
    [
        _f("ts_ns", pa.int64(), "ns", "when it was rejected, wall clock"),
        _f("source_topic", pa.string(), "", "topic it came from"),
        _f("source_partition", pa.int32(), "", "partition it came from"),
        _f("source_offset", pa.int64(), "", "offset it came from"),
        _f("key", pa.string(), "", "Kafka key (job id) if any"),
        _f("reason", pa.string(), "", "why it was rejected"),
        _f("payload", pa.binary(), "", "the rejected bytes, truncated to 64 KiB"),
    ],
)

# --------------------------------------------------------------------------
# Analysis results (ClickHouse tables derive from these)
# --------------------------------------------------------------------------
_WINDOW = _f("window_id", pa.int64(), "", "first step of the window; (job_id, attempt, window_id) is unique")

WINDOW = _schema(
    "window",
    "What-if analysis of one window of profiled steps of one job.",
    [
        _JOB,
        _ATTEMPT,
        _WINDOW,
        _f("first_step", pa.int64(), "", "first step analysed"),
        _f("last_step", pa.int64(), "", "last step analysed"),
        _f("n_steps", pa.int32(), "", "steps analysed"),
        _f("start_ns", pa.int64(), "ns", "window start, job clock"),
        _f("end_ns", pa.int64(), "ns", "window end, job clock"),
        _f("analyzed_ns", pa.int64(), "ns", "when the result was made, wall clock"),
        _f("team", pa.string(), "", "owning team"),
        _f("model", pa.string(), "", "model name"),
        _f("n_gpus", pa.int32(), "GPU", "GPUs of the job"),
        _f("dp_size", pa.int32(), "", "data parallel size"),
        _f("pp_size", pa.int32(), "", "pipeline parallel size"),
        _f("slowdown", pa.float64(), "ratio", "S = mean T / mean T_ideal"),
        _f("launch_slowdown", pa.float64(), "ratio", "mean actual / mean T (simulation fidelity)"),
        _f("waste_fraction", pa.float64(), "ratio", "W = 1 - 1/S"),
        _f("step_time_actual", pa.float64(), "s", "mean actual step time"),
        _f("step_time_sim", pa.float64(), "s", "mean simulated step time T, no launch delay"),
        _f("step_time_ideal", pa.float64(), "s", "mean simulated ideal step time T_ideal"),
        _f("gpu_hours", pa.float64(), "GPU-h", "GPU-hours of the window"),
        _f("wasted_gpu_hours", pa.float64(), "GPU-h", "W x gpu_hours"),
        _f("m_w", pa.float64(), "ratio", "share of the slowdown fixed by the top 3% workers"),
        _f("m_s", pa.float64(), "ratio", "share of the slowdown fixed by the last stage"),
        _f("verdict", pa.string(), "", "main root cause, empty if none"),
        _f("verdicts_json", pa.string(), "", "all verdicts with their evidence, JSON"),
        _f("complete", pa.bool_(), "", "false if the window closed on idle timeout or missed ranks"),
        _f("note", pa.string(), "", "why incomplete, warnings of the analysis"),
        _f("n_ops", pa.int64(), "", "ops analysed"),
        _f("mfu", pa.float64(), "ratio", "model FLOPs utilisation at the actual step time; NaN without FLOPs info",
           since=2, default=float("nan")),
        _f("mfu_ideal", pa.float64(), "ratio", "MFU at the simulated ideal step time (no stragglers); NaN without "
           "FLOPs info", since=2, default=float("nan")),
    ],
)

OPTYPE_SLOWDOWN = _schema(
    "optype_slowdown",
    "S_t: slowdown attributed to one op type in one window (step -1: whole window).",
    [
        _JOB,
        _ATTEMPT,
        _WINDOW,
        _f("step", pa.int64(), "", "step, or -1 for the whole window"),
        _f("optype", pa.string(), "", "op type; sends and recvs merged into forward-/backward-pp-comm"),
        _f("slowdown", pa.float64(), "ratio", "S_t"),
    ],
)

WORKER_SLOWDOWN = _schema(
    "worker_slowdown",
    "Slowdown attributed to one worker (dp_rank, pp_rank) in one window.",
    [
        _JOB,
        _ATTEMPT,
        _WINDOW,
        _f("step", pa.int64(), "", "step, or -1 for the whole window"),
        _f("dp_rank", pa.int32(), "", "data parallel rank"),
        _f("pp_rank", pa.int32(), "", "pipeline stage"),
        _f("s_dp", pa.float64(), "ratio", "S of this DP rank"),
        _f("s_pp", pa.float64(), "ratio", "S of this PP rank"),
        _f("s_w", pa.float64(), "ratio", "min(s_dp, s_pp)"),
    ],
)

STEP_SLOWDOWN = _schema(
    "step_slowdown",
    "Per-step times of one window: actual, simulated and ideal.",
    [
        _JOB,
        _ATTEMPT,
        _WINDOW,
        _f("step", pa.int64(), "", "step"),
        _f("actual_s", pa.float64(), "s", "actual step time"),
        _f("sim_s", pa.float64(), "s", "simulated step time, no launch delay (T)"),
        _f("ideal_s", pa.float64(), "s", "simulated ideal step time (T_ideal)"),
        _f("slowdown", pa.float64(), "ratio", "T / T_ideal of this step"),
    ],
)

HANG = _schema(
    "hang",
    "A hang or node loss detected in one job.",
    [
        _JOB,
        _ATTEMPT,
        _f("hang_id", pa.int64(), "ns", "detection time; unique per job"),
        _f("kind", pa.string(), "", "comm_hang, noncomm_hang, node_loss, or hang_ended (a stall that ended)"),
        _f("group", pa.string(), "", "communication group, empty if none"),
        _f("seq", pa.int64(), "", "sequence number of the collective, -1 if none"),
        _f("op", pa.string(), "", "the collective or op the ranks are stuck in"),
        _f("stuck_ranks", pa.string(), "", "folded ranges of ranks inside the op, e.g. 0-3,5"),
        _f("missing_ranks", pa.string(), "", "folded ranges of ranks that never entered"),
        _f("suspect_hosts", pa.string(), "", "comma-separated hosts of the suspects"),
        _f("since_ns", pa.int64(), "ns", "last progress, job clock"),
        _f("duration_s", pa.float64(), "s", "how long no progress was made at detection"),
        _f("evidence_json", pa.string(), "", "wait chain, merged stacks, JSON"),
    ],
)

LINK_FAULT = _schema(
    "link_fault",
    "A slow link, source or destination found in a latency matrix.",
    [
        _JOB,
        _ATTEMPT,
        _WINDOW,
        _f("group", pa.string(), "", "communication group"),
        _f("kind", pa.string(), "", "link, source, destination, noncomm_slow"),
        _f("src", pa.int32(), "", "source rank, -1 if any"),
        _f("dst", pa.int32(), "", "destination rank, -1 if any"),
        _f("confidence", pa.float64(), "ratio", "0..1"),
        _f("slowdown", pa.float64(), "ratio", "cell time / median cell time"),
        _f("evidence_json", pa.string(), "", "matrix cells behind the verdict, JSON"),
    ],
)

LINK_CELL = _schema(
    "link_cell",
    "One cell of a window's link matrix: a directed pair, or one member of a collective group.",
    [
        _JOB,
        _ATTEMPT,
        _WINDOW,
        _f("group", pa.string(), "",
           "p2p (pairs matched across ranks), a collective group and op, or a reported group"),
        _f("src", pa.int32(), "", "sending rank, or the member of a collective group"),
        _f("dst", pa.int32(), "", "receiving rank; -1 for a collective member"),
        _f("ns_per_byte", pa.float64(), "ns", "median time per byte (a collective: the group's comm time / bytes)"),
        _f("median_ns", pa.float64(), "ns", "median transfer (or comm) time; NaN where the library reported rates"),
        _f("wait_ns", pa.float64(), "ns",
           "median receiver wait (p2p) or the member's lateness (collective); -1 unknown"),
        _f("samples", pa.int64(), "", "transfers or collectives behind the cell"),
        _f("ratio", pa.float64(), "ratio", "ns_per_byte over the reference of its class; NaN without one"),
        _f("status", pa.string(), "", "slow, ok or unknown"),
    ],
)

ALERT = _schema(
    "alert",
    "An alert raised by a rule; deduplicated per (job, rule) with a cool-down.",
    [
        _f("alert_id", pa.string(), "", "stable id: job, rule and the window or hang it is about"),
        _JOB,
        _ATTEMPT,
        _f("ts_ns", pa.int64(), "ns", "when it was raised, wall clock"),
        _f("rule", pa.string(), "", "slowdown, hang, link, node_loss, fidelity"),
        _f("severity", pa.string(), "", "info, warning, critical"),
        _f("summary", pa.string(), "", "one line for the on-call engineer"),
        _f("details_json", pa.string(), "", "numbers behind it, JSON"),
    ],
)

_GPU_H = "GPU-h"
DOWNTIME = _schema(
    "downtime",
    "What one fault of one job attempt cost, in C4's categories (analyzers/downtime.py defines each).",
    [
        _JOB,
        _f("attempt", pa.int32(), "", "the attempt the fault struck"),
        _f("incident_id", pa.int64(), "ns", "first evidence of the incident (detection, alert or restart); unique "
           "per job"),
        _f("kind", pa.string(), "", "hang, node_loss or restart (a new attempt with no hang or node loss before)"),
        _f("team", pa.string(), "", "owning team"),
        _f("model", pa.string(), "", "model name"),
        _f("fault_start_ns", pa.int64(), "ns", "last progress: end of the last completed step (or of its "
           "checkpoint save)"),
        _f("alert_ns", pa.int64(), "ns", "first hang or node-loss alert, -1 if none"),
        _f("diagnosed_ns", pa.int64(), "ns", "when the faulty rank, host or link was named, -1 if never"),
        _f("restart_ns", pa.int64(), "ns", "registration of the next attempt, -1 if none"),
        _f("restart_attempt", pa.int32(), "", "the attempt that made the first step again, -1 if none"),
        _f("first_step_ns", pa.int64(), "ns", "completion of the first step after the fault (its start + "
           "step_time_s), -1 if none"),
        _f("fault_step", pa.int64(), "", "last step completed before the fault, -1 if none"),
        _f("last_checkpoint_step", pa.int64(), "", "step the job resumes from (loaded or last saved); -1: from "
           "scratch, or unknown (see note)"),
        _f("lost_steps", pa.int64(), "", "steps redone: fault_step - last_checkpoint_step"),
        _f("step_time_s", pa.float64(), "s", "step time of the attempt before the fault, checkpoint stalls "
           "excluded; NaN if unknown"),
        _f("n_gpus", pa.int32(), "GPU", "GPUs of the attempt the fault struck"),
        _f("detect_s", pa.float64(), "s", "fault start to first alert"),
        _f("diagnose_s", pa.float64(), "s", "first alert to the culprit named"),
        _f("isolate_s", pa.float64(), "s", "culprit named to restart (or to resumed progress)"),
        _f("lost_progress_s", pa.float64(), "s", "redone steps: lost_steps x step_time_s"),
        _f("reinit_s", pa.float64(), "s", "restart to the start of the first step of the new attempt"),
        _f("total_s", pa.float64(), "s", "sum of the five: how far the job's progress was set back"),
        _f("detect_gpu_hours", pa.float64(), _GPU_H, "detect_s x n_gpus"),
        _f("diagnose_gpu_hours", pa.float64(), _GPU_H, "diagnose_s x n_gpus"),
        _f("isolate_gpu_hours", pa.float64(), _GPU_H, "isolate_s x n_gpus"),
        _f("lost_progress_gpu_hours", pa.float64(), _GPU_H, "lost_progress_s x n_gpus"),
        _f("reinit_gpu_hours", pa.float64(), _GPU_H, "reinit_s x n_gpus"),
        _f("total_gpu_hours", pa.float64(), _GPU_H, "total_s x n_gpus"),
        _f("closed", pa.bool_(), "", "false if the stream ended before the job ran again (clipped there)"),
        _f("note", pa.string(), "", "what was estimated or missing"),
        _f("recovery_plan", pa.string(), "", "a node loss's restart plan for the nodes left, with its predicted "
           "step time and throughput (from the job's last window analysed whole); '' without one"),
    ],
)

REMEDY = _schema(
    "remedy",
    "One proposed fix for a window's verdict, with its gain simulated on the window's own trace "
    "(analyzers/remedies). One batch per advice run; readers take the latest batch of a window.",
    [
        _JOB,
        _ATTEMPT,
        _WINDOW,
        _f("advised_ns", pa.int64(), "ns", "when this batch of advice was computed"),
        _f("priority", pa.int32(), "", "rank by predicted gain, 1 = act on this first"),
        _f("kind", pa.string(), "", "repartition, repack, swap_host, gc_interval, drain_link or recovery_plan"),
        _f("verdict", pa.string(), "", "the verdict (or fault) it answers"),
        _f("action", pa.string(), "", "what to do, in one line"),
        _f("predicted_gain", pa.float64(), "ratio", "step time before / after - 1; 1e30 when the fix restores "
           "progress that is stopped"),
        _f("step_time_before_s", pa.float64(), "s", "mean step time as simulated now"),
        _f("step_time_after_s", pa.float64(), "s", "mean step time with the fix applied; 1e30 if nothing runs"),
        _f("details_json", pa.string(), "", "the plan: partition, packing, hosts, templates ..."),
    ],
)

# --------------------------------------------------------------------------
# Storage-only tables: written by the store, never sent through Kafka
# --------------------------------------------------------------------------
OFFSETS = pa.schema([
    pa.field("source_id", pa.string(), nullable=False, metadata={"unit": "", "doc": "names the Kafka cluster"}),
    pa.field("topic", pa.string(), nullable=False, metadata={"unit": "", "doc": "Kafka topic"}),
    pa.field("partition", pa.int32(), nullable=False, metadata={"unit": "", "doc": "Kafka partition"}),
    pa.field("next_offset", pa.int64(), nullable=False, metadata={"unit": "", "doc": "next offset to read"}),
    pa.field("log_id", pa.string(), nullable=False,
             metadata={"unit": "", "doc": "the log the offset was read from: the broker's topic id, else "
                                          "'cluster:' and its cluster id; '' = unknown (stored before it was kept)"}),
])

OFFSET_RESET = pa.schema([
    OFFSETS.field("source_id"), OFFSETS.field("topic"), OFFSETS.field("partition"),
    pa.field("reset_ns", pa.int64(), nullable=False, metadata={"unit": "ns", "doc": "when, wall clock"}),
    pa.field("from_offset", pa.int64(), nullable=False,
             metadata={"unit": "", "doc": "the stored offset given up (in the lost log)"}),
    pa.field("from_log_id", pa.string(), nullable=False, metadata={"unit": "", "doc": "the log it was read from"}),
    pa.field("to_offset", pa.int64(), nullable=False, metadata={"unit": "", "doc": "where reading goes on"}),
    pa.field("to_log_id", pa.string(), nullable=False, metadata={"unit": "", "doc": "the partition's log now"}),
    pa.field("by", pa.string(), nullable=False,
             metadata={"unit": "", "doc": "what moved it: 'start' (run with kafka.on_lost_log = rewind), "
                                          "'shard N' (while running), 'offsets reset' (the command)"}),
    pa.field("reason", pa.string(), nullable=False, metadata={"unit": "", "doc": "what was found"}),
], metadata={b"stragglerscope.kind": b"offset_reset"})
"""Audit of stored offsets moved because the broker lost its data: nothing is skipped without a row here."""

SHARD_STATE = pa.schema([
    OFFSETS.field("source_id"),
    pa.field("shard", pa.string(), nullable=False,
             metadata={"unit": "", "doc": "the partitions the state covers, e.g. 'p0,2,4/8'"}),
    pa.field("format", pa.int32(), nullable=False, metadata={"unit": "", "doc": "version of the state's encoding"}),
    pa.field("state", pa.string(), nullable=False,
             metadata={"unit": "", "doc": "the shard's open hang, alert and downtime state, compressed, base64 (text "
                                          "reads back unchanged from every backend)"}),
])
"""A shard's reducer state (ray_jobs.state): what a restarted shard resumes from, with the offsets stored after it."""

ALERT_ACK = pa.schema([
    pa.field("alert_id", pa.string(), nullable=False, metadata={"unit": "", "doc": "the acknowledged alert"}),
    pa.field("acked_ns", pa.int64(), nullable=False, metadata={"unit": "ns", "doc": "when (0 with acked=0: undone)"}),
    pa.field("acked", pa.uint8(), nullable=False, metadata={"unit": "", "doc": "1 acknowledged, 0 un-acknowledged"}),
    pa.field("acked_by", pa.string(), nullable=False, metadata={"unit": "", "doc": "who (free text)"}),
    pa.field("note", pa.string(), nullable=False, metadata={"unit": "", "doc": "why, or what was done"}),
])
"""Acknowledgements from the console: the latest row per alert wins, so an ack can be undone."""

CONTROL_CHANGE = pa.schema([
    pa.field("change_id", pa.string(), nullable=False, metadata={"unit": "", "doc": "the change's id (core/control.py)"}),
    pa.field("scope", pa.string(), nullable=False, metadata={"unit": "", "doc": "'fleet' or 'job:<job id>'"}),
    pa.field("job_id", pa.string(), nullable=False, metadata={"unit": "", "doc": "the job it is for; '' for the fleet"}),
    pa.field("who", pa.string(), nullable=False, metadata={"unit": "", "doc": "who made it ($USER or --who)"}),
    pa.field("when_ns", pa.int64(), nullable=False, metadata={"unit": "ns", "doc": "when it was made, wall clock"}),
    pa.field("until_ns", pa.int64(), nullable=False,
             metadata={"unit": "ns", "doc": "when it runs out, wall clock; 0: until cleared"}),
    pa.field("what_json", pa.string(), nullable=False,
             metadata={"unit": "", "doc": "the settings it makes, JSON ('{}' for a record that clears)"}),
    pa.field("clears", pa.string(), nullable=False,
             metadata={"unit": "", "doc": "the change it ends ('*': every change of its scope); '' for a setting change"}),
    pa.field("from_step", pa.int64(), nullable=False,
             metadata={"unit": "step", "doc": "the job's first step it covers on every rank (sampling, profiling); "
                                              "0: each rank from its next step end (the fleet, --force, a clear)"}),
], metadata={b"stragglerscope.kind": b"control_change"})
"""Every run-time change the pipeline read from the control topic: the audit of who changed what, when, until when."""

OPTYPE_WASTE = pa.schema(
    [OPTYPE_SLOWDOWN.field(n) for n in ("job_id", "attempt", "window_id", "optype", "slowdown")]
    + [WINDOW.field(n) for n in ("analyzed_ns", "team", "model", "n_gpus", "gpu_hours")]
    + [pa.field("wasted_gpu_hours", pa.float64(), nullable=False,
                metadata={"unit": "GPU-h", "doc": "gpu_hours x (1 - 1/S_t), at least 0"})]
)
"""Op-type S_t of a window with the window's GPU-hours and owner, and what that op type wasted.

A join of op-type rows with windows at query time takes seconds at a year of
fleet; the analysis writes these rows with their window (``analyzers.window.optype_waste``).
"""


GPU_SAMPLE = _schema(
    "gpu_sample",
    "A rank's GPU as its heartbeats reported it (NVML), at most one row a minute per rank.",
    [
        _JOB,
        _ATTEMPT,
        _RANK,
        _f("host", pa.string(), "", "host the rank ran on"),
        _f("ts_ns", pa.int64(), "ns", "the heartbeat's time, job clock"),
        _f("sm_mhz", pa.int32(), "MHz", "SM clock"),
        _f("mem_mhz", pa.int32(), "MHz", "memory clock"),
        _f("power_w", pa.float64(), "W", "power draw"),
        _f("power_limit_w", pa.float64(), "W", "enforced power limit"),
        _f("temp_c", pa.int32(), "C", "temperature"),
        _f("throttle", pa.string(), "", "what holds the clock down, comma-separated; '' if nothing"),
        _f("ecc_uncorrected", pa.int64(), "", "uncorrected ECC errors since the driver loaded; -1 unknown"),
        _f("pcie_replays", pa.int64(), "", "PCIe replays; -1 unknown"),
    ],
)

WINDOW_PROFILE = _schema(
    "window_profile",
    "Where one window's time went, per op type and per worker: the job's history its regressions are found in.",
    [
        _JOB,
        _ATTEMPT,
        _WINDOW,
        _f("first_step", pa.int64(), "", "first step of the window"),
        _f("end_ns", pa.int64(), "ns", "end of the window's last op, job clock"),
        _f("dp_rank", pa.int32(), "", "the worker's DP rank; -1: the job as a whole"),
        _f("pp_rank", pa.int32(), "", "the worker's PP rank; -1: the job as a whole"),
        _f("rank", pa.int32(), "", "the global rank that reported the worker's op spans; -1: the job"),
        _f("optype", pa.string(), "",
           "op type; 'step' is the step time (the job's: the mean actual step; a worker's: its ops' time)"),
        _f("seconds", pa.float64(), "s", "time per step: of this op type, summed over a worker's ops and "
                                          "averaged over the workers and steps (-1, -1), or the step time"),
    ],
)

REGRESSION = _schema(
    "regression",
    "A job slower (or back to its speed) against its own past: a change point of its step time and what moved.",
    [
        _JOB,
        _f("kind", pa.string(), "", "regression | recovered | degraded_worker"),
        _f("attempt", pa.int32(), "", "the attempt of the window that confirmed it"),
        _f("window_id", pa.int64(), "", "the window that confirmed it"),
        _f("began_window", pa.int64(), "", "the first window of the change"),
        _f("began_step", pa.int64(), "", "the first step of that window"),
        _f("change", pa.float64(), "ratio", "step time after / before - 1 (a worker's over its own best)"),
        _f("before_s", pa.float64(), "s", "step time before (the baseline; a worker's best)"),
        _f("after_s", pa.float64(), "s", "step time after"),
        _f("optypes_json", pa.string(), "", "op type -> its share of the change, JSON"),
        _f("scope", pa.string(), "", "'every worker', the workers that moved, or the degraded worker"),
        _f("summary", pa.string(), "", "the finding in one sentence with its figures"),
        _f("found_ns", pa.int64(), "ns", "wall-clock time the pipeline found it"),
    ],
)

RANK_HOST = _schema(
    "rank_host",
    "Where a rank of a job attempt ran, as its heartbeats said: what maps a finding about a rank to a machine.",
    [
        _JOB,
        _ATTEMPT,
        _RANK,
        _HOST,
        _f("seen_ns", pa.int64(), "ns", "the first heartbeat from that rank on that host, job clock"),
    ],
)

LEMON_HOST = _schema(
    "lemon_host",
    "A host implicated across jobs (slow worker, hang, node loss, degraded worker), weighed by what it ran.",
    [
        _f("host", pa.string(), "", "host name, as the ranks' heartbeats give it"),
        _f("scored_ns", pa.int64(), "ns", "wall-clock time of the scoring pass this row belongs to"),
        _f("period_s", pa.float64(), "s", "the period the scoring looked back over"),
        _f("label", pa.string(), "", "its rack or switch from the topology file; '' if none"),
        _f("jobs", pa.int32(), "", "distinct job attempts that implicated it"),
        _f("incidents", pa.int32(), "", "implications in all"),
        _f("gpu_hours", pa.float64(), "GPU-h", "what it ran in the period, in any job (its exposure)"),
        _f("expected_jobs", pa.float64(), "", "implicating jobs expected at the fleet's rate for its exposure"),
        _f("p_value", pa.float64(), "", "chance of that many jobs or more at the fleet's rate (Poisson)"),
        _f("lemon", pa.bool_(), "", "at least lemons.min_jobs jobs and a p-value of at most lemons.max_p"),
        _f("evidence_json", pa.string(), "", "the latest implications: job, attempt, kind, time, what; JSON"),
    ],
)

STORED_INF = 1e30
"""How a REMEDY row stores an infinite gain or step time (Arrow and ClickHouse hold it; JSON would not)."""

INPUT_SCHEMAS: dict[str, pa.Schema] = {
    s.metadata[b"stragglerscope.kind"].decode(): s
    for s in (OP_SPAN, CCL_RECORD, HEARTBEAT, JOB, CHECKPOINT, TCP_FLOW, PORT_COUNTER)
}
RESULT_SCHEMAS: dict[str, pa.Schema] = {
    s.metadata[b"stragglerscope.kind"].decode(): s
    for s in (WINDOW, OPTYPE_SLOWDOWN, WORKER_SLOWDOWN, STEP_SLOWDOWN, HANG, LINK_FAULT, LINK_CELL, ALERT,
              DEAD_LETTER, DOWNTIME, REMEDY, GPU_SAMPLE, WINDOW_PROFILE, REGRESSION, RANK_HOST,
              LEMON_HOST)
}
ALL_SCHEMAS: dict[str, pa.Schema] = {**INPUT_SCHEMAS, **RESULT_SCHEMAS}


def kind_of(schema: pa.Schema) -> str:
    return (schema.metadata or {}).get(b"stragglerscope.kind", b"").decode()


def unit_of(schema: pa.Schema, name: str) -> str:
    md = schema.field(name).metadata or {}
    return md.get(b"unit", b"").decode()
