"""One window in, every result table of it out, in its final form: the unit of work the shards run as Ray tasks.

``analyze_window`` builds each table once, here: the window row (GPU-hours,
waste, main verdict and MFU, each with one definition), its per-step,
per-worker and per-op-type slowdowns, the op-type waste rows, its profile,
link cells and faults, remedies. What the shard knows of the job beyond the
window's records comes in as a ``WindowContext`` (its ranks' latest GPU
samples, what its window before found) and is part of the findings before any
table is built: a slow worker's verdict says what its GPUs show, a link
finding is weighed by the window before, and the remedies see both.
``ray_jobs`` only dispatches it and the store only stores what it returns. It is a plain function (no Ray inside) so it runs
in unit tests as is; the shard wraps it with ``ray.remote``. It never raises for bad data:
an analysis that fails yields a window row with ``verdict = "analysis_failed"``
and the reason in ``note``, so the window is stored, its offsets advance and
the failure is visible in the console instead of being retried forever.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analyzers.clock_skew import worker_clock_skew
from analyzers.hardware import with_hardware_evidence
from analyzers.recovery_basis import RecoveryBasis
from analyzers.mfu import window_mfu
from core import codec, jsonutil
from core import schema as S
from core.registration import Registration

if TYPE_CHECKING:  # imported where a window needs them, not by the shard
    from analyzers.links.history import Prior

log = logging.getLogger(__name__)


def _window_row(job: Registration, key, ops: pa.Table, complete: bool, note: str) -> dict:
    if "start_ns" in ops.column_names:
        starts = ops["start_ns"].to_numpy()
        ends = starts + ops["duration_ns"].to_numpy()
    else:  # CCL records only
        starts, ends = ops["enter_ns"].to_numpy(), ops["exit_ns"].to_numpy()
    steps = ops["step"].to_numpy()
    if len(steps) == 0:
        starts = ends = steps = np.zeros(1, np.int64)
    return dict(
        job_id=key[0], attempt=key[1], window_id=key[2],
        first_step=int(steps.min()), last_step=int(steps.max()), n_steps=int(len(np.unique(steps))),
        start_ns=int(starts.min()), end_ns=int(ends.max()), analyzed_ns=time.time_ns(),
        team=job.team, model=job.model, n_gpus=int(job.n_gpus or job.layout.world_size),
        dp_size=job.layout.dp_size, pp_size=job.layout.pp_size,
        slowdown=float("nan"), launch_slowdown=float("nan"), waste_fraction=float("nan"),
        step_time_actual=float("nan"), step_time_sim=float("nan"), step_time_ideal=float("nan"),
        gpu_hours=0.0, wasted_gpu_hours=0.0, m_w=float("nan"), m_s=float("nan"),
        verdict="", verdicts_json="[]", complete=complete, note=note, n_ops=ops.num_rows,
        mfu=float("nan"), mfu_ideal=float("nan"),
    )


_FLOPS_FIELDS = ("flops_per_token", "params", "tokens_per_step", "peak_flops", "gpu_type")


def _flops_info(job: Registration, n_gpus: int) -> dict:
    """The registration's FLOPs fields (its JOB row); absent ones are 0, which makes the MFU NaN."""
    src = job.registration or {}
    return {**{k: src.get(k, 0) for k in _FLOPS_FIELDS}, "n_gpus": n_gpus}


@dataclasses.dataclass(frozen=True)
class WindowContext:
    """What the shard knows of a window's job beyond the window's own records."""
    gpu_samples: Mapping[int, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """Rank -> its latest GPU sample (``ray_jobs.hang_monitor.HangReducer.gpu_of``): a slow worker's GPUs are
    compared with their peers' (``analyzers.hardware``)."""
    prior: Prior | None = None
    """What the job's latest analysed window before this one found (``analyzers.links.history``); None: none
    was, and every link finding is a first sighting."""
    rank_hosts: Mapping[int, str] = dataclasses.field(default_factory=dict)
    """Rank -> the host it runs on (its heartbeats)."""
    port_rows: tuple[Mapping[str, Any], ...] = ()
    """The fabric port counters of the job's hosts around the window (PORT_COUNTER rows): a link finding on a
    host whose port waited or erred says so (``analyzers.fabric``)."""


@dataclasses.dataclass(frozen=True)
class WindowResult:
    """A window's analysis as the shard gets it back: the tables to store, and what it keeps of the job."""
    tables: dict[str, pa.Table]
    recovery: RecoveryBasis | None = None
    """What a recovery plan needs of this window (``analyzers.remedies.advise``), when it was analysed whole: the
    plan a node loss of the job is paged with is made from the job's latest."""


def analyze_window(ops: pa.Table, job: Registration, key: tuple[str, int, int], complete: bool,
                   note: str, ccl: pa.Table | None = None, tcp: pa.Table | None = None,
                   context: WindowContext | None = None) -> dict[str, pa.Table]:
    """What-if analysis and link diagnosis of one window; returns {result kind: table} for the sink.

    ``ccl``: the window's collective records; ``tcp``: its ranks' TCP connection counters (TCP_FLOW);
    ``context``: what the shard knows of the job (None: the window alone, as analysed offline: link findings
    at their window's confidence, no hardware evidence)."""
    return analyze_window_for_shard(ops, job, key, complete, note, ccl, tcp, context).tables


def analyze_window_for_shard(ops: pa.Table, job: Registration, key: tuple[str, int, int], complete: bool,
                             note: str, ccl: pa.Table | None = None, tcp: pa.Table | None = None,
                             context: WindowContext | None = None) -> WindowResult:
    """``analyze_window`` with what the shard keeps of the job besides the tables (the Ray task's function)."""
    links = _links(ccl, key, tcp, context)
    if ops.num_rows == 0:
        row = _window_row(job, key, ccl if ccl is not None else ops, complete, note)
        row["verdict"] = "no_op_spans"
        row["complete"] = False
        row["n_ops"] = 0
        row["note"] = (note + "; " if note else "") + "no op spans in this window: link diagnosis only"
        return WindowResult(_tables(row, links))
    # heavy imports kept out of the shard's import path
    from analyzers.whatif import analyze
    from analyzers.whatif.tables import step_times, to_tables, window_fields

    row = _window_row(job, key, ops, complete, note)
    conflict = layout_conflict(job, ops)
    if conflict:
        # The ranks' coordinates contradict each other (two ranks claiming one worker, ...): analysed, such
        # spans make a dependency cycle or a wrong answer. Flag the window with what is wrong, S NaN, out of
        # fleet statistics, as for clock skew.
        row["verdict"] = "layout_conflict"
        row["complete"] = False
        row["note"] = (f"layout conflict: {conflict}; window not analysed, left out of fleet statistics"
                       + ("; " + note if note else ""))[:4000]
        return WindowResult(_tables(row, links))
    skew = worker_clock_skew(ops)
    if skew is not None:
        # Some workers' clocks are hours off: their spans would stretch the window, and the GPU-hours and
        # the slowdown with it. Flag the window and keep it out of fleet statistics (S stays NaN).
        row["verdict"] = "clock_skew"
        row["complete"] = False
        row["note"] = ((note + "; " if note else "") + f"clock skew: {skew.describe()} (more than "
                       f"{skew.threshold_s:.1f} s): window not analysed, left out of fleet statistics")
        return WindowResult(_tables(row, links))
    try:
        result = analyze(ops, job.layout, allow_incomplete=True, n_gpus=row["n_gpus"])
    except Exception as e:  # analyzer input errors and bugs alike: store, flag, move on
        log.warning("analysis of %s failed: %s", key, e)
        row["verdict"] = "analysis_failed"
        row["note"] = (note + "; " if note else "") + f"{type(e).__name__}: {e}"[:2000]
        row["complete"] = False
        return WindowResult(_tables(row, links))

    what = window_fields(result)
    verdicts, warnings = what.pop("verdicts"), what.pop("warnings")
    if context is not None and context.gpu_samples:
        try:
            verdicts = with_hardware_evidence(verdicts, ops, context.gpu_samples)
        except Exception as e:  # evidence is a bonus: the window is stored without it
            log.warning("hardware evidence for %s failed: %s", key, e)
    what["complete"] = row["complete"] and what["complete"]
    row.update(
        what, gpu_hours=result.gpu_hours, wasted_gpu_hours=result.wasted_gpu_hours,  # one definition: the what-if's
        verdict=result.verdict, verdicts_json=jsonutil.dumps(verdicts),
        note="; ".join([x for x in [note] + warnings if x])[:4000],
    )
    times = step_times(result)
    steps = sorted(times["actual"])
    row["mfu"], row["mfu_ideal"] = window_mfu(_flops_info(job, row["n_gpus"]), steps,
                                              [times["actual"][s] for s in steps],
                                              [times["ideal"].get(s, float("nan")) for s in steps])
    out = to_tables(result, key)
    out["window_profile"] = window_profile(ops, row, typical_step_s(times["actual"]))
    if verdicts or links["link_fault"].num_rows:
        remedies = _remedies(ops, job, result, links["link_fault"], key)
        if remedies is not None:
            out["remedy"] = remedies
    whole = row["complete"] and not result.missing_workers
    recovery = _recovery_basis(job, result, times["simulated"], key) if whole else None
    return WindowResult(_tables(row, links, out), recovery)


def typical_step_s(actual: dict[int, float]) -> float:
    """A window's step time in the job's history: the median of its steps. The first steps after a change
    carry one-off costs (a bigger all-reduce's buffers allocated, a warm-up, a checkpoint): in their mean,
    one 2.5x step in a window of four made a +25% regression read +60% (tests/autotrace/test_trace_regression)."""
    v = [t for t in actual.values() if t == t and t > 0]
    return float(np.median(v)) if v else float("nan")


def window_profile(ops: pa.Table, row: dict, step_s: float | None = None) -> pa.Table:
    """Where the window's time went (WINDOW_PROFILE): the job's step time (``step_s``, else the window's mean
    actual step time), each op type's time per step
    (summed over a worker's ops, averaged over workers and steps) and each worker's ops' time per step.

    The history a job's regressions are found in (``ray_jobs.regressions``): a step that got slower says
    which op types and which workers took the extra time. Only for an analysed window (its step time is
    the what-if's actual one).
    """
    if step_s is None or not step_s == step_s:
        step_s = row["step_time_actual"]
    if ops.num_rows == 0 or not step_s == step_s:
        return codec.empty(S.WINDOW_PROFILE)
    dp = ops["dp_rank"].to_numpy().astype(np.int64)
    pp = ops["pp_rank"].to_numpy().astype(np.int64)
    step = ops["step"].to_numpy()
    dur = ops["duration_ns"].to_numpy().astype(np.float64) / 1e9
    optype = np.asarray(ops["optype"].to_pylist(), dtype=object)
    worker = dp * (int(pp.max()) + 1) + pp
    workers, w_idx = np.unique(worker, return_inverse=True)
    n_steps = max(1, len(np.unique(step)))
    base = dict(job_id=row["job_id"], attempt=row["attempt"], window_id=row["window_id"],
                first_step=row["first_step"], end_ns=row["end_ns"])
    rows = [dict(base, dp_rank=-1, pp_rank=-1, rank=-1, optype="step", seconds=float(step_s))]
    names, o_idx = np.unique(optype, return_inverse=True)
    per_type = np.bincount(o_idx, weights=dur, minlength=len(names)) / (len(workers) * n_steps)
    rows += [dict(base, dp_rank=-1, pp_rank=-1, rank=-1, optype=str(n), seconds=float(t))
             for n, t in zip(names, per_type)]
    per_worker = np.bincount(w_idx, weights=dur, minlength=len(workers))
    ranks = ops["rank"].to_numpy()
    for i, w in enumerate(workers):
        mine = w_idx == i
        steps_w = max(1, len(np.unique(step[mine])))
        d, p = divmod(int(w), int(pp.max()) + 1)
        rows.append(dict(base, dp_rank=d, pp_rank=p, rank=int(ranks[mine].min()), optype="step",
                         seconds=float(per_worker[i] / steps_w)))
    return codec.from_rows(S.WINDOW_PROFILE, rows)


def layout_conflict(job: Registration, ops: pa.Table) -> str:
    """What contradicts the job's layout, or "": the registration's ``layout_problem`` (what the traced ranks
    found when they compared their claims), else two ranks sending op spans as one worker in these ops (an
    exporter that registered none, or an older one)."""
    problem = str((job.registration or {}).get("layout_problem") or "")
    if problem:
        return problem
    if ops.num_rows == 0 or "rank" not in ops.column_names:
        return ""
    rank = ops["rank"].to_numpy()
    keep = rank >= 0  # replays and imports without a rank say nothing here
    if not keep.any():
        return ""
    worker = (ops["dp_rank"].to_numpy()[keep].astype(np.int64) << 32) | ops["pp_rank"].to_numpy()[keep].astype(
        np.int64)
    pairs = np.unique(np.stack([worker, rank[keep].astype(np.int64)]), axis=1)
    workers, counts = np.unique(pairs[0], return_counts=True)
    shared = workers[counts > 1]
    if not len(shared):
        return ""
    w = int(shared[0])
    ranks = pairs[1][pairs[0] == w].tolist()
    more = f" (and {len(shared) - 1} more worker{'s' if len(shared) > 2 else ''})" if len(shared) > 1 else ""
    return f"ranks {', '.join(map(str, ranks))} all sent op spans as worker dp {w >> 32}, pp {w & 0xFFFFFFFF}{more}"


def _facts(job: Registration):
    """What the remedies know of the job beyond its trace: its layout and layer count."""
    from analyzers.remedies import JobFacts

    reg = job.registration or {}
    return JobFacts(layout=job.layout, num_layers=int(reg.get("num_layers") or 0) or None)


def _remedies(ops: pa.Table, job: Registration, result, links: pa.Table, key) -> pa.Table | None:
    """REMEDY rows of a window with a verdict or a link fault; never costs the window its result."""
    from analyzers.remedies import advise, to_tables

    try:
        return to_tables(advise(ops, _facts(job), result, links.to_pylist()), key, time.time_ns())["remedy"]
    except Exception as e:
        log.warning("remedies of %s failed: %s", key, e)
        return None


def _recovery_basis(job: Registration, result, simulated: dict[int, float], key) -> RecoveryBasis | None:
    """What a recovery plan needs of this window (its simulated step time calibrates the plan, as ``advise``
    does); never costs the window its result."""
    from analyzers.remedies.advise import recovery_basis
    from analyzers.remedies.resim import TraceCells

    steps = [t for t in simulated.values() if t == t and t > 0]
    if not steps:
        return None
    try:
        return recovery_basis(TraceCells(result), _facts(job), float(np.mean(steps)))
    except Exception as e:
        log.warning("the recovery basis of %s failed: %s", key, e)
        return None


def failed_window(ops: pa.Table, job: Registration, key: tuple[str, int, int], reason: str) -> dict[str, pa.Table]:
    """The tables of a window whose analysis could not run at all."""
    row = _window_row(job, key, ops, False, reason[:2000])
    row["verdict"] = "analysis_failed"
    return _tables(row)


def _links(ccl: pa.Table | None, key, tcp: pa.Table | None = None,
           context: WindowContext | None = None) -> dict[str, pa.Table]:
    """Link diagnosis of the window's CCL and TCP records (LINK_FAULT and LINK_CELL rows), its findings weighed
    by the window before where the context says what that found; never raises."""
    empty = {"link_fault": codec.empty(S.LINK_FAULT), "link_cell": codec.empty(S.LINK_CELL)}
    if (ccl is None or ccl.num_rows == 0) and (tcp is None or tcp.num_rows == 0):
        return empty
    from analyzers.links import diagnose_window, to_tables
    from analyzers.links.history import weigh

    try:
        d = diagnose_window(ccl if ccl is not None else codec.empty(S.CCL_RECORD), tcp=tcp)
        if context is not None:
            faults = weigh(d.faults, context.prior)
            if context.port_rows and faults:
                from analyzers.fabric import with_fabric_evidence

                start, end = records_span(ccl, tcp)
                faults = with_fabric_evidence(faults, context.port_rows, context.rank_hosts, start, end)
            d = dataclasses.replace(d, faults=faults)
        return to_tables(d, key)
    except Exception as e:  # bad records must not cost the window its what-if result
        log.warning("link diagnosis of %s failed: %s", key, e)
        return empty


def records_span(ccl: pa.Table | None, tcp: pa.Table | None) -> tuple[int | None, int | None]:
    """The time the window's collective records cover (enter to exit), which its ports' counters are read over;
    (None, None) where only TCP counters came."""
    if ccl is None or ccl.num_rows == 0:
        return None, None
    return int(pc.min(ccl["enter_ns"]).as_py()), int(pc.max(ccl["exit_ns"]).as_py())


_ALWAYS = {"optype_slowdown": S.OPTYPE_SLOWDOWN, "worker_slowdown": S.WORKER_SLOWDOWN,
           "step_slowdown": S.STEP_SLOWDOWN, "window_profile": S.WINDOW_PROFILE}
"""The what-if's tables: every window has them, empty where the analysis did not run."""


def optype_waste(row: dict, optypes: pa.Table) -> pa.Table:
    """OPTYPE_WASTE rows of a window: each op type's whole-window S_t (``step`` -1) with the window's GPU-hours
    and owner, and the GPU-hours that op type's stragglers wasted (``wasted_gpu_hours``). The fleet's
    statistics read these rows: a join of op-type rows with windows at query time takes seconds at a year of
    fleet."""
    from analyzers.whatif.gpu_hours import wasted_gpu_hours

    whole = optypes.filter(pc.equal(optypes["step"], -1)).to_pylist()  # not the per-step rows
    owner = {k: row[k] for k in ("analyzed_ns", "team", "model", "n_gpus", "gpu_hours")}
    return codec.from_rows(S.OPTYPE_WASTE, [
        dict(owner, job_id=r["job_id"], attempt=r["attempt"], window_id=r["window_id"], optype=r["optype"],
             slowdown=r["slowdown"], wasted_gpu_hours=wasted_gpu_hours(row["gpu_hours"], r["slowdown"]))
        for r in whole])


def _tables(row: dict, links: dict[str, pa.Table] | None = None,
            out: dict[str, pa.Table] | None = None) -> dict[str, pa.Table]:
    """The window's row and the analyzers' tables (``to_tables``) for the sink; a remedy table only with rows."""
    out = out or {}
    tables = {"window": codec.from_rows(S.WINDOW, [row])}
    for kind, schema in (("link_fault", S.LINK_FAULT), ("link_cell", S.LINK_CELL)):
        tables[kind] = (links or {}).get(kind, codec.empty(schema))
    for kind, schema in _ALWAYS.items():
        tables[kind] = out.get(kind, codec.empty(schema))
    tables["optype_waste"] = optype_waste(row, tables["optype_slowdown"])
    if "remedy" in out and out["remedy"].num_rows:
        tables["remedy"] = out["remedy"]
    return tables
