"""The "Change at run time" form of the Job and Fleet pages: `stragglerscope control set|clear` in the console.

Offered only when the console was started with control on (``actions.control.console_control_off``: the
fleet's Kafka and ``ui.control_token_file``); without the file the console stays read-only and shows nothing
of it. A change is published only after the token typed matches the file's (compared in constant time), and goes
through ``control_set`` / ``control_clear``, the command line's own functions: the console refuses what the
command refuses, with the same one-line reason, and a refused change publishes nothing.
"""
from __future__ import annotations

import streamlit as st

from core.control import SETTINGS, ControlError
from ui.readable import md_escape

# The exporter's three settings get widgets of their own. Every other setting is typed as text and handed to the
# one check as typed, so that its range and its reason for refusing come from core.control, not from a widget.
OWN_WIDGETS = ("sample", "profiling", "heartbeat_s")
PROFILING = {"unchanged": None, "resume (on)": "on", "pause (paused)": "paused"}


def thresholds(job_id: str | None) -> list:
    """The settings the form lists as thresholds: a job's scope leaves out the fleet-only ones (lemon hosts),
    which nothing would apply for one job."""
    return [s for s in SETTINGS.values()
            if s.name not in OWN_WIDGETS and not (job_id is not None and s.fleet_only)]


def control_form(job_id: str | None) -> None:
    """The form for ``job_id`` (None: the fleet), or nothing when the console is read-only."""
    from core.config import load
    from actions.control import console_control_off

    cfg = load()
    if not cfg.ui.control_token_file:
        return  # read-only, the default
    st.subheader("Change at run time")
    why = console_control_off(cfg)
    if why:  # asked for but unusable (the console command refuses this at start; the file may change after)
        st.warning(f"Run-time control is off: {md_escape(why)}")
        return
    key = "ctl_job" if job_id else "ctl_fleet"
    scope = "this job" if job_id else "the fleet"
    with st.form(key):
        st.caption(f"For {scope}" + (" (the fleet's changes apply to it too; its own win)" if job_id else
                                      " (every job; a job's own changes win over these)")
                   + ". Leave a field blank to keep it as it is. The whole change is checked as "
                     "`stragglerscope control set` checks it, and published whole or not at all.")
        c = st.columns(3)
        typed = {"sample": c[0].text_input("Sampling K/N", key=f"{key}_sample",
                                           placeholder="unchanged (1/1: every step)", help=SETTINGS["sample"].doc),
                 "heartbeat_s": c[2].text_input("Heartbeat period, s", key=f"{key}_heartbeat_s",
                                                placeholder="unchanged", help=SETTINGS["heartbeat_s"].doc)}
        profiling = c[1].selectbox("Profiling", list(PROFILING), key=f"{key}_profiling",
                                   help=SETTINGS["profiling"].doc)
        st.markdown("**Thresholds**")
        cols = st.columns(3)
        for i, s in enumerate(thresholds(job_id)):
            typed[s.name] = cols[i % 3].text_input(s.name, key=f"{key}_{s.name}", placeholder="unchanged",
                                                   help=s.doc)
        c = st.columns(3)
        minutes = c[0].number_input("For how many minutes (0: until cleared)", min_value=0, value=0, step=10,
                                    key=f"{key}_minutes")
        who = c[1].text_input("Your name", key=f"{key}_who", help="Stored with the change: who made it.")
        token = c[2].text_input("Control token", type="password", key=f"{key}_token",
                                help="The token of ui.control_token_file, from whoever runs the console.")
        b = st.columns(2)
        apply = b[0].form_submit_button("Publish the change")
        clear = b[1].form_submit_button(f"Clear {'this job' if job_id else 'the fleet'}'s changes",
                                        help="Ends every change of this scope still in force; the fields above "
                                             "are not used.")
    if apply or clear:
        what = {name: value.strip() for name, value in typed.items() if value.strip()}
        if PROFILING[profiling] is not None:
            what["profiling"] = PROFILING[profiling]
        _submit(cfg, job_id, what, float(minutes) * 60, who.strip(), token, clear)


def _submit(cfg, job_id: str | None, what: dict, for_s: float, who: str, token: str, clear: bool) -> None:
    from core.kafka_admin import BrokerError
    from actions.control import control_clear, control_set, token_matches
    from ui.data import named_live, require_known_job

    nothing = "  \nNothing was published."
    try:  # the token first: who is not authorised learns nothing of what would have been refused
        if not token_matches(token, cfg.ui.control_token_file):
            st.error("Refused: wrong control token." + nothing)
            return
    except ControlError as e:
        st.error(f"Refused: {md_escape(str(e))}" + nothing)
        return
    if not who:
        st.error("Refused: type your name (every change says who made it)." + nothing)
        return
    try:
        if clear:
            change = control_clear(cfg.kafka.conn(), who, job_id)
        else:
            change = control_set(cfg.kafka.conn(), who, job_id, what, for_s,
                                 require_known_job if job_id else None)
    except ControlError as e:
        st.error(f"Refused: {md_escape(str(e))}" + nothing)
        return
    except BrokerError as e:
        st.error(f"Not published: {md_escape(str(e))}")
        return
    named_live.clear()  # the changes table reads the store again (the shards store the change as they read it)
    if clear:
        said = f"cleared every change of {'this job' if job_id else 'the fleet'}"
    else:
        said = change.describe() + (f" for {for_s / 60:g} min" if for_s else " until cleared")
    st.success(md_escape(f"Published change {change.change_id}: {said} (by {who}). The ranks and the pipeline "
                         "apply it as they read the control topic."))
