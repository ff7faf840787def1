"""One job in depth: S over its windows, worker heatmaps (whole window and per step), per-step slowdown,
verdicts, the actual vs simulated ideal timeline, links, hangs."""
import json

import altair as alt
import pandas as pd
import streamlit as st

from core.schema import STORED_INF
from ui.data import advise_window, named, window_timeline
from ui.widgets import heatmap

st.title("Job")
top = named("top_wasting_jobs", limit=200)
jobs = top["job_id"].tolist() if "job_id" in top else []
default = st.query_params.get("job", jobs[0] if jobs else "")
job = st.selectbox("Job", jobs, index=jobs.index(default) if default in jobs else 0, key="job") if jobs else None
if not job:
    st.info("No analysed jobs yet.")
    st.stop()
st.query_params["job"] = job

windows = named("job_windows", job_id=job)
if windows.empty:
    st.info("No windows stored for this job.")
    st.stop()
last = windows.sort_values("window_id").iloc[-1]
c = st.columns(5)
c[0].metric("S (last window)", f"{last['slowdown']:.3f}")
c[1].metric("Waste", f"{100 * last['waste_fraction']:.1f}%")
c[2].metric("GPUs", int(last["n_gpus"]))
c[3].metric("Verdict", last["verdict"] or "none")
c[4].metric("Windows", len(windows))

st.subheader("S per window")
st.altair_chart(alt.Chart(windows).mark_line(point=True).encode(
    x=alt.X("window_id:Q", title="window (first step)"), y=alt.Y("slowdown:Q", scale=alt.Scale(zero=False)),
    tooltip=["window_id", "slowdown", "waste_fraction", "verdict", "complete"]), width="stretch")

window_ids = windows["window_id"].tolist()
wid = st.selectbox("Window", window_ids, index=len(window_ids) - 1)
row = windows[windows["window_id"] == wid].iloc[0]

steps = named("job_step_trend", job_id=job)
if not steps.empty and "window_id" in steps:
    steps = steps[steps["window_id"] == wid]
step_ids = [int(x) for x in steps["step"].tolist()] if "step" in steps else []

left, right = st.columns(2)
with left:
    st.subheader("Worker slowdown S_w (x = DP rank, y = PP rank)")
    pick = st.selectbox("Heatmap of", ["whole window"] + [f"step {s}" for s in step_ids], key="heat_step")
    hstep = -1 if pick == "whole window" else int(pick.split()[1])
    cells = named("job_workers", job_id=job, window_id=int(wid), step=hstep)
    if cells.empty and hstep >= 0:
        st.info("No per-step worker cells stored for this window (windows analysed before they were kept).")
    else:
        heatmap(cells, "dp_rank", "pp_rank", "s_w")
with right:
    st.subheader("Per-step slowdown")
    if steps.empty:
        st.info("No steps stored.")
    else:
        st.altair_chart(alt.Chart(steps).mark_bar().encode(
            x=alt.X("step:O"), y=alt.Y("slowdown:Q", scale=alt.Scale(zero=False)),
            tooltip=list(steps.columns)), width="stretch")

st.subheader("Verdicts")
try:
    verdicts = json.loads(row.get("verdicts_json") or "[]")
except ValueError:
    verdicts = []
if not verdicts:
    st.write("No straggler verdict for this window.")
for v in verdicts:
    with st.expander(f"{v.get('kind', '?')}: {v.get('summary', '')}", expanded=True):
        st.json(v.get("evidence", {}))
if row.get("note"):
    st.caption(f"Note: {row['note']}")

st.subheader("Remedies")
remedies = named("job_remedies", job_id=job, window_id=int(wid))
if st.button("Advise now (re-simulates this window with each fix)", key="advise"):
    msg = advise_window(job, int(row["attempt"]), int(wid))
    if msg:
        st.info(msg)
    remedies = named("job_remedies", job_id=job, window_id=int(wid))
if remedies.empty:
    st.write("No remedies stored for this window yet (windows with a verdict get them in the pipeline; "
             "`stragglerscope advise` or the button computes them on demand).")
for _, r in remedies.iterrows():
    gain = r["predicted_gain"]
    label = ("restores progress" if gain >= STORED_INF
             else f"+{100 * gain:.1f}% step time" if gain == gain else "gain n/a")
    with st.expander(f"{int(r['priority'])}. {r['kind']} ({r['verdict']}): {label}", expanded=int(r["priority"]) == 1):
        st.markdown(r["action"])
        c = st.columns(2)
        c[0].metric("Step time now", f"{r['step_time_before_s']:.3f} s")
        after = r["step_time_after_s"]
        c[1].metric("Predicted after the fix", f"{after:.3f} s" if after < STORED_INF else "–")
        st.json(json.loads(r["details_json"] or "{}"), expanded=False)

st.subheader("Actual vs simulated ideal timeline")
if not step_ids:
    st.write("No steps stored for this window.")
else:
    t1, t2 = st.columns([1, 1])
    tstep = t1.selectbox("Step", step_ids, key="tl_step")
    n_workers = t2.slider("Workers shown", 1, 32, 8, key="tl_workers")
    if st.toggle("Show the timeline (re-simulates the window from its stored op spans)", key="tl_on"):
        frame, doc = window_timeline(job, int(row["attempt"]), int(wid), int(tstep), int(n_workers))
        if frame is None:
            st.info(f"No timeline: {doc}.")
        else:
            lanes = frame.assign(lane=frame["scenario"] + " " + frame["worker"] + " " + frame["stream"])
            st.altair_chart(alt.Chart(lanes).mark_bar().encode(
                x=alt.X("start_ms:Q", title="ms since the step started"), x2="end_ms:Q",
                y=alt.Y("lane:N", title=None, sort=None, axis=alt.Axis(labelLimit=300)),
                color=alt.Color("optype:N"), tooltip=["scenario", "worker", "optype", "start_ms", "end_ms"],
            ).properties(height=max(200, 16 * lanes["lane"].nunique())), width="stretch")
            span = frame.groupby("scenario")["end_ms"].max()
            if {"actual", "ideal"} <= set(span.index):
                st.caption(f"step {tstep}: actual {span['actual']:.1f} ms, ideal {span['ideal']:.1f} ms "
                           f"(ideal = every op at its typical duration, no launch delays)")
            st.download_button("Whole window as a Perfetto trace (.json.gz)", doc,
                               file_name=f"{job}-w{wid}-timeline.json.gz", mime="application/gzip")

st.subheader("Link matrix")
st.caption("Time per byte of every directed pair (pipeline sends matched with their receives, or per-peer times "
           "the library reported), and each collective group's time per byte once all members were in. "
           "Ratio: over the lower quartile of its class; slow at 3x. A fault is named by intersecting the slow "
           "and the healthy observations.")
links = named("job_links", job_id=job, window_id=int(wid))
_WHERE = {"link": "link {src} → {dst}", "source": "rank {src} sends slowly (NIC egress)",
          "destination": "rank {dst} receives slowly (ingress)",
          "endpoint": "rank {src}'s network (only collectives saw it: direction unknown)",
          "noncomm_slow": "rank {src} late to send (its own compute, not the network)",
          "comm_slow": "slow communication in {group}, not localised"}
if links.empty:
    st.write("No link fault found in this window (or no collective records were sampled).")
for _, f in links.iterrows():
    where = _WHERE.get(f["kind"], f["kind"]).format(src=f["src"], dst=f["dst"], group=f["group"])
    st.markdown(f"**{where}**: {f['slowdown']:.2f}x, confidence {f['confidence']:.2f}")
    with st.expander("evidence"):
        st.json(json.loads(f.get("evidence_json") or "{}"))
cells = named("job_link_cells", job_id=job, window_id=int(wid))
if cells.empty:
    st.write("No communication records in this window.")
else:
    pairs = cells[cells["dst"] >= 0]
    for group, g in pairs.groupby("group"):
        heatmap(g.assign(ratio=g["ratio"].fillna(0)), "dst", "src", "ratio",
                title=f"{group}: time per byte over the reference (src x dst)")
    members = cells[cells["dst"] < 0]
    if not members.empty:
        st.markdown("**Collective groups** (ratio: the group's time per byte over its class; wait: the member's "
                    "median lateness)")
        heatmap(members.assign(ratio=members["ratio"].fillna(0), wait_ms=members["wait_ns"] / 1e6),
                "src", "group", "ratio", title="collective groups x members")
    with st.expander("all cells"):
        st.dataframe(cells, width="stretch", hide_index=True)

st.subheader("Hangs")
hangs = named("job_hangs", job_id=job)
if hangs.empty:
    st.write("No hang or node loss recorded for this job.")
for _, h in hangs.iterrows():
    kind = {"comm_hang": "communication hang", "noncomm_hang": "non-communication hang",
            "node_loss": "node loss"}.get(h["kind"], h["kind"])
    with st.expander(f"{kind}: missing ranks {h['missing_ranks'] or '–'}, {h['duration_s']:.0f} s", expanded=True):
        c = st.columns(4)
        c[0].metric("Missing ranks", h["missing_ranks"] or "–")
        c[1].metric("Stuck ranks", h["stuck_ranks"] or "–")
        c[2].metric("Suspect hosts", h["suspect_hosts"] or "–")
        c[3].metric("Collective", f"{h['op']} #{h['seq']}" if h["group"] else (h["op"] or "–"))
        ev = json.loads(h.get("evidence_json") or "{}")
        chain = ev.get("wait_chain") or {}
        if chain:
            st.markdown(f"**Wait chain** — root: ranks `{chain.get('root') or '?'}`")
            st.dataframe(pd.DataFrame(chain.get("rows", [])), width="stretch", hide_index=True)
        if ev.get("stacks_folded"):
            st.markdown("**Merged stacks** (each frame: the ranks in it | the ranks not in it)")
            st.code(ev["stacks_folded"], language=None)
            d1, d2 = st.columns(2)
            d1.download_button("Folded stacks", ev["stacks_folded"], file_name=f"{job}-{h['hang_id']}.folded",
                               key=f"folded-{h['hang_id']}")
            if ev.get("stacks_svg"):
                d2.download_button("Flame graph (SVG)", ev["stacks_svg"], file_name=f"{job}-{h['hang_id']}.svg",
                                   mime="image/svg+xml", key=f"svg-{h['hang_id']}")
