"""Live alerts: newest first, filtered, acknowledged in this session."""
import streamlit as st

from ui.data import named_live

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
    acked = st.session_state.setdefault("acked", set())
    show_acked = st.toggle("Show acknowledged", value=False)
    if not show_acked and "alert_id" in df:
        df = df[~df["alert_id"].isin(acked)]
    st.caption(f"{len(df)} alerts · refreshed every 5 s")
    st.dataframe(df, width="stretch", hide_index=True)
    if "alert_id" in df and not df.empty:
        pick = st.multiselect("Acknowledge", df["alert_id"].tolist())
        if st.button("Acknowledge selected", disabled=not pick):
            acked.update(pick)
            st.rerun()


feed()
