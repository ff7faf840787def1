"""A link finding keeps its window's confidence only where the job's window before found it too."""
from __future__ import annotations

from analyzers.links.fault import LinkFault
from analyzers.links import fault_table
from analyzers.links.history import FIRST_SEEN_CAP, LATE_FIRST_SEEN_CAP, FindingHistory, found_before, found_in
from core.config import AlertConfig


def _faults(window, *found, job="j", alternative=None):
    """A window's findings as the link diagnosis makes them (``window``, ``job``: where the test's caller files
    them; ``alternative``: the element each named beside it)."""
    ev = {"candidates": ["x"], **({"alternative_element": list(alternative)} if alternative else {})}
    return [LinkFault("tcp", k, s, d, c, 3.0, ev) for k, s, d, c in found]


def _top(faults):
    f = faults[0]
    return (f.kind, f.src, f.dst, f.confidence), f.evidence


def test_a_finding_of_one_window_is_capped_and_one_that_comes_back_keeps_its_confidence():
    h = FindingHistory()
    (found, ev) = _top(h.weigh(("j", 0, 0), _faults(0, ("link", 3, 4, 0.98))))
    assert found == ("link", 3, 4, FIRST_SEEN_CAP) and ev["persistence"] == {"first_seen": True,
                                                                             "window_confidence": 0.98}
    assert ev["candidates"] == ["x"]  # the analysis' evidence is kept
    (found, ev) = _top(h.weigh(("j", 0, 6), _faults(6, ("link", 3, 4, 1.0))))
    assert found == ("link", 3, 4, 1.0) and ev["persistence"] == {"found_before": 0}


def test_a_healthy_rank_last_in_one_window_only_stays_low_and_another_element_is_not_confirmed():
    """As recorded on the 2-core VM: a healthy 8-rank job's rank 4 last everywhere in window 0 (1.00), rank 2 in
    window 6 (1.00), nothing in the other window."""
    h = FindingHistory()
    assert _top(h.weigh(("j", 0, 0), _faults(0, ("noncomm_slow", 4, -1, 1.0))))[0][3] == LATE_FIRST_SEEN_CAP
    assert _top(h.weigh(("j", 0, 6), _faults(6, ("noncomm_slow", 2, -1, 1.0))))[0][3] == LATE_FIRST_SEEN_CAP
    # A window without findings confirms nothing in the next.
    assert h.weigh(("j", 0, 12), _faults(12)) == []
    assert _top(h.weigh(("j", 0, 18), _faults(18, ("noncomm_slow", 2, -1, 1.0))))[0][3] == LATE_FIRST_SEEN_CAP
    # One window's late sender is a hint, not printed; the second window's is the answer.
    assert LATE_FIRST_SEEN_CAP < AlertConfig.link_shown_confidence <= FIRST_SEEN_CAP
    assert _top(h.weigh(("j", 0, 24), _faults(24, ("noncomm_slow", 2, -1, 1.0))))[0][3] == 1.0


def test_the_order_follows_the_weighed_confidence_and_jobs_do_not_confirm_each_other():
    h = FindingHistory()
    h.weigh(("j", 0, 0), _faults(0, ("source", 1, -1, 0.9)))
    t = h.weigh(("j", 0, 1), _faults(1, ("destination", -1, 0, 0.95), ("source", 1, -1, 0.7)))
    assert [(f.kind, f.confidence) for f in t] == [("source", 0.7), ("destination", 0.5)]
    assert _top(h.weigh(("k", 0, 1), _faults(1, ("source", 1, -1, 0.9), job="k")))[0][3] == FIRST_SEEN_CAP
    # A window finishing after a later one is judged against the latest earlier window it finds.
    h.weigh(("m", 0, 6), _faults(6, ("link", 0, 2, 0.9), job="m"))
    assert _top(h.weigh(("m", 0, 0), _faults(0, ("link", 0, 2, 0.9), job="m")))[0][3] == FIRST_SEEN_CAP


def test_history_is_bounded():
    h = FindingHistory(max_jobs=3)
    for j in range(10):
        for w in range(10):
            h.weigh((f"j{j}", 0, w), _faults(w, ("link", 0, 1, 0.9), job=f"j{j}"))
    assert len(h._seen) == 3 and all(len(v) <= 4 for v in h._seen.values())


def test_the_history_survives_a_shard_restart():
    """Issue 51: a restarted shard judged the next window alone (the history lived in memory only): a finding
    the window before had made was capped as first seen."""
    import pickle

    before = FindingHistory()
    before.weigh(("j", 0, 0), _faults(0, ("link", 2, 3, 0.9)))
    # What the shard's snapshot stores (ray_jobs.state encodes with pickle), into a new shard's history.
    after = FindingHistory()
    after.restore(pickle.loads(pickle.dumps(before.state())))
    (found, ev) = _top(after.weigh(("j", 0, 8), _faults(8, ("link", 2, 3, 0.9))))
    assert found == ("link", 2, 3, 0.9) and ev["persistence"] == {"found_before": 0}
    (found, _) = _top(FindingHistory().weigh(("j", 0, 8), _faults(8, ("link", 2, 3, 0.9))))
    assert found[3] == FIRST_SEEN_CAP  # without it: judged alone


def test_the_alternative_a_window_named_is_confirmed_by_the_next_and_nothing_else_is():
    h = FindingHistory()
    h.weigh(("j", 0, 0), _faults(0, ("source", 5, -1, 0.48), alternative=("link", 5, 4)))
    (found, ev) = _top(h.weigh(("j", 0, 6), _faults(6, ("link", 5, 4, 0.97))))
    assert found == ("link", 5, 4, 0.97) and ev["persistence"] == {"found_before": 0}
    # The reverse link, and the alternative of a finding under SEEN, confirm nothing.
    h = FindingHistory()
    h.weigh(("j", 0, 0), _faults(0, ("source", 5, -1, 0.48), alternative=("link", 5, 4)))
    assert _top(h.weigh(("j", 0, 6), _faults(6, ("link", 4, 5, 0.97))))[0][3] == FIRST_SEEN_CAP
    h = FindingHistory()
    h.weigh(("j", 0, 0), _faults(0, ("source", 5, -1, 0.2), alternative=("link", 5, 4)))
    assert _top(h.weigh(("j", 0, 6), _faults(6, ("link", 5, 4, 0.97))))[0][3] == FIRST_SEEN_CAP


def test_the_shard_reads_the_alternative_back_from_the_stored_rows():
    """The shard records what a window found from its LINK_FAULT table (``found_in``), not from the findings."""
    rows = fault_table(_faults(0, ("source", 5, -1, 0.48), alternative=("link", 5, 4)), ("j", 0, 0))
    assert found_in(rows) == {("source", 5, -1), ("link", 5, 4)}
    assert found_before({"evidence_json": "not json"}) is None and found_before({"evidence_json": "[1]"}) is None


def test_a_rank_s_network_named_without_its_direction_is_confirmed_by_its_nic_or_its_ingress():
    """A two-level all-reduce's ingress of rank 6 at 40mbit: window 0 'endpoint 6' (egress or ingress, the
    collectives cannot tell) at 0.52, window 6 'destination 6' at 0.97 from the flows."""
    for later in (("destination", -1, 6, 0.97), ("source", 6, -1, 0.97)):
        h = FindingHistory()
        h.weigh(("j", 0, 0), _faults(0, ("endpoint", 6, 6, 0.52)))
        assert _top(h.weigh(("j", 0, 6), _faults(6, later)))[0] == later
    h = FindingHistory()
    h.weigh(("j", 0, 0), _faults(0, ("endpoint", 6, 6, 0.52)))
    assert _top(h.weigh(("j", 0, 6), _faults(6, ("destination", -1, 5, 0.97))))[0][3] == FIRST_SEEN_CAP


def test_a_rank_s_network_without_direction_takes_the_direction_the_window_before_found():
    """The other way round (a two-level job's mild ingress 6, sweep 12): window 0 'destination 6' from the flows,
    window 6 'endpoint 6' from the collectives alone, printed as an endpoint at 0.50."""
    h = FindingHistory()
    h.weigh(("j", 0, 0), _faults(0, ("destination", -1, 6, 0.98)))
    (found, ev) = _top(h.weigh(("j", 0, 6), _faults(6, ("endpoint", 6, 6, 0.54))))
    assert found == ("destination", -1, 6, 0.54), found
    assert ev["direction_from"] == 0 and ev["persistence"]["found_before"] == 0
    # Both directions, or neither, found before: the endpoint stays one, first seen.
    for before in ([("destination", -1, 6, 0.98), ("source", 6, -1, 0.9)], [("destination", -1, 5, 0.98)]):
        h = FindingHistory()
        h.weigh(("j", 0, 0), _faults(0, *before))
        assert _top(h.weigh(("j", 0, 6), _faults(6, ("endpoint", 6, 6, 0.54))))[0] == ("endpoint", 6, 6, FIRST_SEEN_CAP)
