"""One job in depth, in the order an on-call engineer reads it: its alerts, the picture of a hang, the window's
verdicts in words, the history of S, step time and MFU, then the worker heatmaps, remedies, the actual vs
simulated ideal timeline and the link matrix.

Query parameters make every view a link: ``job``, ``attempt`` and ``window`` (or ``hang``) open the job where
an alert points; ``alert`` names the alert the reader came from.
"""
import json

import altair as alt
import pandas as pd
import streamlit as st

from analyzers.explain import (duration, explain_hang, explain_window, job_link_sentence, link_sentence, title,
                               verdicts_of)
from analyzers.links.job import job_finding
from core.schema import STORED_INF
from ui.data import (advise_window, job_choices, link_shown_confidence, named, named_live, now_ns, viewer_tz,
                     window_timeline)
from actions.control import audit_states
from ui.control_form import control_form
from ui.hang_view import flame_svg, grid_svg, picture, recorder_rows
from ui.fabric_view import port_panel
from ui.readable import ago, alert_text, md_escape, when
from ui.widgets import alert_list, heatmap, svg

st.title("Job")
NOW, TZ = now_ns(), viewer_tz()
qp = st.query_params


def _follow_link(key: str, value) -> None:
    """The address wins over the widget's remembered value: a followed link (an alert) names what to show."""
    if value is not None and st.session_state.get(key) != value:
        st.session_state[key] = value


def _job_changed() -> None:
    # Another job: the window, hang and alert of the address (and the pickers) were the old job's.
    for k in ("attempt", "window", "hang", "alert"):
        qp.pop(k, None)
    for k in ("window_pick", "hang_pick"):
        st.session_state.pop(k, None)
    qp["job"] = st.session_state["job"]


jobs = list(job_choices())
asked = qp.get("job")
if asked and asked not in jobs:  # a link to a job outside the top wasting ones (a hang, a small job)
    jobs.insert(0, asked)
if not jobs:
    st.info("No analysed jobs yet.")
    st.stop()
_follow_link("job", asked)
job = st.selectbox("Job", jobs, key="job", on_change=_job_changed)
qp["job"] = job

reg_df = named("job_info", job_id=job)
reg = reg_df.to_dict("records")[0] if not reg_df.empty else None
if reg:
    dims = " × ".join(f"{k} {reg[f'{k}_size']}" for k in ("dp", "pp", "tp", "cp") if k in ("dp", "pp")
                      or reg[f"{k}_size"] > 1)
    st.caption(f"{reg['team'] or 'no team'} · {reg['model'] or 'no model'} · {reg['n_gpus']:,} GPUs "
               f"{reg['gpu_type'] or ''} ({dims}) · registered attempt {reg['attempt']}")

# -- alerts of this job ------------------------------------------------------------------------------
alerts = named_live("alert_history", job_id=job, limit=50)
came_from = qp.get("alert")
if came_from and not alerts.empty and came_from in set(alerts["alert_id"]):
    a = alerts[alerts["alert_id"] == came_from].iloc[0]
    st.info(f"**From the alert of {when(a['ts_ns'], NOW, TZ)}:** {md_escape(alert_text(a))}")
st.subheader(f"Alerts ({len(alerts)}{'+' if len(alerts) >= 50 else ''})" if not alerts.empty else "Alerts")
if alerts.empty:
    st.caption("No alerts for this job.")
else:
    alert_list(alerts.head(3), NOW, TZ, link_job=False)
    if len(alerts) > 3:
        with st.expander(f"The other {len(alerts) - 3} alerts of this job"):
            alert_list(alerts.iloc[3:], NOW, TZ, link_job=False)

# -- run-time changes (`stragglerscope control`) ---------------------------------------------------------
controls = named_live("job_controls", job_id=job, limit=100)
if not controls.empty:
    # What became of each (cleared, ran out, replaced by a later change of a setting) is read from the records
    # after it: the table keeps every record, the audit.
    states = audit_states(controls.to_dict("records"), NOW, lambda t: when(t, NOW, TZ))
    st.subheader(f"Run-time changes ({len(controls)})")
    st.dataframe(pd.DataFrame({
        "when": [when(t, NOW, TZ) for t in controls["when_ns"]],
        "who": controls["who"],
        "for": ["the fleet" if sc == "fleet" else "this job" for sc in controls["scope"]],
        "settings": [", ".join(f"{k}={v}" for k, v in sorted(json.loads(w).items())) for w in controls["what_json"]],
        # The step a sampling change starts from on every rank; "next": each rank's next step end.
        "from step": [str(int(n)) if n else ("" if cl else "next") for n, cl in zip(controls["from_step"],
                                                                                 controls["clears"])],
        "state": states,
        "change": controls["change_id"],
    }), hide_index=True, width="stretch")

control_form(job)  # only where the console runs with control on (ui/control_form.py)

# -- hangs -----------------------------------------------------------------------------------------
hangs = named("job_hangs", job_id=job)


def show_hangs() -> None:
    """The job's hangs: the picked one (the link's, else the newest) in words, its picture and its stacks."""
    st.subheader(f"Hangs ({len(hangs)})" if len(hangs) > 1 else "Hang")
    ids = hangs["hang_id"].astype(str).tolist()
    by_id = dict(zip(ids, hangs.to_dict("records")))
    _follow_link("hang_pick", qp.get("hang") if qp.get("hang") in by_id else None)
    if st.session_state.get("hang_pick") not in by_id:
        st.session_state["hang_pick"] = ids[0]  # the newest
    if len(ids) > 1:
        hid = st.selectbox("Hang", ids, key="hang_pick", label_visibility="collapsed",
                           format_func=lambda i: f"{title(by_id[i]['kind'])}, detected "
                                                 f"{when(by_id[i]['hang_id'], NOW, TZ)}")
    else:
        hid = ids[0]
    h = by_id[hid]
    ex = explain_hang(h, reg)
    with st.container(border=True):
        st.markdown(f"**{ex.title}**, detected {when(h['hang_id'], NOW, TZ)}")
        st.markdown(md_escape(ex.sentence))
        pic = picture(h, reg)
        ev = json.loads(h.get("evidence_json") or "{}")
        inner = 1 if pic.folded else pic.sizes["tp"] * pic.sizes["cp"]
        cols = pic.sizes["dp"] * inner
        # Side by side when both fit (a narrow grid leaves the stacks the wider column); a wide grid takes
        # the whole width and the stacks go under it. Each is drawn at about its column's width, so that
        # its text keeps its size.
        small = cols <= 8
        flame = flame_svg(ev.get("stacks_folded") or "", width=600 if small else 420)
        beside = bool(flame) and cols <= 24
        left, right = (st.columns([2, 3] if small else [3, 2]) if beside else (st.container(), st.container()))
        with left:
            third = ("" if inner == 1 else
                     f"; each worker split into its {inner} {'TP' if pic.sizes['cp'] == 1 else 'TP x CP'} ranks")
            st.markdown(f"**The ranks at the hang** (columns: DP rank, rows: pipeline stage{third}"
                        f"{'; TP and CP ranks folded into their worker' if pic.folded else ''})")
            svg(grid_svg(pic, h["op"], width=(400 if small else 620) if beside else 1040))
            st.caption("Hover a cell for its rank, place and state."
                       + (" No registration stored: ranks are drawn in one row." if reg is None else ""))
        with right:
            st.markdown("**Merged stacks** (callers on top; width: share of the ranks; red: not every rank that "
                        "dumped its stacks is in the frame; grey: ranks that dumped none)")
            if flame:
                svg(flame if beside else flame_svg(ev.get("stacks_folded") or "", width=1040))
            else:
                st.caption("No rank dumped its stacks for this hang.")
        with st.expander("Wait chain and stacks as text"):
            if ex.rows:
                st.dataframe(pd.DataFrame(list(ex.rows), columns=list(ex.columns)).astype(str), hide_index=True,
                             width="stretch")
            if ev.get("stacks_folded"):
                st.code(ev["stacks_folded"], language=None)
            recorded = recorder_rows(ev)
            if recorded:
                st.markdown("**PyTorch's Flight Recorder** (the collective library's own account, per rank and "
                            "process group; its numbers count from 1)")
                st.dataframe(pd.DataFrame(recorded).astype(str), hide_index=True, width="stretch")
            d1, d2 = st.columns(2)
            if ev.get("stacks_folded"):
                d1.download_button("Folded stacks", ev["stacks_folded"], file_name=f"{job}-{hid}.folded",
                                   key=f"folded-{hid}")
            if ev.get("stacks_svg"):
                d2.download_button("Flame graph (SVG)", ev["stacks_svg"], file_name=f"{job}-{hid}.svg",
                                   mime="image/svg+xml", key=f"svg-{hid}")


# A hang goes first when the reader came for it, or when it is newer than the last analysed window (the job
# is stuck now); an old hang of a job that runs again goes under the window's verdicts.
hist = named("job_history", job_id=job)
hang_first = not hangs.empty and ("hang" in qp or ("window" not in qp and (
    hist.empty or int(hangs["hang_id"].max()) > int(hist["analyzed_ns"].max()))))
if hang_first:
    show_hangs()

# -- the window --------------------------------------------------------------------------------------
if hist.empty:
    st.info("No window of this job has been analysed yet." + (" Its hangs are above." if not hangs.empty else ""))
    st.stop()
hist = hist.assign(analysed=pd.to_datetime(hist["analyzed_ns"], unit="ns"),
                   key=hist["attempt"].astype(str) + "/" + hist["window_id"].astype(str))
several_attempts = hist["attempt"].nunique() > 1
by_key = {k: r for k, r in zip(hist["key"], hist.to_dict("records"))}


def _window_label(k: str) -> str:
    r = by_key[k]
    s = f"S {r['slowdown']:.3f}" if r["slowdown"] == r["slowdown"] else title(r["verdict"]).lower()
    return (f"window {r['window_id']}" + (f" of attempt {r['attempt']}" if several_attempts else "")
            + f" · {s} · analysed {ago(r['analyzed_ns'], NOW)}")


keys = hist["key"].tolist()
want = None
if qp.get("window") is not None:
    attempt = qp.get("attempt")
    match = hist[hist["window_id"].astype(str) == qp.get("window")]
    if attempt is not None:
        match = match[match["attempt"].astype(str) == attempt] if (match["attempt"].astype(str) == attempt).any() \
            else match
    want = match["key"].iloc[-1] if not match.empty else None
    if want is None:
        st.warning(f"Window {md_escape(qp.get('window'))} of this job is not stored; showing the latest.")


def _window_changed() -> None:
    r = by_key[st.session_state["window_pick"]]
    qp["attempt"], qp["window"] = str(r["attempt"]), str(r["window_id"])


_follow_link("window_pick", want)
if st.session_state.get("window_pick") not in by_key:
    st.session_state["window_pick"] = keys[-1]
st.subheader("Window")
wkey = st.selectbox("Window", keys, key="window_pick", format_func=_window_label, on_change=_window_changed,
                    label_visibility="collapsed")
h_row = by_key[wkey]
wid, attempt = int(h_row["window_id"]), int(h_row["attempt"])
win = named("job_window", job_id=job, window_id=wid, attempt=attempt)
row = win.iloc[0] if not win.empty else pd.Series(h_row)

c = st.columns(5)
c[0].metric("S", f"{row['slowdown']:.3f}" if row["slowdown"] == row["slowdown"] else "–",
            help="Simulated step time over the ideal one (no stragglers): 1 is no slowdown.")
c[1].metric("Waste", f"{100 * row['waste_fraction']:.1f}%" if row["waste_fraction"] == row["waste_fraction"]
            else "–", help="The share of the window's GPU-hours lost to stragglers: 1 - 1/S.")
c[2].metric("Step time", duration(row["step_time_actual"]) if row["step_time_actual"] == row["step_time_actual"]
            else "–", help=f"Mean actual step; ideal {duration(row['step_time_ideal'])}.")
c[3].metric("MFU", f"{100 * row['mfu']:.1f}%" if row["mfu"] == row["mfu"] else "–",
            help="Model FLOPs utilisation at the actual step time (needs the job's FLOPs in its registration).")
c[4].metric("Analysed", ago(row["analyzed_ns"], NOW), help=when(row["analyzed_ns"], NOW, TZ))

st.subheader("Verdicts")
for i, ex in enumerate(explain_window(row.to_dict())):
    st.markdown(f"**{'Main cause: ' if i == 0 and ex.kind not in ('none', '') else ''}{ex.title}**")
    st.markdown(md_escape(ex.sentence))
    if ex.rows:
        st.dataframe(pd.DataFrame(list(ex.rows), columns=list(ex.columns)).astype(str), hide_index=True,
                     width="content")
if st.toggle("Show the raw evidence (JSON)", key="raw_evidence"):
    st.json({"verdicts": verdicts_of(row.to_dict()), "note": row.get("note", "")})
elif row.get("note") and row.get("verdict") not in ("clock_skew", "analysis_failed"):
    st.caption(f"Note: {md_escape(row['note'])}")

if not hangs.empty and not hang_first:
    show_hangs()

# -- history -------------------------------------------------------------------------------------------
st.subheader("History")
chosen = alt.Chart(hist[hist["key"] == wkey]).mark_point(size=140, shape="diamond", filled=True, color="#d62728")
tip = [alt.Tooltip("analysed:T", title="analysed (UTC)", format="%Y-%m-%d %H:%M:%S"), "window_id", "attempt",
       alt.Tooltip("slowdown:Q", format=".3f", title="S"), "verdict"]
span_s = (hist["analyzed_ns"].max() - hist["analyzed_ns"].min()) / 1e9
# Over time when the windows spread over time; windows analysed within minutes of each other (a backfill,
# a replay, the demo) would sit on one tick of a time axis, so they are spread by their first step instead.
x = (alt.X("analysed:T", title="analysed (UTC)", axis=alt.Axis(format="%b %d %H:%M", labelOverlap=True))
     if span_s >= 600 else alt.X("window_id:Q", title="window (first step)", axis=alt.Axis(tickMinStep=1)))
# One chart of three panels (S, step time, MFU) on one time axis: one chart for the browser to lay out, not
# three; each panel keeps its own y scale.
steps_long = hist.melt(id_vars=["analysed", "window_id", "attempt", "key"],
                       value_vars=["step_time_actual", "step_time_ideal"], var_name="kind", value_name="v")
steps_long["kind"] = steps_long["kind"].map({"step_time_actual": "step: actual", "step_time_ideal": "step: ideal"})
mfu_long = hist.melt(id_vars=["analysed", "window_id", "attempt", "key"], value_vars=["mfu", "mfu_ideal"],
                     var_name="kind", value_name="v").dropna(subset=["v"])
mfu_long["kind"] = mfu_long["kind"].map({"mfu": "MFU: achieved", "mfu_ideal": "MFU: without stragglers"})
colour = alt.Color("kind:N", title=None, legend=alt.Legend(orient="bottom", columns=4),
                   scale=alt.Scale(domain=["step: actual", "step: ideal", "MFU: achieved", "MFU: without stragglers"],
                                   range=["#1f77b4", "#9ecae1", "#2ca02c", "#98df8a"]))
panel = {"height": 200, "width": 250}
s_panel = alt.layer(
    alt.Chart(hist).mark_line(point=True).encode(
        x=x, y=alt.Y("slowdown:Q", title="S", scale=alt.Scale(zero=False)), tooltip=tip),
    chosen.encode(x=x, y="slowdown:Q")).properties(title="S per window", **panel)
t_panel = alt.Chart(steps_long).mark_line(point=True).encode(
    x=x, y=alt.Y("v:Q", title="seconds", scale=alt.Scale(zero=False)), color=colour,
    tooltip=[alt.Tooltip("analysed:T", format="%Y-%m-%d %H:%M:%S"), "window_id", "kind",
             alt.Tooltip("v:Q", format=".3f", title="s")]).properties(title="Step time (actual and ideal)", **panel)
# Change points of the job's step time (``ray_jobs.regressions``): a dashed line where each began.
regs = named("job_regressions", job_id=job)
marks = pd.DataFrame()
if not regs.empty:
    began = regs.merge(hist, left_on=["attempt", "began_window"], right_on=["attempt", "window_id"],
                       suffixes=("", "_w"))
    marks = began.assign(what=began["kind"].map({"regression": "slower", "recovered": "back",
                                                  "degraded_worker": "worker over its best"}))
    if not marks.empty:
        t_panel = alt.layer(t_panel, alt.Chart(marks).mark_rule(strokeDash=[5, 3], color="#d62728").encode(
            x=x, tooltip=["what", "summary"]))
panels = [s_panel, t_panel]
if not mfu_long.empty:
    panels.append(alt.Chart(mfu_long).mark_line(point=True).encode(
        x=x, y=alt.Y("v:Q", title="MFU", axis=alt.Axis(format="%")), color=colour,
        tooltip=[alt.Tooltip("analysed:T", format="%Y-%m-%d %H:%M:%S"), "window_id", "kind",
                 alt.Tooltip("v:Q", format=".1%", title="MFU")]).properties(
        title="MFU (achieved and without stragglers)", **panel))
st.altair_chart(alt.hconcat(*panels).resolve_scale(y="independent"), width="content")
if mfu_long.empty:
    st.caption("No MFU: the job registered no FLOPs (flops_per_token or params, tokens_per_step, peak FLOP/s).")
if regs.empty:
    st.caption("No regression against this job's own past: its step time has held (the dashed lines mark "
               "a change when there is one).")
else:
    st.markdown(f"**Against its own past** ({len(regs)} change{'s' if len(regs) > 1 else ''}, newest first)")
    for r in regs.to_dict("records"):
        badge = {"regression": "🔺 slower", "recovered": "🔻 back", "degraded_worker": "🔸 worker"}[r["kind"]]
        st.markdown(f"{badge} &nbsp; {md_escape(r['summary'])} &nbsp; "
                    f"<small>(confirmed in window {r['window_id']}, {ago(r['found_ns'], NOW)})</small>",
                    unsafe_allow_html=True)
    latest = regs[regs["kind"] == "regression"].head(1)
    if not latest.empty:
        # Where the time went before and after the newest regression: each op type's seconds per step.
        prof = named("job_profile", job_id=job)
        cut = int(latest["began_window"].iloc[0])
        cut_attempt = int(latest["attempt"].iloc[0])
        if not prof.empty:
            prof = prof[prof["optype"] != "step"]
            after = (prof["attempt"] > cut_attempt) | ((prof["attempt"] == cut_attempt) & (prof["window_id"] >= cut))
            side = after.map({True: "after", False: "before"})
            table = prof.assign(side=side).groupby(["optype", "side"])["seconds"].median().unstack("side")
            if {"before", "after"} <= set(table.columns):
                table = table.assign(change=table["after"] / table["before"] - 1).sort_values(
                    "after", ascending=False)
                st.caption(f"Op types, seconds per step (median per window), before and after window {cut}")
                st.dataframe(table.style.format({"before": "{:.4f}", "after": "{:.4f}", "change": "{:+.0%}"}),
                             width="stretch")

# -- workers and steps -------------------------------------------------------------------------------
steps = named("job_step_trend", job_id=job, window_id=wid)
if not steps.empty and "attempt" in steps:
    steps = steps[steps["attempt"] == attempt]
step_ids = [int(x) for x in steps["step"].tolist()] if "step" in steps else []

left, right = st.columns(2)
with left:
    st.subheader("Worker slowdown S_w (x = DP rank, y = PP rank)")
    pick = st.selectbox("Heatmap of", ["whole window"] + [f"step {s}" for s in step_ids], key="heat_step")
    hstep = -1 if pick == "whole window" else int(pick.split()[1])
    cells = named("job_workers", job_id=job, window_id=wid, step=hstep, attempt=attempt)
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

# -- remedies -------------------------------------------------------------------------------------------
REMEDIES = {"swap_host": "Swap the slow host", "repartition": "Move layers off the heavy stage",
            "repack": "Re-pack sequences by cost", "gc_interval": "Collect garbage on a plan",
            "drain_link": "Drain the slow link", "recovery_plan": "Recover on the nodes left"}
st.subheader("Remedies")
remedies = named("job_remedies", job_id=job, window_id=wid)
if st.button("Advise now (re-simulates this window with each fix)", key="advise"):
    msg = advise_window(job, attempt, wid)
    if msg:
        st.info(msg)
    remedies = named("job_remedies", job_id=job, window_id=wid)
if remedies.empty:
    st.write("No remedies stored for this window yet (windows with a verdict get them in the pipeline; "
             "`stragglerscope advise` or the button computes them on demand).")
for _, r in remedies.iterrows():
    gain = r["predicted_gain"]
    label = ("restores progress" if gain >= STORED_INF
             else f"{100 * gain:.1f}% faster steps" if gain == gain else "gain not simulated")
    name = REMEDIES.get(r["kind"], str(r["kind"]).replace("_", " ").capitalize())
    with st.expander(f"{int(r['priority'])}. {name}, for: {title(r['verdict']).lower()} · {label}",
                     expanded=int(r["priority"]) == 1):
        st.markdown(r["action"])
        c = st.columns(2)
        c[0].metric("Step time now", duration(r["step_time_before_s"]))
        after = r["step_time_after_s"]
        c[1].metric("Predicted after the fix", duration(after) if after < STORED_INF else "–")
        if st.toggle("Show the simulation's details (JSON)", key=f"remedy-json-{r['priority']}"):
            st.json(json.loads(r["details_json"] or "{}"))

# -- timeline ----------------------------------------------------------------------------------------
st.subheader("Actual vs simulated ideal timeline")
if not step_ids:
    st.write("No steps stored for this window.")
else:
    t1, t2 = st.columns([1, 1])
    tstep = t1.selectbox("Step", step_ids, key="tl_step")
    n_workers = t2.slider("Workers shown", 1, 32, 8, key="tl_workers")
    if st.toggle("Show the timeline (re-simulates the window from its stored op spans)", key="tl_on"):
        frame, doc = window_timeline(job, attempt, wid, int(tstep), int(n_workers))
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

# -- links ----------------------------------------------------------------------------------------------
st.subheader("Link matrix")
st.caption("Time per byte of every directed pair (pipeline sends matched with their receives, or per-peer times "
           "the library reported), and each collective group's time per byte once all members were in. "
           "Ratio: over the lower quartile of its class; slow at 3x. A fault is named by intersecting the slow "
           "and the healthy observations.")
every_link = named("job_links", job_id=job)
answer = job_finding(every_link[every_link["attempt"] == attempt].to_dict("records"), link_shown_confidence()) \
    if not every_link.empty else None
if answer is not None:  # the job's one answer over its windows (analyzers.links.job), then this window's own
    said = job_link_sentence(answer)
    st.markdown(f"**This job:** {md_escape(said[0].upper() + said[1:])}.")
links = named("job_links", job_id=job, window_id=wid)
if not links.empty:
    links = links[links["attempt"] == attempt]
if links.empty:
    st.write("No link fault found in this window (or no collective records were sampled).")
for _, f in links.iterrows():
    said = link_sentence(f.to_dict())  # analyzers.explain: as the alert and the trace summary say it
    st.markdown(md_escape(said[0].upper() + said[1:]))
    with st.expander("evidence (JSON)"):
        st.json(json.loads(f.get("evidence_json") or "{}"))
cells = named("job_link_cells", job_id=job, window_id=wid, attempt=attempt)
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

# -- fabric ports -----------------------------------------------------------------------------------------------
st.subheader("Fabric ports")
st.caption("The InfiniBand/RoCE port counters of the job's hosts (one rank per host reads them with its heartbeats), "
           "summed over the minutes around this window: transmit waits (data held for want of credits: congestion), "
           "discards, symbol and receive errors, link downs and recoveries (a flapping link).")
_w0, _w1 = int(row.get("start_ns", 0) or 0), int(row.get("end_ns", 0) or 0)
_ports = named("job_port_counters", job_id=job, attempt=attempt,
               since=max(0, _w0 - 60 * 10**9) if _w0 > 0 else None, until=_w1 + 60 * 10**9 if _w1 > 0 else None)
_said, _table = port_panel(_ports)
if _table.empty:
    st.write("No port counters from this job's hosts around this window (no InfiniBand, or not reported).")
for s in _said:
    st.markdown(md_escape(s[0].upper() + s[1:]))
if not _table.empty:
    st.dataframe(_table, width="stretch", hide_index=True)
