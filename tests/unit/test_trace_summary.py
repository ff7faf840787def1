"""The trace summary's words for a window that could not be analysed (issue 55): said so, and why in full,
never 'S = nan, waste nan%' and a reason cut mid-word."""
from __future__ import annotations

import math

from analyzers.explain import window_lines
from stragglerscope.trace import window_header

CYCLE = ("WhatIfInputError: dependency cycle: " + " -> ".join(
    f"step 8 dp0/pp0 {kind}-compute #{i}" for i in range(3) for kind in ("backward", "forward"))
         + " (+5 more); the trace's op order is inconsistent")


def failed_window(note: str = CYCLE) -> dict:
    nan = math.nan
    return dict(window_id=8, first_step=8, last_step=15, complete=False, slowdown=nan, waste_fraction=nan,
                step_time_actual=nan, step_time_ideal=nan, launch_slowdown=nan, verdict="analysis_failed",
                verdicts_json="[]", note=note)


def test_a_failed_window_says_it_was_not_analysed_and_why_in_full():
    w = failed_window()
    assert window_header(w) == "window 8 (steps 8-15): not analysed (analysis failed)"
    text = " ".join(line.strip() for line in window_lines(w))
    assert "nan" not in window_header(w) and "…" not in text
    assert "the trace's op order is inconsistent. The window is stored" in text
    assert len(CYCLE) > 300  # longer than the cut it used to get


def test_an_analysed_window_keeps_its_figures():
    w = dict(failed_window(), slowdown=1.2345, waste_fraction=0.19, step_time_actual=1.1, step_time_ideal=0.9,
             launch_slowdown=1.01, complete=True, verdict="worker")
    assert window_header(w) == ("window 8 (steps 8-15, complete): S = 1.234, waste 19.0%, step 1.100 s actual vs "
                                "0.900 s ideal (fidelity 1.010)")


def test_trace_help_names_every_layout_key_it_accepts():
    import re

    from ingest.autotrace.session import _LAYOUT_KEYS, parse_layout
    from stragglerscope.cli import build_parser

    parser = build_parser()
    trace = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(" trace"))
    text = " ".join(trace.format_help().split())
    layout = re.search(r"--layout (\S+) (.*?) --sample", text)
    for key in [*_LAYOUT_KEYS, "order"]:
        assert f"{key}=" in layout.group(1), key
    # ... and what the metavar shows parses
    assert parse_layout("dp=2,pp=2,tp=1,cp=1,vpp=2,order=pp,dp") == dict(
        dp_size=2, pp_size=2, tp_size=1, cp_size=1, vpp_size=2, order="pp,dp")
