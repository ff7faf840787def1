"""Live alerts: newest first, filtered; acknowledgements are stored, so every on-call sees them."""
import streamlit as st

from ui.data import acknowledge, named_live

st.title("Alerts")


@st.fragment(run_every=5)
def feed() -> None:
    c1, c2, c3 = st.columns(3)
    rule = c1.selectbox("Rule", ["all", "slowdown", "hang", "link", "node_loss", "fidelity", "analysis_failed"])
    severity = c2.selectbox("Severity", ["all", "critical", "warning", "info"])
    job = c3.text_input("Job", placeholder="any")
    df = named_live("alert_history", job_id=job.strip() or None, limit=500)
    if df.empty:
        st.success("No alerts.")
        return
    if rule != "all" and "rule" in df:
        df = df[df["rule"] == rule]
    if severity != "all" and "severity" in df:
        df = df[df["severity"] == severity]
    show_acked = st.toggle("Show acknowledged", value=False)
    if not show_acked and "acked" in df:
        df = df[df["acked"] != 1]
    st.caption(f"{len(df)} alerts · refreshed every 5 s")
    st.dataframe(df, width="stretch", hide_index=True)
    if "alert_id" in df and not df.empty:
        pick = st.multiselect("Acknowledge", df["alert_id"].tolist())
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
