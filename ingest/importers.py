"""Importers: existing trace formats to our records.

- ``golden``: the what-if paper's trace format (parquet + meta YAML), read by
  ``core.golden``, to OP_SPAN.
- ``kineto``: PyTorch profiler Chrome-trace JSON (``.json`` or ``.json.gz``)
  to OP_SPAN. Ops are the ``record_function`` annotations whose names are
  op types of the what-if model (``forward-compute``, ``forward-send``...);
  the step of an op is the ``ProfilerStep#N`` it falls in. The rank comes
  from the trace's ``distributedInfo`` (or ``rank=``); the worker
  coordinates follow Megatron's rank order (TP fastest, then CP, DP, PP):
  ``rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp``.
- ``flight-recorder``: PyTorch Flight Recorder dumps (pickle or JSON, as
  written by ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` or ``_dump_fr_trace``) to
  CCL_RECORD: one record per entry, the group from the dump's process-group
  table, the sequence number per group (collective or p2p), bytes from the
  input sizes and dtypes, and the state: an entry that never completed has
  ``exit_ns = -1``, which is what the hang detector reads.

Every importer raises ``ImportFormatError`` (a ValueError) with a one-line
reason for input it cannot read; it never returns partial garbage silently.
"""
from __future__ import annotations

import gzip
import io
import json
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from core import codec, optypes
from core import schema as S
from core.golden import load_golden
from core.layout import JobLayout

FORMATS = ("golden", "kineto", "flight-recorder")
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
                "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "ComplexFloat": 8}


class ImportFormatError(ValueError):
    """Input an importer cannot read; the message says what and where."""


def worker_of(rank: int, layout: JobLayout) -> tuple[int, int]:
    """(dp_rank, pp_rank) of a global rank in Megatron's order (TP, CP, DP, PP from fastest)."""
    per_worker = layout.tp_size * layout.cp_size
    w = rank // per_worker
    return w % layout.dp_size, w // layout.dp_size


# -- kineto -------------------------------------------------------------------
def _read_json(path: str | Path) -> Any:
    p = Path(path)
    try:
        raw = p.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return json.loads(raw)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ImportFormatError(f"{p}: not readable JSON: {e}") from None


def kineto_to_ops(path: str | Path, job_id: str, layout: JobLayout, rank: int | None = None,
                  window_id: int | None = None) -> pa.Table:
    trace = _read_json(path)
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ImportFormatError(f"{path}: no traceEvents: not a Chrome/Kineto trace")
    if rank is None:
        rank = int((trace.get("distributedInfo") or {}).get("rank", -1))
        if rank < 0:
            raise ImportFormatError(f"{path}: no distributedInfo.rank in the trace; give rank=")
    dp, pp = worker_of(rank, layout)
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), int(m.group(1)))
                   for e in events if (m := re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name", "")))))
    ops = [e for e in events if e.get("name") in optypes.OPTYPES and str(e.get("cat", "")).endswith("user_annotation")]
    if not ops:
        raise ImportFormatError(f"{path}: no record_function annotations named after op types "
                                f"({', '.join(optypes.OPTYPES[:3])}, ...)")
    rows = []
    seq: dict[tuple[int, str], int] = {}
    for e in sorted(ops, key=lambda e: float(e["ts"])):
        ts = float(e["ts"])
        step = next((s for a, b, s in steps if a <= ts <= b), -1)
        if step < 0:
            continue  # outside any profiled step
        k = (step, e["name"])
        seq[k] = seq.get(k, -1) + 1
        args = e.get("args") or {}
        rows.append(dict(
            job_id=job_id, attempt=0, rank=rank, dp_rank=dp, pp_rank=pp,
            window_id=window_id if window_id is not None else (steps[0][2] if steps else 0), step=step,
            optype=e["name"], start_ns=int(round(ts * 1000)), duration_ns=int(round(float(e.get("dur", 0)) * 1000)),
            seq_id=seq[k], mc=int(args.get("mc", 0)), gmc=int(args.get("gmc", pp)), mb_id=int(args.get("mb_id", -1)),
        ))
    if not rows:
        raise ImportFormatError(f"{path}: annotations found but none inside a ProfilerStep")
    return codec.from_rows(S.OP_SPAN, rows)


# -- flight recorder ----------------------------------------------------------
class _SafeUnpickler(pickle.Unpickler):
    """Flight Recorder dumps hold only builtins: refuse anything that would import code."""

    def find_class(self, module, name):
        raise ImportFormatError(f"refusing to unpickle {module}.{name}: not a plain Flight Recorder dump")


def _read_fr(path: str | Path) -> dict:
    raw = Path(path).read_bytes()
    if raw[:1] == b"{":
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ImportFormatError(f"{path}: bad JSON: {e}") from None
    try:
        data = _SafeUnpickler(io.BytesIO(raw)).load()
    except ImportFormatError:
        raise
    except Exception as e:
        raise ImportFormatError(f"{path}: neither JSON nor a Flight Recorder pickle: {e}") from None
    if not isinstance(data, dict) or "entries" not in data:
        raise ImportFormatError(f"{path}: no 'entries': not a Flight Recorder dump")
    return data


def _ranks_of(pg_config: dict, name: str) -> list[int]:
    cfg = pg_config.get(name) or {}
    ranks = cfg.get("ranks", [])
    if isinstance(ranks, str):
        ranks = [int(x) for x in re.findall(r"\d+", ranks)]
    return [int(r) for r in ranks]


def flight_recorder_to_ccl(path: str | Path, job_id: str, rank: int | None = None) -> pa.Table:
    data = _read_fr(path)
    if rank is None:
        rank = data.get("rank")
        if rank is None:
            m = re.search(r"(\d+)(?:\.\w+)?$", Path(path).name)
            if not m:
                raise ImportFormatError(f"{path}: the dump does not say its rank; give rank= or end the name with it")
            rank = int(m.group(1))
    pg_config = data.get("pg_config") or {}
    rows = []
    for e in data["entries"]:
        pg_name, pg_desc = (list(e.get("process_group") or ["", ""]) + ["", ""])[:2]
        group_ranks = _ranks_of(pg_config, pg_name)
        is_p2p = bool(e.get("is_p2p"))
        op = str(e.get("profiling_name", "")).split(":")[-1]
        sizes = e.get("input_sizes") or []
        dtypes = e.get("input_dtypes") or []
        nbytes = sum(int(np.prod(s)) * _DTYPE_BYTES.get(d, 4) for s, d in zip(sizes, dtypes))
        enter = int(e.get("time_discovered_started_ns") or e.get("time_created_ns") or 0)
        # Gloo entries never record a completion time; "retired" means the work finished.
        done = e.get("state") == "completed" or bool(e.get("retired"))
        exit_ns = (int(e.get("time_discovered_completed_ns") or 0) or enter) if done else -1
        group = f"pg:{pg_desc or pg_name}" + (":p2p" if is_p2p else "")
        rows.append(dict(
            job_id=job_id, attempt=0, rank=int(rank), window_id=-1, step=-1, group=group, group_ranks=group_ranks,
            seq=int(e.get("p2p_seq_id" if is_p2p else "collective_seq_id", 0)), op=op, algorithm="",
            nbytes=nbytes, enter_ns=enter, exit_ns=exit_ns,
            # No per-peer timing in Flight Recorder: the members are in group_ranks.
            peers=[], peer_transfer_ns=[], peer_bytes=[], recv_wait_ns=-1,
        ))
    return codec.from_rows(S.CCL_RECORD, rows)


def import_paths(fmt: str, paths: list[str], job_id: str | None = None, layout: JobLayout | None = None,
                 meta: str | None = None, rank: int | None = None) -> list[tuple[str, pa.Table]]:
    """(path, table) for each input path; raises ImportFormatError with a one-line reason."""
    if fmt not in FORMATS:
        raise ImportFormatError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    out = []
    for p in paths:
        if not Path(p).exists():
            raise FileNotFoundError(f"no such file: {p}")
        jid = job_id or Path(p).stem.split(".")[0]
        if fmt == "golden":
            if not meta:
                raise ImportFormatError("golden traces need --meta META.yaml")
            table, _ = load_golden(p, meta)
            if job_id:
                table = table.set_column(table.schema.get_field_index("job_id"), "job_id",
                                         pa.array([job_id] * table.num_rows))
        elif fmt == "kineto":
            if layout is None:
                raise ImportFormatError("kineto traces need the job layout: --dp, --pp (and --tp, --cp)")
            table = kineto_to_ops(p, jid, layout, rank)
        else:
            table = flight_recorder_to_ccl(p, jid, rank)
        out.append((p, table))
    return out
