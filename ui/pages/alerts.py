"""Live alerts: newest first, read at a glance, each one a click from its job at the alerted window or hang.

Acknowledgements are stored, so every on-call engineer sees who took an alert.
"""
import math

import streamlit as st

from ui.data import acknowledge, named_live, now_ns, viewer_tz
from ui.readable import ago, alert_text, zone
from ui.widgets import RULE_NAMES, alert_list

st.title("Alerts")

RANGES = {"last hour": 3600, "last 6 hours": 6 * 3600, "last 24 hours": 86400, "last 7 days": 7 * 86400,
          "last 30 days": 30 * 86400, "all time": None}
PAGE_SIZE = 20


@st.fragment(run_every=5)
def feed() -> None:
    c0, c1, c2, c3 = st.columns([1.2, 1, 1, 1.4])
    period = c0.selectbox("Time range", list(RANGES), index=3, key="alert_range")
    rule = c1.selectbox("Rule", ["all"] + list(RULE_NAMES), key="alert_rule",
                        format_func=lambda r: r if r == "all" else RULE_NAMES[r])
    severity = c2.selectbox("Severity", ["all", "critical", "warning", "info"], key="alert_severity")
    job = c3.text_input("Job", placeholder="any", key="alert_job")
    show_acked = st.toggle("Show acknowledged", value=False, key="alert_acked")
    now = now_ns()
    params = {"job_id": job.strip() or None, "rule": None if rule == "all" else rule,
              "severity": None if severity == "all" else severity, "acked": None if show_acked else 0,
              "limit": 500}
    if RANGES[period]:
        # Whole minutes: the cached answer serves every rerun within a minute instead of none.
        params["since"] = (now // 60_000_000_000) * 60_000_000_000 - RANGES[period] * 1_000_000_000
    df = named_live("alert_history", **params)
    if df.empty:
        older = "" if RANGES[period] is None else " in the " + period
        st.success(f"No {'' if show_acked else 'open '}alerts{older}.")
        return
    tz = viewer_tz()
    pages = max(1, math.ceil(len(df) / PAGE_SIZE))
    shown = f"{len(df)} alerts" + (" (the newest 500)" if len(df) >= 500 else "")
    st.caption(f"{shown} · refreshed every 5 s · times: {'your time zone and ' if zone(tz) else ''}UTC")
    page = 1
    if pages > 1:
        page = st.selectbox("Page", range(1, pages + 1), key="alert_page",
                            format_func=lambda p: f"{(p - 1) * PAGE_SIZE + 1}–{min(p * PAGE_SIZE, len(df))} "
                                                  f"of {len(df)}")
    alert_list(df.iloc[(page - 1) * PAGE_SIZE: page * PAGE_SIZE], now, tz)

    st.divider()
    rows = {a["alert_id"]: a for a in df.to_dict("records")}
    pick = st.multiselect(
        "Acknowledge", list(rows), key="ack_pick", placeholder="choose the alerts you are handling",
        format_func=lambda i: f"{ago(rows[i]['ts_ns'], now)} · {rows[i]['job_id']} · {alert_text(rows[i])[:90]}")
    a, b = st.columns(2)
    who = a.text_input("Your name", key="ack_by", placeholder="on-call")
    note = b.text_input("Note", key="ack_note", placeholder="what was done")
    c1, c2 = st.columns(2)
    if c1.button("Acknowledge selected", disabled=not pick):
        acknowledge(pick, by=who.strip() or "console", note=note.strip())
        st.rerun()
    if show_acked and c2.button("Re-open selected", disabled=not pick):
        acknowledge(pick, by=who.strip() or "console", note=note.strip(), acked=False)
        st.rerun()


feed()
