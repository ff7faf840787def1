"""Verdicts and hangs in words (analyzers/explain.py): one wording per kind, with the figures of its evidence."""
import json
import re
from pathlib import Path

import pytest

from analyzers import explain as X

# Evidence as analyzers/whatif/verdicts.py stores it (taken from the demo fleet's analyses).
WORKER = {"kind": "worker", "score": 1.0467, "summary": "1 worker(s) (dp1/pp3) cause 100% of the 29.5% slowdown",
          "evidence": {"M_W": 1.0467, "S": 1.2953, "tideal": 0.72249, "tori": 0.93586, "trem": 0.71253,
                       "top_workers": [{"S_w": 1.2953, "dp_rank": 1, "pp_rank": 3}]}}
STAGE = {"kind": "last_stage_imbalance", "score": 1.04, "summary": "the last pipeline stage causes ...",
         "evidence": {"M_S": 1.0446, "S": 1.2953, "S_pp": {"0": 0.9978, "1": 0.9951, "2": 0.996, "3": 1.2993},
                      "S_pp_last": 1.2993, "tideal": 0.72249, "tori": 0.93586, "trem": 0.71297}}
SEQ = {"kind": "sequence_imbalance", "score": 0.75, "summary": "forward and backward times ...",
       "evidence": {"S": 1.2994, "S_backward": 1.2254, "S_forward": 1.0779, "corr_fwd_bwd": 0.996, "cv_fwd": 0.29,
                    "pairs": 384}}
GC = {"kind": "gc", "score": 0.99, "summary": "garbage-collection pauses ...",
      "evidence": {"S": 1.7528, "S_gc": 1.7468, "gc_growth_corr": 0.72, "gc_hit_fraction": 0.1042, "gc_max_ms": 396.486,
                   "gc_mean_ms": 26.007, "gc_ops": 48, "gc_ops_nonzero": 5}}
COMM = {"kind": "communication", "score": 0.6, "summary": "grads-reduce-scatter is the largest ...",
        "evidence": {"optype": "grads-reduce-scatter", "S_t": 1.3, "S": 1.5,
                     "by_optype": {"forward-compute": 1.01, "grads-reduce-scatter": 1.3, "optimizer": 1.0}}}


def test_the_verdict_threshold_is_the_analyzers_own():
    from analyzers.whatif.verdicts import MIN_SLOWDOWN

    assert X.MIN_SLOWDOWN == MIN_SLOWDOWN


def test_every_verdict_kind_the_analysis_gives_has_its_own_wording():
    src = (Path(X.__file__).parent / "whatif" / "verdicts.py").read_text()
    kinds = set(re.findall(r'"kind": "(\w+)"', src))
    assert kinds == {"worker", "last_stage_imbalance", "sequence_imbalance", "gc", "communication"}
    assert kinds <= set(X._VERDICTS) and kinds <= set(X.TITLES)


def test_worker():
    e = X.explain_verdict(WORKER)
    assert e.title == "Slow worker"
    assert e.sentence.startswith("Worker dp1/pp3 is the straggler: the job runs 29.5% slower than its ideal "
                                 "(S = 1.295), and fixing it alone would remove 100% of that; the mean step would "
                                 "drop from 936 ms to 713 ms (ideal 722 ms).")
    assert e.columns == ("worker", "DP rank", "PP rank", "S_w") and e.rows == (("dp1/pp3", 1, 3, "1.295"),)
    many = dict(WORKER, evidence=dict(WORKER["evidence"], M_W=0.8, top_workers=[
        {"S_w": 1.1 + i / 100, "dp_rank": i, "pp_rank": 0} for i in range(6)]))
    e = X.explain_verdict(many)
    assert e.sentence.startswith("6 workers are the stragglers (dp5/pp0, dp4/pp0, dp3/pp0, dp2/pp0 and 2 more)")
    assert "would remove 80% of that" in e.sentence and e.rows[0][0] == "dp5/pp0"


def test_last_stage_imbalance():
    e = X.explain_verdict(STAGE)
    assert e.title == "Last pipeline stage too heavy"
    assert ("The last pipeline stage (pp3) is too heavy: it runs at S_pp = 1.299 while the other 3 stages run at "
            "0.995 to 0.998. Rebalancing its layers would remove 100% of the slowdown") in e.sentence
    assert e.rows == (("pp3 (last)", "1.299"), ("pp0", "0.998"), ("pp2", "0.996"), ("pp1", "0.995"))
    two = X.explain_verdict(dict(STAGE, evidence=dict(STAGE["evidence"], S_pp={"0": 0.98, "1": 1.18})))
    assert "while the other stage runs at 0.980." in two.sentence


def test_sequence_imbalance_gc_and_communication():
    e = X.explain_verdict(SEQ)
    assert e.title == "Uneven sequence lengths"
    assert "(correlation r = 0.996 over 384 microbatches; forward times vary by 29% around their mean)" in e.sentence
    assert "Forward compute runs at S = 1.078 and backward at S = 1.225" in e.sentence
    assert e.rows == (("forward-compute", "1.078"), ("backward-compute", "1.225"))
    e = X.explain_verdict(GC)
    assert ("5 of 48 collection points paused the job (10%), 26.0 ms on average and up to 396 ms. GC alone slows "
            "it to S_gc = 1.747, 99% of the slowdown") in e.sentence
    assert "The pauses grow over the window (r = 0.72)" in e.sentence
    e = X.explain_verdict(COMM)
    assert "grads-reduce-scatter runs at S_t = 1.300, 60% of the slowdown; the job runs 50.0% slower" in e.sentence
    assert e.rows[0] == ("grads-reduce-scatter", "1.300")


def test_an_unknown_kind_or_evidence_of_another_shape_reads_as_the_stored_summary():
    e = X.explain_verdict({"kind": "stage", "summary": "stage 3 is slow", "evidence": {}})
    assert (e.title, e.sentence) == ("Stage", "Stage 3 is slow.")
    e = X.explain_verdict(dict(WORKER, evidence={"top_workers": "not a list"}))
    assert e.sentence == "1 worker(s) (dp1/pp3) cause 100% of the 29.5% slowdown."
    assert X.explain_verdict(dict(SEQ, evidence={})).sentence.count("n/a") >= 2  # figures missing, no error


def test_windows_without_a_verdict_say_why():
    row = {"verdicts_json": json.dumps([WORKER, STAGE]), "verdict": "worker"}
    assert [e.kind for e in X.explain_window(row)] == ["worker", "last_stage_imbalance"]
    skew = X.explain_window({"verdict": "clock_skew", "verdicts_json": "[]", "note": (
        "clock skew: dp1/pp0 +10800.0 s, dp1/pp1 -12.5 s off the other workers (more than 2.0 s): window not "
        "analysed, left out of fleet statistics")})[0]
    assert skew.title == "Clocks out of step"
    assert skew.sentence.startswith("The clocks of 2 workers sit far off the others' (dp1/pp0 by +3.0 h, "
                                    "dp1/pp1 by -12 s)")
    assert skew.rows == (("dp1/pp0", "+3.0 h"), ("dp1/pp1", "-12 s"))
    failed = X.explain_window({"verdict": "analysis_failed", "verdicts_json": "[]", "note": "ValueError: bad op"})
    assert failed[0].sentence == ("The analysis of this window failed: ValueError: bad op. The window is stored and "
                                  "left out of fleet statistics.")
    assert X.explain_window({"verdict": "no_op_spans", "note": ""})[0].title == "Links only (no op spans)"
    none = X.explain_window({"verdict": "", "verdicts_json": "[]", "slowdown": 1.012})[0]
    assert none.title == "No straggling"
    assert none.sentence.startswith("The job runs 1.2% slower than its ideal (S = 1.012): below 1.05")
    slow = X.explain_window({"verdict": "", "verdicts_json": "[]", "slowdown": 1.871})[0]
    assert slow.title == "No single cause" and "below" not in slow.sentence, slow  # never "S = 1.87: below 1.05"
    assert X.explain_window({"verdict": "", "slowdown": float("nan"), "note": "n"})[0].title == "Not analysed"


def test_lines_for_a_terminal():
    lines = X.explain_verdict(STAGE).lines(max_rows=2)
    assert lines[0].startswith("Last pipeline stage too heavy: The last pipeline stage (pp3)")
    assert lines[1:] == ["  stage       S_pp", "  pp3 (last)  1.299", "  pp0         0.998", "  ... 2 more"]
    assert X.explain_verdict(GC).lines() == [X.explain_verdict(GC).lines()[0]]  # no table, one line


def _hang(kind, stuck, missing, rows, group="world", seq=767, op="all_reduce", hosts="node-0003", dur=300.0):
    return {"kind": kind, "group": group, "seq": seq, "op": op, "stuck_ranks": stuck, "missing_ranks": missing,
            "suspect_hosts": hosts, "duration_s": dur, "evidence_json": json.dumps({"wait_chain": {"rows": rows}})}


LAYOUT = {"dp_size": 8, "pp_size": 2, "tp_size": 4, "cp_size": 1}


def test_rank_coordinates_follow_megatrons_order():
    sizes = X.layout_sizes(LAYOUT)
    assert X.rank_coords(0, sizes) == {"tp": 0, "cp": 0, "dp": 0, "pp": 0}
    assert X.rank_coords(29, sizes) == {"tp": 1, "cp": 0, "dp": 7, "pp": 0}
    assert X.rank_coords(33, sizes) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    assert X.where(29, sizes) == "dp 7, pp 0, tp 1"
    assert X.layout_sizes(None, 6) == {"dp": 6, "pp": 1, "tp": 1, "cp": 1}
    assert X.parse_ranks("0-3,5,x,a-b") == [0, 1, 2, 3, 5]


def test_hangs_in_words():
    rows = [{"ranks": "0-28,30-63", "op": "all_reduce", "group": "world", "seq": 767, "waits_for": "29"},
            {"ranks": "29", "op": "forward-compute", "group": "", "seq": -1, "waits_for": ""}]
    e = X.explain_hang(_hang("comm_hang", "0-28,30-63", "29", rows), LAYOUT)
    assert e.sentence == ("63 ranks have waited in all_reduce #767 of group world for 5 min; rank 29 (dp 7, pp 0, "
                          "tp 1) on node-0003 never entered it: it is the culprit. Last seen in forward-compute.")
    assert e.rows[1] == ("29", "last seen in forward-compute", "–")
    # A chain: the ranks wait in other collectives, on ranks that wait on the culprit.
    chain = [{"ranks": "0", "op": "all_reduce", "group": "ranks:0-1", "seq": 5, "waits_for": "1"},
             {"ranks": "1", "op": "send", "group": "p2p:1>3", "seq": 19, "waits_for": ""},
             {"ranks": "2", "op": "all_reduce", "group": "ranks:2-3", "seq": 5, "waits_for": "3"},
             {"ranks": "3", "op": "recv", "group": "p2p:1>3", "seq": 20, "waits_for": "1"}]
    e = X.explain_hang(_hang("comm_hang", "0,2-3", "1", chain, group="p2p:1>3", seq=20, op="recv", hosts="vm",
                             dur=8.5), {"dp_size": 2, "pp_size": 2})
    assert e.sentence == ("3 ranks wait in collectives, with no progress for 8.5 s. Their chain of waits ends at "
                          "recv #20 of group p2p:1>3 (1 rank in it), which rank 1 (dp 1, pp 0) on vm never entered: "
                          "it is the culprit. Last seen in send #19 of group p2p:1>3.")
    e = X.explain_hang(_hang("comm_hang", "0-3", "", rows[:1]))
    assert e.sentence.startswith("Every member entered all_reduce #767 of group world and none has left it for 5 min")
    e = X.explain_hang(_hang("node_loss", "0-7,16-31", "8-15", [], group="", seq=-1, op="", dur=45))
    assert e.sentence == ("ranks 8-15 on node-0003 stopped sending heartbeats 45 s ago: its host is lost. The other "
                          "24 ranks cannot go on without them.")
    e = X.explain_hang(_hang("noncomm_hang", "27", "", [], group="", seq=-1, op="data-loading"), LAYOUT)
    assert "rank 27 (dp 6, pp 0, tp 3) on node-0003 has been in data-loading the longest: the suspect" in e.sentence
    e = X.explain_hang(_hang("noncomm_hang", "0-63", "", [], group="", seq=-1, op=""))
    assert e.sentence.endswith("the whole job is suspect.")


@pytest.mark.parametrize("seconds, text", [(0.0456, "45.6 ms"), (0.713, "713 ms"), (8.49, "8.5 s"), (45, "45 s"),
                                           (300, "5 min"), (3 * 3600, "3.0 h"), (3 * 86400, "3.0 days"),
                                           (None, "n/a"), (float("nan"), "n/a")])
def test_durations(seconds, text):
    assert X.duration(seconds) == text


def test_terminal_lines_for_the_trace_summary():
    lines = X.window_lines({"verdicts_json": json.dumps([WORKER, STAGE])}, width=80)
    assert lines[0].startswith("  verdict  Slow worker: Worker dp1/pp3 is the straggler")
    assert all(len(line) <= 80 for line in lines)
    assert not any(re.search(r"\d$", line) for line in lines[:4])  # '722 ms' is never cut between its parts
    assert "      dp1/pp3  1        3        1.295" in lines
    assert any(line.strip().startswith("pp3 (last)") for line in lines)
    rows = [{"ranks": "0,2-3", "op": "all_reduce", "group": "world", "seq": 5, "waits_for": "1"}]
    hang = X.hang_lines(_hang("comm_hang", "0,2-3", "1", rows, seq=5, dur=8.5), {"dp_size": 2, "pp_size": 2})
    assert hang[0].startswith("hang     Communication hang: 3 ranks have waited in all_reduce #5 of group world")


def test_a_link_finding_is_worded_once_for_the_alert_the_console_and_the_trace_summary():
    """Issue 51: the same finding was put into words in three places (ray_jobs/alerts.py, the console's job page,
    stragglerscope/trace.py), differently."""
    from analyzers.explain import link_element, link_sentence
    from core.config import AlertConfig
    from ray_jobs.alerts import AlertRules

    row = dict(job_id="j", attempt=0, window_id=8, group="world", kind="source", src=3, dst=-1, slowdown=4.2,
               confidence=0.95, evidence_json='{"persistence": {"found_before": 0}}')
    said = link_sentence(row)
    assert said == ("the NIC of rank 3 (its egress) is slow (4.2x slower than the job's other transfers, confidence "
                    "0.95, from world; found in window 0 too)")
    [alert] = AlertRules(AlertConfig()).evaluate_links([row], 0.0, 0)
    assert link_element("source", 3, -1) in alert["summary"]
    for kind in ("source", "destination", "link", "endpoint", "comm_slow", "noncomm_slow"):
        assert link_element(kind, 1, 2, "world") != f"{kind} 1>2"


def test_a_late_sender_is_worded_with_its_margin_in_ms_and_as_a_share_of_its_step():
    """Issue 52: a late sender is said by how late it came against its step and the job's jitter, not as 'slow'."""
    from analyzers.explain import link_sentence

    ev = ('{"margin_ns": 40.2e6, "step_ns": 0.62e9, "margin_share_of_step": 0.0648, "jitter_ns": 3.1e6, '
          '"late_steps": 5, "steps": 5, "persistence": {"first_seen": true}}')
    exchange = ev.replace('"late_steps"', '"exchange_peers": [5, 7], "late_steps"')
    row = dict(group="", kind="noncomm_slow", src=6, dst=-1, slowdown=12.9, confidence=0.5, evidence_json=ev)
    assert link_sentence(row) == ("rank 6, late to communicate (its own compute or input, not the network): 40 ms "
                                  "after the others (6.5% of its 0.62 s step) in 5 of 5 steps, beyond the job's "
                                  "jitter of 3 ms (confidence 0.50, from collectives; first seen in this window)")
    said = link_sentence({**row, "evidence_json": exchange})
    assert "40 ms after its exchange peers 5 and 7 (6.5% of its 0.62 s step)" in said and "from exchanges;" in said
    work = link_sentence({**row, "evidence_json": exchange.replace('"late_steps"', '"late_by": "work", "late_steps"')})
    assert ("40 ms more work between exchanges than the job's median rank (6.5% of its 0.62 s step) in 5 of 5 "
            "steps" in work and "from exchanges;" in work), work
    assert link_sentence({**row, "evidence_json": "{}"}).startswith("rank 6, late to communicate (its own compute")
