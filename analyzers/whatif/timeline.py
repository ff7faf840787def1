"""Chrome/Perfetto trace of the actual and the simulated ideal timelines.

``write_timeline(result_or_inputs, path)`` writes a Trace Event Format JSON
(gzip when ``path`` ends in ``.gz``) that opens in ui.perfetto.dev or
chrome://tracing. One process per (scenario, worker), named like
``actual dp0/pp1`` or ``ideal dp0/pp1``; one thread per stream (compute,
dp-comm, forward-recv, ...). Times are microseconds on the job clock; the
ideal timeline of a step starts where the actual step started. A
communication op is drawn from its start to its end, waiting included.

At most ``max_ops`` ops per scenario are written (whole steps, earliest
first), so a huge window still gives a file a browser can open.
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa

from core.optypes import OPTYPES

from . import opcodes as T
from .simulate import Scenarios, simulate

MAX_OPS = 500_000


def _inputs(result_or_inputs: Any):
    from .api import analyze
    from .load import WhatIfInputError
    from .result import WhatIfResult

    if isinstance(result_or_inputs, WhatIfResult):
        res = result_or_inputs
    else:
        ops, layout = result_or_inputs
        res = analyze(ops, layout)
    if res.model is None:
        raise WhatIfInputError("this WhatIfResult carries no model: re-run analyze on the ops")
    return res.model.prepared, res.model.run


def _simulated(p, run, inverts: tuple[bool, ...], delays: tuple[bool, ...], max_ops: int | None):
    """Yield (rows, code, dp, pp, [(start, end) per scenario]) flattened per graph and batch, whole steps."""
    k = len(inverts)
    cols = Scenarios(tuple(map(str, range(k))), np.zeros(k, int), np.zeros(k, int), np.array(inverts),
                     np.array(delays))
    budget = max_ops if max_ops is not None else sum(g.n * g.batch for g in run.graphs)
    for g, ideal in zip(run.graphs, run.ideal_arrays):
        if budget <= 0:
            return
        b1 = g.batch
        if g.batch > 1:
            b1 = int(min(g.batch, max(1, budget // max(g.n, 1))))
        E, S = simulate(g, ideal, np.zeros((g.n, 5), np.int32), cols, b0=0, b1=b1, want_start=True)
        rows = g.rows(0, b1)
        keep = np.ones(rows.shape, bool)
        if g.batch == 1 and g.n > budget:
            steps = p.step_idx[rows[:, 0]]
            cut = np.sort(steps)[int(budget) - 1]
            keep[:, 0] = steps <= cut
        budget -= int(keep.sum())
        def tiles(a: np.ndarray, rows=rows, keep=keep) -> np.ndarray:
            return np.broadcast_to(a[:, None], rows.shape)[keep]

        out = []
        for j in range(k):
            out.append((S[:, :, j][keep], E[1:, :, j][keep]))
        yield rows[keep], tiles(g.code), tiles(g.dp), tiles(g.pp), out


def timeline_events(result_or_inputs: Any, *, max_ops: int = MAX_OPS) -> list[dict[str, Any]]:
    """Trace events (list of dicts) of the actual (delays kept) and ideal timelines."""
    p, run = _inputs(result_or_inputs)
    lay = p.layout
    n_w = lay.dp_size * lay.pp_size
    events: list[dict[str, Any]] = []
    named: set[int] = set()
    for rows, code, dp, pp, sims in _simulated(p, run, (False, True), (True, False), max_ops):
        base = p.step_start_ns[p.step_idx[rows]].astype(np.float64)
        stream = T.STREAM_OF_CODE[code]
        steps = p.steps[p.step_idx[rows]]
        for si, scen in enumerate(("actual", "ideal")):
            if scen == "actual":  # the trace itself
                st = p.start[rows].astype(np.float64)
                en = st + p.dur[rows]
            else:
                st, en = sims[si]
            pid = si * n_w + dp.astype(np.int64) * lay.pp_size + pp
            ts = (base + st) / 1e3
            du = np.maximum(en - st, 0.0) / 1e3
            names = np.array(OPTYPES, dtype=object)[code]
            events.extend({"name": nm, "ph": "X", "ts": round(t, 3), "dur": round(d, 3), "pid": pi, "tid": ti,
                           "args": {"step": sp}}
                          for nm, t, d, pi, ti, sp in zip(names.tolist(), ts.tolist(), du.tolist(), pid.tolist(),
                                                          stream.tolist(), steps.tolist()))
            for pidv in np.unique(pid).tolist():
                if pidv in named:
                    continue
                named.add(pidv)
                w = pidv - si * n_w
                events.append({"name": "process_name", "ph": "M", "pid": pidv,
                               "args": {"name": f"{scen} dp{w // lay.pp_size}/pp{w % lay.pp_size}"}})
                events.append({"name": "process_sort_index", "ph": "M", "pid": pidv, "args": {"sort_index": pidv}})
                for tid, tname in enumerate(T.STREAM_NAMES):
                    events.append({"name": "thread_name", "ph": "M", "pid": pidv, "tid": tid,
                                   "args": {"name": tname}})
    return events


def write_timeline(result_or_inputs: Any, path: str | os.PathLike, *, max_ops: int = MAX_OPS) -> int:
    """Write the timelines to ``path``; returns the number of events written."""
    from .load import WhatIfInputError

    events = timeline_events(result_or_inputs, max_ops=max_ops)
    doc = {"traceEvents": events, "displayTimeUnit": "ms"}
    data = json.dumps(doc, separators=(",", ":")).encode()
    try:
        if str(path).endswith(".gz"):
            with gzip.open(path, "wb", compresslevel=5) as f:
                f.write(data)
        else:
            with open(path, "wb") as f:
                f.write(data)
    except OSError as e:
        raise WhatIfInputError(f"cannot write {path}: {e.strerror or e}") from None
    return len(events)


def simulated_table(result_or_inputs: Any, scenario: str = "ideal") -> pa.Table:
    """The simulated timeline of ``scenario`` ("ideal" or "simulated", no delays) as OP_SPAN rows.

    Ops get their simulated start and end (waiting included), on the job clock
    (each step starts where the actual step started); identity columns are
    the input's. Sends and recvs the model drops as no-ops are left out.
    """
    from core.schema import OP_SPAN

    p, run = _inputs(result_or_inputs)
    inv = {"ideal": True, "simulated": False}[scenario]
    parts = []
    for r, code, dp, pp, sims in _simulated(p, run, (inv,), (False,), None):
        st = np.rint(sims[0][0]).astype(np.int64)
        en = np.rint(sims[0][1]).astype(np.int64)
        parts.append({
            "dp_rank": dp, "pp_rank": pp, "step": p.steps[p.step_idx[r]], "optype_code": code,
            "start_ns": p.step_start_ns[p.step_idx[r]] + st, "duration_ns": np.maximum(en - st, 0),
            "seq_id": p.seq[r], "mc": p.mc[r], "gmc": p.gmc[r], "mb_id": p.mb[r],
        })
    c = {k: np.concatenate([x[k] for x in parts]) for k in parts[0]}
    n = len(c["start_ns"])
    names = np.array(OPTYPES, dtype=object)
    lay = p.layout
    return pa.table({
        "job_id": pa.array([p.job_id] * n, pa.string()), "attempt": pa.array(np.zeros(n, np.int32)),
        "rank": pa.array(((c["pp_rank"].astype(np.int64) * lay.dp_size + c["dp_rank"])).astype(np.int32)),
        "dp_rank": pa.array(c["dp_rank"].astype(np.int32)), "pp_rank": pa.array(c["pp_rank"].astype(np.int32)),
        "window_id": pa.array(np.full(n, int(p.steps[0]), np.int64)), "step": pa.array(c["step"].astype(np.int64)),
        "optype": pa.array(names[c["optype_code"]], pa.string()), "start_ns": pa.array(c["start_ns"]),
        "duration_ns": pa.array(c["duration_ns"]), "seq_id": pa.array(c["seq_id"].astype(np.int32)),
        "mc": pa.array(c["mc"].astype(np.int16)), "gmc": pa.array(c["gmc"].astype(np.int16)),
        "mb_id": pa.array(c["mb_id"].astype(np.int32)),
    }, schema=OP_SPAN)
