"""Shared pieces of the console's pages: filters, number formats, charts, the rows of alerts, drawn SVGs.

Charts live here and in the pages, never in the analyzers (docs/architecture.md, "Conventions" 1).
"""
from __future__ import annotations

import time

import altair as alt
import pandas as pd
import streamlit as st

from ui.readable import ago, alert_subject, alert_target, alert_text, clock, md_escape

PERIODS = {"last 24 hours": 1, "last 7 days": 7, "last 30 days": 30, "last 365 days": 365, "all time": None}


def fleet_filters() -> dict:
    """Sidebar filters shared by the fleet views; returns named-query parameters."""
    with st.sidebar:
        st.subheader("Filters")
        period = st.selectbox("Period", list(PERIODS), index=4, key="period")
        team = st.text_input("Team", key="team", placeholder="any")
        model = st.text_input("Model", key="model", placeholder="any")
        min_gpus = st.number_input("Min GPUs", min_value=0, value=0, step=8, key="min_gpus")
    days = PERIODS[period]
    params = {"team": team.strip() or None, "model": model.strip() or None, "min_gpus": int(min_gpus) or None}
    if days:
        params["since"] = int((time.time() - days * 86400) * 1e9)
    return params


def fmt(v) -> str:
    if hasattr(v, "item"):  # numpy scalars
        v = v.item()
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def bar(df: pd.DataFrame, label: str, value: str, title: str = "", zero: bool = True) -> None:
    """Horizontal bars, largest first; ``zero=False`` for ratios near 1 (slowdowns)."""
    if df.empty or label not in df or value not in df:
        st.info("No data yet.")
        return
    chart = alt.Chart(df).mark_bar().encode(
        x=alt.X(f"{value}:Q", title=value.replace("_", " "), scale=alt.Scale(zero=zero)),
        y=alt.Y(f"{label}:N", sort="-x", title=None, axis=alt.Axis(labelLimit=260, labelOverlap=False)),
        tooltip=list(df.columns),
    ).properties(title=title, height=max(160, 28 * len(df)))
    st.altair_chart(chart, width="stretch")


def heatmap(df: pd.DataFrame, x: str, y: str, value: str, title: str = "", scheme: str = "reds") -> None:
    """SMon-style heatmap: x = DP rank, y = PP rank, colour = slowdown."""
    if df.empty:
        st.info("No data yet.")
        return
    chart = alt.Chart(df).mark_rect().encode(
        x=alt.X(f"{x}:O", title=x.replace("_", " ")),
        y=alt.Y(f"{y}:O", title=y.replace("_", " "), sort="descending"),
        color=alt.Color(f"{value}:Q", scale=alt.Scale(scheme=scheme), title=value.replace("_", " ")),
        tooltip=list(df.columns),
    ).properties(title=title, height=max(160, 40 * df[y].nunique()))
    st.altair_chart(chart, width="stretch")


SEVERITY_COLOURS = {"critical": "red", "warning": "orange", "info": "blue"}
RULE_NAMES = {"slowdown": "straggling", "hang": "hang", "node_loss": "node loss", "hang_ended": "stall ended",
              "link": "slow link",
              "fidelity": "simulation fidelity", "analysis_failed": "analysis failed",
              "regression": "slower than before", "degraded_worker": "worker over its best",
              "lemon_host": "lemon host"}
ALERT_COLUMNS = [1.25, 0.8, 1.75, 4.8, 1.0]
"""When, severity, job, what happened, rule: the order an on-call engineer reads an alert in."""


def alert_list(df: pd.DataFrame, now_ns: int, tz: str | None, link_job: bool = True, key: str = "alerts") -> None:
    """Alerts as rows a person reads: age and clock time, a severity badge, a link to the job at the alerted
    window (or hang), the whole summary wrapped, the rule; acknowledgements under the summary.

    Rows, not a data grid: a grid cuts the summary at its column's edge and cannot hold a link that
    stays in the console; these rows wrap and their links switch pages in the same session.
    """
    # Streamlit cuts a page link's label at its column's edge; a job id is the one thing not to cut.
    st.html("<style>[data-testid='stMain'] [data-testid='stPageLink-NavLink'] span, "
            "[data-testid='stMain'] [data-testid='stPageLink-NavLink'] p {white-space: normal; overflow: visible; "
            "text-overflow: clip; overflow-wrap: anywhere}</style>")
    head = st.columns(ALERT_COLUMNS, vertical_alignment="bottom")
    for c, label in zip(head, ["When", "Severity", "Job" if link_job else "About", "What happened", "Rule"]):
        c.markdown(f"**{label}**")
    for i, a in enumerate(df.to_dict("records")):
        row = st.columns(ALERT_COLUMNS, vertical_alignment="top")
        row[0].markdown(f"**{ago(a['ts_ns'], now_ns)}**")
        row[0].caption(clock(a["ts_ns"], now_ns, tz))
        with row[1]:
            st.badge(str(a["severity"]), color=SEVERITY_COLOURS.get(a["severity"], "gray"))
        subject = alert_subject(a)
        label = (f"{a['job_id']} · {subject}" if link_job and subject else a["job_id"] if link_job
                 else subject or "the job")
        row[2].page_link("pages/job.py", label=label, query_params=alert_target(a), width="stretch",
                         help="Open the job at what this alert is about")
        row[3].markdown(md_escape(alert_text(a)))
        if a.get("acked") == 1:
            by = a.get("acked_by") or "someone"
            note = f": {a['ack_note']}" if a.get("ack_note") else ""
            row[3].caption(md_escape(f"acknowledged by {by} {ago(a['acked_ns'], now_ns)}{note}"))
        row[4].markdown(RULE_NAMES.get(a["rule"], str(a["rule"]).replace("_", " ")))


def svg(markup: str) -> None:
    """An SVG drawn by the console (the hang grid, the flame graph), scaled down to its column's width."""
    scaled = markup.replace("<svg ", '<svg style="max-width:100%;height:auto" ', 1)
    st.markdown(f'<div style="max-width:100%;overflow-x:auto">{scaled}</div>', unsafe_allow_html=True)
