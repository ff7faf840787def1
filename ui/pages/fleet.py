"""Fleet at a glance: how much straggling costs, where, and which jobs."""
import altair as alt
import streamlit as st

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

share = named("straggling_share", **params)
waste = named("waste_share", **params)
c1, c2 = st.columns(2)
if not share.empty:
    c1.metric("Jobs with S ≥ 1.1", f"{100 * float(share.iloc[0].get('share', 0) or 0):.1f}%")
if not waste.empty:
    c2.metric("Share of GPU-hours wasted", f"{100 * float(waste.iloc[0].get('share', 0) or 0):.1f}%")

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

st.subheader("Top wasting jobs")
top = named("top_wasting_jobs", **params, limit=20)
if top.empty:
    st.info("No jobs yet.")
else:
    st.dataframe(top, width="stretch", hide_index=True)
    st.caption("Open one on the Job page.")
