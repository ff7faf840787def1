"""Chrome/Perfetto trace of the actual and the simulated ideal timelines.

``timeline_table(result_or_inputs)`` has one row per op and scenario;
``trace_document`` is its Trace Event Format JSON, which opens in
ui.perfetto.dev or chrome://tracing (``actions.whatif_files`` writes it).
One process per (scenario, worker), named like
``actual dp0/pp1`` or ``ideal dp0/pp1``; one thread per stream (compute,
dp-comm, forward-recv, ...). Times are microseconds on the job clock; the
ideal timeline of a step starts where the actual step started. A
communication op is drawn from its start to its end, waiting included.

At most ``max_ops`` ops per scenario are written (whole steps, earliest
first), so a huge window still gives a file a browser can open.
"""
from __future__ import annotations

import json
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


SCENARIOS = ("actual", "ideal")
"""The scenarios of a timeline: the trace itself (delays kept), and the simulated ideal."""


def timeline_table(result_or_inputs: Any, *, max_ops: int = MAX_OPS) -> pa.Table:
    """One row per op and scenario: ``scenario`` (``SCENARIOS``), the worker (``dp_rank``, ``pp_rank``), its
    ``stream`` (``opcodes.STREAM_NAMES``), ``optype``, ``step``, and ``start_us`` and ``end_us`` on the job
    clock (the ideal step starts where the actual one did). At most ``max_ops`` ops per scenario, whole
    steps, earliest first."""
    return _table(*_inputs(result_or_inputs), max_ops)


_TABLE_COLUMNS = ("scenario", "dp_rank", "pp_rank", "stream", "optype", "step", "start_us", "end_us")


def _table(p, run, max_ops: int | None) -> pa.Table:
    parts: list[dict[str, np.ndarray]] = []
    for rows, code, dp, pp, sims in _simulated(p, run, (False, True), (True, False), max_ops):
        base = p.step_start_ns[p.step_idx[rows]].astype(np.float64)
        for si in range(len(SCENARIOS)):
            if si == 0:  # the trace itself
                st = p.start[rows].astype(np.float64)
                en = st + p.dur[rows]
            else:
                st, en = sims[si]
            parts.append({"scenario": np.full(len(rows), si, np.int8), "dp_rank": dp.astype(np.int32),
                          "pp_rank": pp.astype(np.int32), "stream": T.STREAM_OF_CODE[code].astype(np.int8),
                          "optype": code.astype(np.int16), "step": p.steps[p.step_idx[rows]].astype(np.int64),
                          "start_us": (base + st) / 1e3, "end_us": (base + np.maximum(en, st)) / 1e3})
    cols = {k: np.concatenate([x[k] for x in parts]) if parts else np.zeros(0) for k in _TABLE_COLUMNS}

    def named(codes: np.ndarray, names) -> pa.Array:
        return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(list(names), pa.string()))

    return pa.table({
        "scenario": named(cols["scenario"], SCENARIOS), "dp_rank": pa.array(cols["dp_rank"].astype(np.int32)),
        "pp_rank": pa.array(cols["pp_rank"].astype(np.int32)), "stream": named(cols["stream"], T.STREAM_NAMES),
        "optype": named(cols["optype"], OPTYPES), "step": pa.array(cols["step"].astype(np.int64)),
        "start_us": pa.array(cols["start_us"].astype(np.float64)),
        "end_us": pa.array(cols["end_us"].astype(np.float64)),
    })


def events_of(table: pa.Table, layout) -> list[dict[str, Any]]:
    """Trace events (Chrome/Perfetto) of a ``timeline_table``: one process per (scenario, worker), named
    like ``actual dp0/pp1``, one thread per stream."""
    scen = table["scenario"].combine_chunks().indices.to_numpy(zero_copy_only=False).astype(np.int64)
    dp = table["dp_rank"].to_numpy().astype(np.int64)
    pp = table["pp_rank"].to_numpy().astype(np.int64)
    pp_size = layout.pp_size
    n_w = layout.dp_size * pp_size
    pid = scen * n_w + dp * pp_size + pp
    tid = table["stream"].combine_chunks().indices.to_numpy(zero_copy_only=False)
    start, end = table["start_us"].to_numpy(), table["end_us"].to_numpy()
    events: list[dict[str, Any]] = [
        {"name": nm, "ph": "X", "ts": round(t, 3), "dur": round(d, 3), "pid": pi, "tid": ti, "args": {"step": sp}}
        for nm, t, d, pi, ti, sp in zip(table["optype"].to_pylist(), start.tolist(), (end - start).tolist(),
                                        pid.tolist(), tid.tolist(), table["step"].to_pylist())]
    for pidv in np.unique(pid).tolist():
        w = pidv % n_w
        events.append({"name": "process_name", "ph": "M", "pid": pidv,
                       "args": {"name": f"{SCENARIOS[pidv // n_w]} dp{w // pp_size}/pp{w % pp_size}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pidv, "args": {"sort_index": pidv}})
        for t, tname in enumerate(T.STREAM_NAMES):
            events.append({"name": "thread_name", "ph": "M", "pid": pidv, "tid": t, "args": {"name": tname}})
    return events


def timeline_events(result_or_inputs: Any, *, max_ops: int = MAX_OPS) -> list[dict[str, Any]]:
    """Trace events (list of dicts) of the actual (delays kept) and ideal timelines."""
    p, run = _inputs(result_or_inputs)
    return events_of(_table(p, run, max_ops), p.layout)


def trace_document(result_or_inputs: Any, *, max_ops: int = MAX_OPS) -> bytes:
    """The Trace Event Format JSON of the timelines (what ui.perfetto.dev and chrome://tracing open)."""
    return document_of(timeline_events(result_or_inputs, max_ops=max_ops))


def document_of(events: list[dict[str, Any]]) -> bytes:
    """Trace events as a Trace Event Format JSON document."""
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")).encode()


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
