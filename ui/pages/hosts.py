"""Lemon hosts: machines implicated across jobs, weighed by what they ran (``ray_jobs.lemon_watch``).

One row per implicated host from the latest scoring pass, lemons first; a
host's evidence (the jobs, windows and findings that implicated it) opens
under it, each job a link to its page. Hosts under one rack or switch (the
topology file's labels) are counted together below.
"""
import json

import pandas as pd
import streamlit as st

from ui.data import named, now_ns, viewer_tz
from ui.readable import ago, md_escape, when

st.title("Hosts")
NOW, TZ = now_ns(), viewer_tz()
hosts = named("lemon_hosts")
if hosts.empty:
    st.info("No host has been implicated in a finding yet (or `run` has not scored the fleet: lemons.every_s).")
    st.stop()
hosts["lemon"] = hosts["lemon"].astype(bool)  # a ClickHouse Bool reads back as 0/1 on older servers
scored = int(hosts["scored_ns"].iloc[0])
period_d = float(hosts["period_s"].iloc[0]) / 86400
lemons = hosts[hosts["lemon"]]
st.caption(f"Scored {ago(scored, NOW)} ({when(scored, NOW, TZ)}) over the last {period_d:g} days. A host is a "
           "lemon when enough distinct jobs implicated it (a slow worker, a hang or node loss, a worker over its "
           "own best, errors or link downs on its fabric ports) and that many would be unlikely by chance for the GPU-hours it ran.")
c = st.columns(3)
c[0].metric("Lemon hosts", len(lemons))
c[1].metric("Hosts implicated", len(hosts))
c[2].metric("Findings", int(hosts["incidents"].sum()))

table = pd.DataFrame({
    "host": hosts["host"], "lemon": hosts["lemon"].map({True: "lemon", False: ""}), "label": hosts["label"],
    "jobs": hosts["jobs"], "findings": hosts["incidents"], "GPU-hours": hosts["gpu_hours"].round(1),
    "expected jobs": hosts["expected_jobs"].round(2),
    "chance": hosts["p_value"].map(lambda p: f"1 in {1 / p:,.0f}" if p > 0 else "never"),
})
st.dataframe(table, hide_index=True, width="stretch")

for r in hosts.head(20).to_dict("records"):
    label = f" ({r['label']})" if r["label"] else ""
    head = (f"{'🍋 ' if r['lemon'] else ''}{r['host']}{label}: {r['jobs']} job{'s' if r['jobs'] != 1 else ''}, "
            f"{r['incidents']} finding{'s' if r['incidents'] != 1 else ''}")
    with st.expander(head, expanded=bool(r["lemon"])):
        for e in json.loads(r["evidence_json"]):
            st.markdown(f"[{md_escape(e['job_id'])}](/job?job={e['job_id']}&attempt={e['attempt']}) · "
                        f"{md_escape(e['kind'].replace('_', ' '))} · {md_escape(e['what'])} · {ago(e['at_ns'], NOW)}")

if (hosts["label"] != "").any():
    st.subheader("By rack or switch")
    by = hosts[hosts["label"] != ""].groupby("label").agg(hosts=("host", "count"), lemons=("lemon", "sum"),
                                                            findings=("incidents", "sum"))
    st.dataframe(by.sort_values(["lemons", "findings"], ascending=False), width="stretch")
