"""The named query library: the questions the console and ``stragglerscope sql`` ask.

Each query is SQL text with ``{name:Type}`` placeholders, its parameters
(type, default, meaning) and a one-line description. The same text runs on
chDB (26.x) and the 18.16 server, so it avoids what 18.16 lacks: no WITH
clauses, no window functions (the CDF is built with arrays), no DateTime64,
JSON functions or Map. Parameters are bound by the engine, never spliced
into the text: chDB binds ``{name:Type}`` itself; for the server each
placeholder becomes a scalar subquery over a one-row external table
``_params`` sent beside the query (see ``storage.params``).

Fleet queries read the deduplicating views (``windows``, ``optype_waste``)
and share these optional filters: ``since``/``until`` (ns since the epoch or
an ISO date, on the analysis wall clock ``analyzed_ns``), ``team``, ``model``,
``min_gpus``, ``job_id``.

The slowdown of a job, S_job, is the total simulated step time over the
total ideal step time of its windows (the paper's S = mean T / mean T_ideal
over all profiled steps), or the mean window S where step times are 0.
"""
from __future__ import annotations

import dataclasses

from storage.params import NS_MAX, ParamSpec


@dataclasses.dataclass(frozen=True)
class NamedQuery:
    name: str
    sql: str
    params: tuple[ParamSpec, ...]
    description: str

    def describe(self) -> str:
        ps = ", ".join(f"{p.name}:{p.type}={'required' if p.default is None else p.default!r}" for p in self.params)
        return f"{self.name}({ps}): {self.description}"


SINCE = ParamSpec("since", "Int64", 0, "from this time (ns since the epoch or ISO date), analysis wall clock", True)
UNTIL = ParamSpec("until", "Int64", NS_MAX, "before this time (ns since the epoch or ISO date)", True)
TEAM = ParamSpec("team", "String", "", "only this team (empty: all)")
MODEL = ParamSpec("model", "String", "", "only this model (empty: all)")
MIN_GPUS = ParamSpec("min_gpus", "Int32", 0, "only jobs with at least this many GPUs")
JOB = ParamSpec("job_id", "String", "", "only this job (empty: all)")
FLEET = (SINCE, UNTIL, TEAM, MODEL, MIN_GPUS, JOB)


def _limit(default: int) -> ParamSpec:
    return ParamSpec("limit", "UInt64", default, "at most this many rows")


# A port's counters summed over its rows; -1 (the port lacks the counter) only where every row lacks it. Summed
# under other names, renamed outside: ClickHouse substitutes an alias that is also a column's name into the
# aggregate itself.
_PORT_COUNTS = ("xmit_wait", "xmit_discards", "rcv_discards", "symbol_errors", "rcv_errors", "link_downed",
                "link_error_recovery", "xmit_bytes", "rcv_bytes")
_PORT_INNER = ", ".join(f"countIf({c} >= 0) AS n_{c}, sumIf({c}, {c} >= 0) AS s_{c}" for c in _PORT_COUNTS) + (
    ", sum(elapsed_ns) AS t_elapsed, max(ts_ns) AS t_last, argMax(state, ts_ns) AS t_state, max(reset) AS t_reset, "
    "count() AS t_samples")
_PORT_OUTER = ", ".join(f"if(n_{c} = 0, -1, s_{c}) AS {c}" for c in _PORT_COUNTS) + (
    ", t_elapsed AS elapsed_ns, t_last AS ts_ns, t_state AS state, t_reset AS reset, t_samples AS samples")


def _job_required() -> ParamSpec:
    return ParamSpec("job_id", "String", None, "the job")


WHERE_FLEET = (
    "analyzed_ns >= {since:Int64} AND analyzed_ns < {until:Int64} "
    "AND ({team:String} = '' OR team = {team:String}) "
    "AND ({model:String} = '' OR model = {model:String}) "
    "AND n_gpus >= {min_gpus:Int32} "
    "AND ({job_id:String} = '' OR job_id = {job_id:String})"
)
# Fleet statistics over windows count analysed windows only: a failed, flagged (clock skew) or
# CCL-only window has S = NaN and 0 GPU-hours, and one of them would turn every mean into NaN.
WHERE_WINDOWS = WHERE_FLEET + " AND isFinite(slowdown)"
JOB_S = ("if(sum(step_time_ideal * n_steps) > 0, sum(step_time_sim * n_steps) / sum(step_time_ideal * n_steps), "
         "avg(slowdown))")
PER_JOB = (f"SELECT job_id, count() AS n_windows, {JOB_S} AS s, sum(gpu_hours) AS gh, "
           f"sum(wasted_gpu_hours) AS wh FROM windows WHERE {WHERE_WINDOWS} GROUP BY job_id")
AGG = ("uniqExact(job_id) AS n_jobs, count() AS n_windows, sum(gpu_hours) AS gh, sum(wasted_gpu_hours) AS wh, "
       "avg(slowdown) AS mean_s")
AGG_OUT = ("n_jobs AS jobs, n_windows AS windows, gh AS gpu_hours, wh AS wasted_gpu_hours, "
           "if(gh > 0, wh / gh, nan) AS waste_share, mean_s AS mean_slowdown")


def _wasted_by(key_expr: str, key: str, order: str = "wh DESC", outer_expr: str = "") -> str:
    """Aggregates per ``key_expr`` (named ``key``); ``outer_expr`` relabels keys after grouping (cheaper)."""
    return (f"SELECT {outer_expr or key} AS {key}, {AGG_OUT} FROM (SELECT {key_expr} AS g, {AGG} FROM windows "
            f"WHERE {WHERE_WINDOWS} GROUP BY g) ORDER BY {order}, {key}")


_QUERIES = [
    NamedQuery(
        "fleet_summary",
        "SELECT count() AS jobs, sum(n_windows) AS windows, if(count() = 0, nan, avg(s)) AS mean_slowdown, "
        "if(count() = 0, nan, quantileExact(0.9)(s)) AS p90_slowdown, sum(wh) AS wasted_gpu_hours, "
        "sum(gh) AS gpu_hours, if(sum(gh) > 0, sum(wh) / sum(gh), nan) AS waste_share, "
        "if(count() = 0, nan, countIf(s >= {threshold:Float64}) / count()) AS straggling_share "
        f"FROM ({PER_JOB})",
        FLEET + (ParamSpec("threshold", "Float64", 1.1, "S_job at or above this counts as straggling"),),
        "jobs analysed, windows, mean and p90 of S_job, wasted GPU-hours, GPU-hours, their ratio, and the "
        "share of jobs with S_job >= threshold (the console's headline in one scan)",
    ),
    NamedQuery(
        "slowdown_cdf",
        # Ranks 1..n when n <= points, else the minimum and `points` evenly spaced ranks: a fleet's
        # 100k jobs would otherwise ship 100k rows to a chart that cannot show them. (range(k) from
        # 0: 18.16 has no two-argument range.)
        "SELECT tupleElement(p, 1) AS slowdown, tupleElement(p, 2) AS share FROM ("
        "SELECT arrayMap(i -> (xs[i], i / length(xs)), if(length(xs) <= {points:UInt64}, arrayEnumerate(xs), "
        "arrayConcat([toUInt64(1)], arrayMap(k -> toUInt64(ceil((k + 1) * length(xs) / {points:UInt64})), "
        "range({points:UInt64}))))) AS ps FROM ("
        f"SELECT arraySort(groupArray(s)) AS xs FROM ({PER_JOB}))) ARRAY JOIN ps AS p",
        FLEET + (ParamSpec("points", "UInt64", 500, "at most this many points (and the minimum)"),),
        "CDF of S_job over jobs (the paper's Figure 3): share of jobs with S_job <= slowdown, sampled at "
        "evenly spaced ranks when there are more jobs than points",
    ),
    NamedQuery(
        "straggling_share",
        "SELECT count() AS jobs, countIf(s >= {threshold:Float64}) AS straggling_jobs, "
        "if(count() = 0, nan, countIf(s >= {threshold:Float64}) / count()) AS share, "
        f"{{threshold:Float64}} AS threshold FROM ({PER_JOB})",
        FLEET + (ParamSpec("threshold", "Float64", 1.1, "S_job at or above this counts as straggling"),),
        "share of jobs whose S_job is at least a threshold (default 1.1)",
    ),
    NamedQuery(
        "waste_share",
        "SELECT gh AS gpu_hours, wh AS wasted_gpu_hours, if(gh > 0, wh / gh, nan) AS share FROM ("
        f"SELECT sum(gpu_hours) AS gh, sum(wasted_gpu_hours) AS wh FROM windows WHERE {WHERE_WINDOWS})",
        FLEET,
        "share of GPU-hours wasted by stragglers (sum W x GPU-hours over GPU-hours)",
    ),
    NamedQuery(
        "wasted_by_day",
        _wasted_by("toDate(toDateTime(intDiv(analyzed_ns, 1000000000), 'UTC'))", "day", order="g", outer_expr="g"),
        FLEET,
        "wasted GPU-hours per UTC day of analysis",
    ),
    NamedQuery("wasted_by_team", _wasted_by("team", "team", outer_expr="g"), FLEET, "wasted GPU-hours per team"),
    NamedQuery("wasted_by_model", _wasted_by("model", "model", outer_expr="g"), FLEET, "wasted GPU-hours per model"),
    NamedQuery(
        "wasted_by_cause",
        _wasted_by("verdict", "cause", outer_expr="if(g = '', 'none', g)"),
        FLEET,
        "wasted GPU-hours per main root cause (window verdict; 'none' without one)",
    ),
    NamedQuery(
        "wasted_by_optype",
        "SELECT optype, n_windows AS windows, wh AS wasted_gpu_hours, mean_s AS mean_slowdown FROM ("
        "SELECT optype, count() AS n_windows, sum(wasted_gpu_hours) AS wh, avg(slowdown) AS mean_s "
        f"FROM optype_waste WHERE {WHERE_FLEET} GROUP BY optype) ORDER BY wh DESC, optype",
        FLEET,
        "GPU-hours wasted per op type: window GPU-hours x (1 - 1/S_t), and the mean S_t",
    ),
    NamedQuery(
        "top_wasting_jobs",
        "SELECT job_id, last_team AS team, last_model AS model, max_gpus AS n_gpus, n_windows AS windows, "
        "gh AS gpu_hours, wh AS wasted_gpu_hours, s AS slowdown, if(gh > 0, wh / gh, nan) AS waste_share FROM ("
        "SELECT job_id, argMax(team, analyzed_ns) AS last_team, argMax(model, analyzed_ns) AS last_model, "
        f"max(n_gpus) AS max_gpus, count() AS n_windows, {JOB_S} AS s, sum(gpu_hours) AS gh, "
        f"sum(wasted_gpu_hours) AS wh FROM windows WHERE {WHERE_WINDOWS} GROUP BY job_id) "
        "ORDER BY wh DESC, job_id LIMIT {limit:UInt64}",
        FLEET + (_limit(20),),
        "jobs that wasted the most GPU-hours, with S_job",
    ),
    NamedQuery(
        "job_windows",
        "SELECT * FROM windows WHERE job_id = {job_id:String} AND analyzed_ns >= {since:Int64} "
        "AND analyzed_ns < {until:Int64} ORDER BY attempt, window_id LIMIT {limit:UInt64}",
        (_job_required(), SINCE, UNTIL, _limit(10_000)),
        "every window of one job: S, W, T, T_ideal, fidelity (launch_slowdown), GPU-hours, verdicts",
    ),
    NamedQuery(
        "job_history",
        # The job page's history charts: a year of windows of one job is tens of thousands of rows, so
        # only the columns a chart draws, not verdicts_json and the notes (job_window has those).
        "SELECT attempt, window_id, analyzed_ns, n_gpus, slowdown, waste_fraction, step_time_actual, "
        "step_time_ideal, mfu, mfu_ideal, verdict, complete FROM windows WHERE job_id = {job_id:String} "
        "AND analyzed_ns >= {since:Int64} AND analyzed_ns < {until:Int64} "
        "ORDER BY attempt, window_id LIMIT {limit:UInt64}",
        (_job_required(), SINCE, UNTIL, _limit(50_000)),
        "one job's windows over time, lean: S, waste, step times (actual, ideal), MFU and the main verdict",
    ),
    NamedQuery(
        "job_window",
        "SELECT * FROM windows WHERE job_id = {job_id:String} AND window_id = {window_id:Int64} "
        "AND attempt = if({attempt:Int32} >= 0, {attempt:Int32}, (SELECT max(attempt) FROM windows "
        "WHERE job_id = {job_id:String} AND window_id = {window_id:Int64})) LIMIT 1",
        (_job_required(), ParamSpec("window_id", "Int64", None, "the window (its first step)"),
         ParamSpec("attempt", "Int32", -1, "the attempt (-1: the latest with this window)")),
        "every column of one window of one job: its verdicts with their evidence and its notes",
    ),
    NamedQuery(
        "job_step_trend",
        "SELECT attempt, window_id, step, actual_s, sim_s, ideal_s, slowdown FROM step_slowdown "
        "WHERE job_id = {job_id:String} AND ({window_id:Int64} < 0 OR window_id = {window_id:Int64}) "
        "ORDER BY attempt, window_id, step LIMIT {limit:UInt64}",
        (_job_required(), ParamSpec("window_id", "Int64", -1, "only this window (-1: all)"), _limit(100_000)),
        "per-step actual, simulated and ideal step times and slowdown of one job",
    ),
    NamedQuery(
        "job_workers",
        "SELECT attempt, dp_rank, pp_rank, s_dp, s_pp, s_w FROM worker_slowdown "
        "WHERE job_id = {job_id:String} AND window_id = {window_id:Int64} AND step = {step:Int64} "
        "AND attempt = if({attempt:Int32} >= 0, {attempt:Int32}, (SELECT max(attempt) FROM worker_slowdown "
        "WHERE job_id = {job_id:String} AND window_id = {window_id:Int64})) ORDER BY pp_rank, dp_rank",
        (_job_required(), ParamSpec("window_id", "Int64", None, "the window (its first step)"),
         ParamSpec("step", "Int64", -1, "one step, or -1 for the whole window"),
         ParamSpec("attempt", "Int32", -1, "the attempt (-1: the latest with this window)")),
        "S_w heatmap cells (dp_rank x pp_rank) of one window of one job",
    ),
    NamedQuery(
        "job_links",
        "SELECT attempt, window_id, group, kind, src, dst, confidence, slowdown, evidence_json FROM link_faults "
        "WHERE job_id = {job_id:String} AND ({window_id:Int64} < 0 OR window_id = {window_id:Int64}) "
        "ORDER BY attempt, window_id, confidence DESC, slowdown DESC LIMIT {limit:UInt64}",
        (_job_required(), ParamSpec("window_id", "Int64", -1, "only this window (-1: all)"), _limit(1_000)),
        "slow links, sources, destinations and late senders found in one job's latency matrices",
    ),
    NamedQuery(
        "job_link_cells",
        "SELECT attempt, group, src, dst, ns_per_byte, median_ns, wait_ns, samples, ratio, status FROM link_cells "
        "WHERE job_id = {job_id:String} AND window_id = {window_id:Int64} "
        "AND attempt = if({attempt:Int32} >= 0, {attempt:Int32}, (SELECT max(attempt) FROM link_cells "
        "WHERE job_id = {job_id:String} AND window_id = {window_id:Int64})) "
        "ORDER BY group, src, dst LIMIT {limit:UInt64}",
        (_job_required(), ParamSpec("window_id", "Int64", None, "the window (its first step)"),
         ParamSpec("attempt", "Int32", -1, "the attempt (-1: the latest with this window)"), _limit(20_000)),
        "every cell of one window's link matrix: p2p pairs, collective members, reported per-peer rates",
    ),
    NamedQuery(
        "job_hangs",
        "SELECT attempt, hang_id, kind, group, seq, op, stuck_ranks, missing_ranks, suspect_hosts, since_ns, "
        "duration_s, evidence_json FROM hangs WHERE job_id = {job_id:String} "
        "ORDER BY hang_id DESC LIMIT {limit:UInt64}",
        (_job_required(), _limit(100)),
        "hangs and node losses of one job, newest first, with wait chain and merged stacks",
    ),
    NamedQuery(
        "gpu_hours_lost",
        # Stragglers (windows) and the fault categories (downtime) side by side, per UTC week (Monday).
        # The fleet filters apply to both; a fault counts in the week it started.
        "SELECT week, cause, sum(gh) AS gpu_hours FROM ("
        "SELECT toMonday(toDate(toDateTime(intDiv(analyzed_ns, 1000000000), 'UTC'))) AS week, "
        "'stragglers' AS cause, sum(wasted_gpu_hours) AS gh FROM windows WHERE " + WHERE_WINDOWS + " GROUP BY week "
        "UNION ALL SELECT week, cause, gh FROM ("
        "SELECT toMonday(toDate(toDateTime(intDiv(fault_start_ns, 1000000000), 'UTC'))) AS week, "
        "sum(detect_gpu_hours) AS d, sum(diagnose_gpu_hours) AS g, sum(isolate_gpu_hours) AS i, "
        "sum(lost_progress_gpu_hours) AS l, sum(reinit_gpu_hours) AS r FROM downtime "
        "WHERE fault_start_ns >= {since:Int64} AND fault_start_ns < {until:Int64} "
        "AND ({team:String} = '' OR team = {team:String}) AND ({model:String} = '' OR model = {model:String}) "
        "AND n_gpus >= {min_gpus:Int32} AND ({job_id:String} = '' OR job_id = {job_id:String}) GROUP BY week) "
        "ARRAY JOIN ['fault: detection', 'fault: diagnosis', 'fault: isolation', 'fault: lost progress', "
        "'fault: re-initialisation'] AS cause, [d, g, i, l, r] AS gh) "
        "GROUP BY week, cause ORDER BY week, cause",
        FLEET,
        "where the GPU-hours went: straggler waste and each fault-downtime category (C4's), per week",
    ),
    NamedQuery(
        "downtime_summary",
        "SELECT n AS incidents, t AS gpu_hours, d AS detect_gpu_hours, g AS diagnose_gpu_hours, "
        "i AS isolate_gpu_hours, l AS lost_progress_gpu_hours, r AS reinit_gpu_hours, "
        "if(t > 0, (d + g) / t, nan) AS detection_share FROM ("
        "SELECT count() AS n, sum(total_gpu_hours) AS t, sum(detect_gpu_hours) AS d, sum(diagnose_gpu_hours) AS g, "
        "sum(isolate_gpu_hours) AS i, sum(lost_progress_gpu_hours) AS l, sum(reinit_gpu_hours) AS r FROM downtime "
        "WHERE fault_start_ns >= {since:Int64} AND fault_start_ns < {until:Int64} "
        "AND ({team:String} = '' OR team = {team:String}) AND ({model:String} = '' OR model = {model:String}) "
        "AND n_gpus >= {min_gpus:Int32} AND ({job_id:String} = '' OR job_id = {job_id:String}))",
        FLEET,
        "fault downtime in C4's categories; detection_share = the part our own detection and diagnosis "
        "latency accounts for",
    ),
    NamedQuery(
        "mfu_distribution",
        # Aggregates get other names inside: ClickHouse aliases would shadow the filtered columns.
        "SELECT job_id, t AS team, m AS model, g AS n_gpus, a AS mfu, i AS mfu_ideal FROM ("
        "SELECT job_id, any(team) AS t, any(model) AS m, max(n_gpus) AS g, "
        "sum(mfu * step_time_actual * n_steps) / sum(step_time_actual * n_steps) AS a, "
        "sum(mfu_ideal * step_time_actual * n_steps) / sum(step_time_actual * n_steps) AS i "
        "FROM windows WHERE " + WHERE_WINDOWS + " AND mfu > 0 AND step_time_actual > 0 "
        "GROUP BY job_id) ORDER BY mfu, job_id LIMIT {limit:UInt64}",
        FLEET + (_limit(100_000),),
        "per job: time-weighted MFU achieved and what the straggler-free ideal would reach (jobs with FLOPs info)",
    ),
    NamedQuery(
        "mfu_histogram",
        # Binned in the store: a fleet's per-job rows would be too many to ship to a chart.
        "SELECT b / {bins:Float64} AS mfu_from, (b + 1) / {bins:Float64} AS mfu_to, countIf(k = 0) AS achieved, "
        "countIf(k = 1) AS without_stragglers FROM (SELECT tupleElement(p, 1) AS k, tupleElement(p, 2) AS b FROM ("
        "SELECT arrayJoin([(0, toInt32(floor(a * {bins:Float64}))), (1, toInt32(floor(i * {bins:Float64})))]) AS p "
        "FROM (SELECT sum(mfu * step_time_actual * n_steps) / sum(step_time_actual * n_steps) AS a, "
        "sum(mfu_ideal * step_time_actual * n_steps) / sum(step_time_actual * n_steps) AS i "
        "FROM windows WHERE " + WHERE_WINDOWS + " AND mfu > 0 AND step_time_actual > 0 GROUP BY job_id))) "
        "GROUP BY b ORDER BY b",
        FLEET + (ParamSpec("bins", "Float64", 50.0, "bins per unit of MFU (50: 2% wide)"),),
        "how many jobs reach each MFU, achieved and without stragglers",
    ),
    NamedQuery(
        "job_downtime",
        "SELECT * FROM downtime WHERE job_id = {job_id:String} ORDER BY fault_start_ns LIMIT {limit:UInt64}",
        (_job_required(), _limit(1000)),
        "fault incidents of one job and what each cost, per category",
    ),
    NamedQuery(
        "job_info",
        "SELECT * FROM jobs WHERE job_id = {job_id:String} "
        "AND ({attempt:Int32} < 0 OR attempt = {attempt:Int32}) ORDER BY attempt DESC LIMIT 1",
        (_job_required(), ParamSpec("attempt", "Int32", -1, "the attempt (-1: the latest)")),
        "the registration (layout, owner, model) of one job attempt",
    ),
    NamedQuery(
        "window_ops",
        "SELECT * FROM op_spans WHERE job_id = {job_id:String} AND attempt = {attempt:Int32} "
        "AND window_id = {window_id:Int64} ORDER BY step, rank, start_ns LIMIT {limit:UInt64}",
        (_job_required(), ParamSpec("attempt", "Int32", 0, "the attempt"),
         ParamSpec("window_id", "Int64", None, "the window (its first step)"), _limit(2_000_000)),
        "raw op spans of one window (kept for small windows, for the timeline drill-down)",
    ),
    NamedQuery(
        "job_span_windows",
        "SELECT attempt, window_id FROM op_spans WHERE job_id = {job_id:String} "
        "AND ({attempt:Int32} < 0 OR attempt = {attempt:Int32}) "
        "GROUP BY attempt, window_id ORDER BY attempt, window_id",
        (_job_required(), ParamSpec("attempt", "Int32", -1, "the attempt (-1: every attempt)")),
        "the windows of one job whose raw op spans are kept (pipeline.keep_op_spans_every_s)",
    ),
    NamedQuery(
        "job_remedies",
        "SELECT attempt, window_id, advised_ns, priority, kind, verdict, action, predicted_gain, "
        "step_time_before_s, step_time_after_s, details_json FROM remedies "
        "WHERE job_id = {job_id:String} AND ({window_id:Int64} < 0 OR window_id = {window_id:Int64}) "
        "AND (attempt, window_id, advised_ns) IN (SELECT attempt, window_id, max(advised_ns) FROM remedies "
        "WHERE job_id = {job_id:String} GROUP BY attempt, window_id) "
        "ORDER BY attempt, window_id, priority LIMIT {limit:UInt64}",
        (_job_required(), ParamSpec("window_id", "Int64", -1, "only this window (-1: all)"), _limit(1000)),
        "the latest advised remedies of a job's windows, best first",
    ),
    NamedQuery(
        "job_regressions",
        "SELECT job_id, kind, attempt, window_id, began_window, began_step, change, before_s, after_s, scope, "
        "summary, optypes_json, found_ns FROM regressions "
        "WHERE found_ns >= {since:Int64} AND found_ns < {until:Int64} "
        "AND ({job_id:String} = '' OR job_id = {job_id:String}) AND ({kind:String} = '' OR kind = {kind:String}) "
        "ORDER BY found_ns DESC, job_id, kind, scope LIMIT {limit:UInt64}",
        (SINCE, UNTIL, JOB, ParamSpec("kind", "String", "", "regression, recovered or degraded_worker (empty: all)"),
         _limit(1000)),
        "jobs slower (or back) against their own past: when it began, by how much, what moved, newest first",
    ),
    NamedQuery(
        "job_profile",
        "SELECT attempt, window_id, first_step, end_ns, optype, seconds FROM window_profiles "
        "WHERE job_id = {job_id:String} AND dp_rank = -1 "
        "AND ({optype:String} = '' OR optype = {optype:String}) "
        "ORDER BY end_ns, attempt, window_id, optype LIMIT {limit:UInt64}",
        (_job_required(), ParamSpec("optype", "String", "", "only this op type; 'step' is the step time (empty: "
                                                             "all)"), _limit(100_000)),
        "a job's history per window: its step time and each op type's time per step, oldest first",
    ),
    NamedQuery(
        "lemon_hosts",
        "SELECT host, label, lemon, jobs, incidents, gpu_hours, expected_jobs, p_value, evidence_json, scored_ns, "
        "period_s FROM lemon_hosts WHERE scored_ns = (SELECT max(scored_ns) FROM lemon_hosts) "
        "AND ({lemons_only:Int8} = 0 OR lemon) ORDER BY lemon DESC, p_value, jobs DESC, host LIMIT {limit:UInt64}",
        (ParamSpec("lemons_only", "Int8", 0, "1: only the hosts called lemons"), _limit(1000)),
        "hosts implicated across jobs, lemons first, from the latest scoring pass (lemons.every_s)",
    ),
    # -- what the lemon scoring reads (ray_jobs/lemon_watch.py): one pass over a period -------------------
    NamedQuery(
        "lemon_job_hours",
        "SELECT job_id, attempt, sum(gpu_hours) AS gpu_hours FROM windows "
        "WHERE analyzed_ns >= {since:Int64} AND analyzed_ns < {until:Int64} AND isFinite(slowdown) "
        "GROUP BY job_id, attempt ORDER BY job_id, attempt LIMIT {limit:UInt64}",
        (SINCE, UNTIL, _limit(10_000_000)),
        "GPU-hours per job attempt analysed in a period (a host's exposure is its ranks' share)",
    ),
    NamedQuery(
        "lemon_slow_workers",
        "SELECT job_id, attempt, window_id, argMax(dp_rank, s_w) AS top_dp, argMax(pp_rank, s_w) AS top_pp, "
        "max(s_w) AS top_s_w, max(analyzed_ns) AS at_ns FROM worker_slowdown ALL INNER JOIN ("
        "SELECT job_id, attempt, window_id, analyzed_ns FROM windows WHERE analyzed_ns >= {since:Int64} "
        "AND analyzed_ns < {until:Int64} AND verdict = 'worker') AS w USING (job_id, attempt, window_id) "
        "WHERE step = -1 GROUP BY job_id, attempt, window_id ORDER BY job_id, attempt, window_id LIMIT {limit:UInt64}",
        (SINCE, UNTIL, _limit(10_000_000)),
        "the slowest worker of each window whose main verdict is a slow worker, in a period",
    ),
    NamedQuery(
        "lemon_worker_ranks",
        "SELECT job_id, attempt, dp_rank, pp_rank, min(rank) AS worker_rank FROM window_profiles "
        "WHERE dp_rank >= 0 AND rank >= 0 AND (job_id, attempt) IN (SELECT job_id, attempt FROM windows "
        "WHERE analyzed_ns >= {since:Int64} AND analyzed_ns < {until:Int64}) "
        "GROUP BY job_id, attempt, dp_rank, pp_rank ORDER BY job_id, attempt, dp_rank, pp_rank LIMIT {limit:UInt64}",
        (SINCE, UNTIL, _limit(10_000_000)),
        "the rank that reported each worker's spans, for the jobs analysed in a period",
    ),
    NamedQuery(
        "lemon_rank_hosts",
        "SELECT job_id, attempt, rank, host FROM rank_hosts WHERE (job_id, attempt) IN (SELECT job_id, attempt "
        "FROM windows WHERE analyzed_ns >= {since:Int64} AND analyzed_ns < {until:Int64}) "
        "OR (job_id, attempt) IN (SELECT job_id, attempt FROM hangs WHERE hang_id >= {since:Int64} "
        "AND hang_id < {until:Int64}) ORDER BY job_id, attempt, rank, host LIMIT {limit:UInt64}",
        (SINCE, UNTIL, _limit(10_000_000)),
        "where each rank of the jobs analysed (or hung) in a period ran",
    ),
    NamedQuery(
        "lemon_hangs",
        "SELECT job_id, attempt, hang_id, kind, suspect_hosts, duration_s FROM hangs "
        "WHERE hang_id >= {since:Int64} AND hang_id < {until:Int64} AND suspect_hosts != '' "
        "ORDER BY hang_id, job_id LIMIT {limit:UInt64}",
        (SINCE, UNTIL, _limit(1_000_000)),
        "hangs and node losses with the hosts they suspect, in a period",
    ),
    NamedQuery(
        "lemon_degraded_workers",
        "SELECT job_id, attempt, window_id, scope, change, found_ns FROM regressions "
        "WHERE kind = 'degraded_worker' AND found_ns >= {since:Int64} AND found_ns < {until:Int64} "
        "ORDER BY found_ns, job_id, scope LIMIT {limit:UInt64}",
        (SINCE, UNTIL, _limit(1_000_000)),
        "workers found over their own best, in a period",
    ),
    # -- hosts' fabric ports (core.schema.PORT_COUNTER; ingest/port_counters.py) --------------------------------
    NamedQuery(
        "job_port_counters",
        f"SELECT host, device, port, {_PORT_OUTER} FROM (SELECT host, device, port, {_PORT_INNER} FROM port_counters "
        "WHERE job_id = {job_id:String} AND attempt = if({attempt:Int32} >= 0, {attempt:Int32}, (SELECT max(attempt) "
        "FROM port_counters WHERE job_id = {job_id:String})) AND ts_ns >= {since:Int64} AND ts_ns < {until:Int64} "
        "GROUP BY host, device, port) ORDER BY host, device, port LIMIT {limit:UInt64}",
        (_job_required(), ParamSpec("attempt", "Int32", -1, "the attempt (-1: the latest)"), SINCE, UNTIL,
         _limit(10_000)),
        "each port of a job attempt's hosts summed over a period: transmit waits (ticks), discards, errors, "
        "link downs and recoveries, data sent and received (bytes); -1 where the port lacks the counter",
    ),
    NamedQuery(
        "lemon_port_errors",
        f"SELECT job_id, attempt, host, device, port, {_PORT_OUTER} FROM (SELECT job_id, attempt, host, device, port, "
        f"{_PORT_INNER} FROM port_counters "
        "WHERE ts_ns >= {since:Int64} AND ts_ns < {until:Int64} GROUP BY job_id, attempt, host, device, port "
        "HAVING s_link_downed > 0 OR s_link_error_recovery > 0 OR s_symbol_errors > 0 OR s_rcv_errors > 0 "
        "OR s_xmit_discards > 0 OR s_rcv_discards > 0) ORDER BY job_id, attempt, host, device, port "
        "LIMIT {limit:UInt64}",
        (SINCE, UNTIL, _limit(1_000_000)),
        "ports with errors, discards, link downs or recoveries per job attempt in a period (lemon-host evidence)",
    ),
    # -- run-time changes (core/control.py; `stragglerscope control`) ------------------------------------------
    NamedQuery(
        "job_controls",
        "SELECT change_id, scope, who, when_ns, until_ns, what_json, clears, from_step FROM control_changes "
        "WHERE job_id = {job_id:String} OR scope = 'fleet' ORDER BY when_ns DESC, change_id LIMIT {limit:UInt64}",
        (_job_required(), _limit(100)),
        "the run-time changes made for a job and for the fleet, newest first: who, when, until when (0: until "
        "cleared), what (JSON) and from which step of the job (0: each rank's next step end), or the change a record "
        "cleared",
    ),
    NamedQuery(
        "alert_history",
        # ANY LEFT JOIN ... USING: the join form both 18.16 and current ClickHouse accept.
        "SELECT alert_id, job_id, attempt, ts_ns, rule, severity, summary, details_json, "
        "acked, acked_by, acked_ns, note AS ack_note FROM ("
        "SELECT alert_id, job_id, attempt, ts_ns, rule, severity, summary, details_json FROM alerts "
        "WHERE ts_ns >= {since:Int64} AND ts_ns < {until:Int64} "
        "AND ({job_id:String} = '' OR job_id = {job_id:String}) AND ({rule:String} = '' OR rule = {rule:String}) "
        "AND ({severity:String} = '' OR severity = {severity:String})) AS a "
        "ANY LEFT JOIN (SELECT alert_id, acked, acked_by, acked_ns, note FROM alert_acks) AS k USING (alert_id) "
        "WHERE {acked:Int8} < 0 OR acked = {acked:Int8} "
        "ORDER BY ts_ns DESC, alert_id LIMIT {limit:UInt64}",
        (SINCE, UNTIL, JOB, ParamSpec("rule", "String", "", "only this rule (empty: all)"),
         ParamSpec("severity", "String", "", "only this severity (empty: all)"),
         ParamSpec("acked", "Int8", -1, "1 only acknowledged, 0 only open, -1 both"), _limit(500)),
        "alerts, newest first, with their acknowledgement",
    ),
]

NAMED_QUERIES: dict[str, NamedQuery] = {q.name: q for q in _QUERIES}
