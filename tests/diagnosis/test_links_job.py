"""One answer per job (issue 52): the link finding the job's windows support, said first; windows that named two
elements of one rank are resolved to that rank, not printed side by side."""
from __future__ import annotations

from analyzers.explain import job_link_sentence
from analyzers.links.job import job_finding
from core.config import AlertConfig
from stragglerscope.trace import summarize

SHOWN = AlertConfig().link_shown_confidence


def row(window, kind, src, dst, conf=0.5, slowdown=3.0, group="world"):
    return dict(attempt=0, window_id=window, group=group, kind=kind, src=src, dst=dst, confidence=conf,
                slowdown=slowdown, evidence_json="{}")


def test_the_element_most_windows_name_is_the_answer_with_its_support():
    rows = [row(w, "source", 3, -1, 0.9) for w in (0, 5, 10, 15, 20)] + [row(25, "link", 3, 4, 0.95)]
    rows += [row(5, "comm_slow", -1, -1, 0.3), row(10, "link", 0, 1, 0.1)]  # not a window's vote / not shown
    f = job_finding(rows, SHOWN)
    assert (f.kind, f.src, f.windows, f.voting, f.since) == ("source", 3, (0, 5, 10, 15, 20), 6, 0)
    said = job_link_sentence(f)
    assert said.startswith("the NIC of rank 3 (its egress), in 5 of 6 windows with a finding since window 0")
    assert "also named: the link from rank 3 to rank 4 (1)" in said


def test_a_late_sender_s_job_answer_says_how_late():
    import json

    def late(window, ms, share, conf=0.7):
        r = row(window, "noncomm_slow", 6, -1, conf)
        return {**r, "evidence_json": json.dumps({"margin_ns": ms * 1e6, "margin_share_of_step": share})}
    f = job_finding([late(0, 40, 0.064), late(5, 38, 0.061), late(10, 44, 0.07)], SHOWN)
    assert f.kind == "noncomm_slow" and f.late_by[0] == 40e6 and abs(f.late_by[1] - 0.064) < 1e-12
    said = job_link_sentence(f)
    assert ", 40 ms late (6.4% of its step), in 3 of 3 windows" in said, said
    # Evidence without a margin (an older store's rows): the answer as before, no made-up figure.
    g = job_finding([row(0, "noncomm_slow", 6, -1, 0.7)], SHOWN)
    assert g.late_by is None and "ms late" not in job_link_sentence(g)


def test_windows_that_differ_on_one_rank_s_direction_are_that_rank_s_network():
    """As reported: window 0 'NIC of rank 2', window 15 'link 2>1'; window 0 'ingress of rank 5', window 15
    'link 5>4' (its ACKs come back in through the capped port)."""
    f = job_finding([row(0, "source", 2, -1, 0.5), row(15, "link", 2, 1, 0.5)], SHOWN)
    assert (f.kind, f.src, f.windows) == ("endpoint", 2, (0, 15))
    assert "the network of rank 2: every window with a finding named it" in job_link_sentence(f)
    g = job_finding([row(0, "destination", -1, 5, 0.6), row(15, "link", 5, 4, 0.5)], SHOWN)
    assert (g.kind, g.src) == ("endpoint", 5)
    # A majority is an answer of its own, even where the others share the rank.
    h = job_finding([row(w, "destination", -1, 5, 0.6) for w in (0, 5, 10)] + [row(15, "link", 5, 4, 0.5)], SHOWN)
    assert (h.kind, h.dst, len(h.windows)) == ("destination", 5, 3)


def test_unrelated_elements_are_not_merged_and_nothing_shown_is_no_answer():
    f = job_finding([row(0, "link", 1, 2, 0.6), row(5, "source", 5, -1, 0.5)], SHOWN)
    assert (f.kind, f.src, f.dst) == ("link", 1, 2) and f.others == (("source", 5, -1, 1),)
    assert job_finding([row(0, "link", 1, 2, 0.2)], SHOWN) is None and job_finding([], SHOWN) is None


class _Store:
    """The named queries ``summarize`` reads, as the store answers them."""

    def __init__(self, links):
        self.links = links

    def run_named(self, name, params):
        import pyarrow as pa

        rows = {"job_links": self.links, "job_windows": [dict(
            attempt=0, window_id=w, first_step=w, last_step=w + 4, complete=True, slowdown=1.0,
            waste_fraction=0.0, step_time_actual=1.0, step_time_ideal=1.0, launch_slowdown=1.0, verdict="",
            verdicts_json="[]", note="", wasted_gpu_hours=0.0, gpu_hours=1.0) for w in (0, 15)]}.get(name, [])
        return pa.Table.from_pylist(rows) if rows else pa.table({"x": pa.array([], pa.int64())})


def test_the_trace_summary_leads_with_the_job_s_answer_then_each_window_s_findings():
    links = [row(0, "source", 2, -1, 0.5), row(15, "link", 2, 1, 0.5)]
    layout = dict(dp_size=8, pp_size=1, tp_size=1, cp_size=1, vpp_size=1)
    text = summarize(_Store(links), "j", 0, [dict(layout=layout, steps=20)])
    first = text.index("network: the network of rank 2")
    assert first < text.index("window 0 (steps") < text.index("network  the NIC of rank 2")
    assert text.index("window 15 (steps") < text.index("network  the link from rank 2 to rank 1")
