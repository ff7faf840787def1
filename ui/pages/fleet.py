"""Fleet at a glance: where the GPU-hours went (stragglers and fault downtime), MFU, and which jobs."""
import altair as alt
import streamlit as st

from analyzers.explain import title
from ui.control_form import control_form
from ui.data import named
from ui.widgets import bar, fleet_filters, fmt

st.title("Fleet")
params = fleet_filters()

summary = named("fleet_summary", **params)
row = summary.to_dict("records")[0] if not summary.empty else {}
cols = st.columns(5)
for c, (key, label) in zip(cols, [("jobs", "Jobs analysed"), ("windows", "Windows"),
                                  ("mean_slowdown", "Mean S"), ("p90_slowdown", "p90 S"),
                                  ("wasted_gpu_hours", "Wasted GPU-hours")]):
    c.metric(label, fmt(row.get(key)))

c1, c2 = st.columns(2)


def _pct(v) -> str:
    return "–" if v is None or v != v else f"{100 * float(v):.1f}%"


c1.metric("Jobs with S ≥ 1.1", _pct(row.get("straggling_share")))
c2.metric("Share of GPU-hours wasted", _pct(row.get("waste_share")))

left, right = st.columns(2)
with left:
    st.subheader("CDF of straggler slowdown S")
    cdf = named("slowdown_cdf", **params)
    if cdf.empty:
        st.info("No analysed windows yet.")
    else:
        x, y = cdf.columns[0], cdf.columns[1]
        st.altair_chart(alt.Chart(cdf).mark_line(interpolate="step-after").encode(
            x=alt.X(f"{x}:Q", title="S", scale=alt.Scale(zero=False)), y=alt.Y(f"{y}:Q", title="share of jobs")),
            width="stretch")
with right:
    st.subheader("Wasted GPU-hours by root cause")
    by_cause = named("wasted_by_cause", **params)
    if "cause" in by_cause:  # verdict ids ('last_stage_imbalance') in the words the job page uses
        by_cause = by_cause.assign(cause=by_cause["cause"].map(title))
    bar(by_cause, by_cause.columns[0] if len(by_cause.columns) else "", "wasted_gpu_hours")

left, right = st.columns(2)
with left:
    st.subheader("Wasted GPU-hours by op type")
    by_op = named("wasted_by_optype", **params)
    bar(by_op, "optype", "wasted_gpu_hours")
with right:
    st.subheader("Wasted GPU-hours by team")
    by_team = named("wasted_by_team", **params)
    bar(by_team, by_team.columns[0] if len(by_team.columns) else "", "wasted_gpu_hours")

st.subheader("Where the GPU-hours went")
lost = named("gpu_hours_lost", **params)
down = named("downtime_summary", **params)
d = down.to_dict("records")[0] if not down.empty else {}
c = st.columns(4)
c[0].metric("Straggler GPU-hours", fmt(float(lost[lost["cause"] == "stragglers"]["gpu_hours"].sum())
                                        if not lost.empty else 0.0))
c[1].metric("Fault downtime GPU-hours", fmt(d.get("gpu_hours")))
c[2].metric("Fault incidents", fmt(d.get("incidents")))
ds = d.get("detection_share")
c[3].metric("Downtime from detection + diagnosis", "–" if ds is None or ds != ds else f"{100 * ds:.1f}%",
            help="The part of fault downtime between the fault and the culprit being named: what faster "
                 "detection and diagnosis can win back (C4's categories).")
if lost.empty or lost["gpu_hours"].sum() <= 0:
    st.info("No straggler waste or fault downtime recorded in this period.")
else:
    lost = lost.assign(week=lost["week"].astype(str))
    st.altair_chart(alt.Chart(lost).mark_bar().encode(
        x=alt.X("week:O", title="week (Monday, UTC)"), y=alt.Y("sum(gpu_hours):Q", title="GPU-hours lost"),
        color=alt.Color("cause:N", title=None), tooltip=["week", "cause", "gpu_hours"]), width="stretch")

st.subheader("MFU across jobs")
hist = named("mfu_histogram", **params)
if hist.empty:
    st.info("No job registered its FLOPs (flops_per_token or params, tokens_per_step, peak FLOP/s).")
else:
    long = hist.melt(id_vars=["mfu_from", "mfu_to"], value_vars=["achieved", "without_stragglers"],
                     var_name="at", value_name="jobs")
    long["at"] = long["at"].str.replace("_", " ")
    st.altair_chart(alt.Chart(long).mark_bar(opacity=0.6).encode(
        x=alt.X("mfu_from:Q", title="MFU"), x2="mfu_to:Q", y=alt.Y("jobs:Q", stack=None),
        color=alt.Color("at:N", title=None), tooltip=["at", "mfu_from", "mfu_to", "jobs"]), width="stretch")
    n = int(hist["achieved"].sum())
    mid = (hist["mfu_from"] + hist["mfu_to"]) / 2

    def _median(counts) -> float:
        c = counts.cumsum()
        return float(mid[c >= c.iloc[-1] / 2].iloc[0])

    st.caption(f"{n} jobs · median MFU ≈ {_median(hist['achieved']):.2f} achieved, "
               f"{_median(hist['without_stragglers']):.2f} without stragglers")

st.subheader("Top wasting jobs")
top = named("top_wasting_jobs", **params, limit=20)
if top.empty:
    st.info("No jobs yet.")
else:
    st.dataframe(top, width="stretch", hide_index=True)
    with st.container(horizontal=True, vertical_alignment="center"):
        st.markdown("Open on the Job page:")
        for j in top["job_id"].head(5):
            st.page_link("pages/job.py", label=str(j), query_params={"job": str(j)})

control_form(None)  # the fleet's run-time changes, only where the console runs with control on
