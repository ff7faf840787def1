"""Link diagnosis on generated incidents: the right kind, the right cell, row or column."""
import pytest

from analyzers.links import diagnose, edges_from_ccl
from generators.faultgen import link_incident


@pytest.mark.parametrize("n", [8, 64, 512])
@pytest.mark.parametrize("kind", ["link", "source", "destination", "noncomm_slow"])
def test_finds_the_injected_fault(kind, n):
    for seed in range(3):
        inc = link_incident(kind, n, seed)
        faults = diagnose(inc.ccl)
        assert faults, f"{kind} n={n} seed={seed}: nothing found"
        top = faults[0]
        assert top.kind == kind
        if kind in ("link", "source", "noncomm_slow"):
            assert top.src == inc.truth["src"]
        if kind in ("link", "destination"):
            assert top.dst == inc.truth["dst"]
        assert 0 < top.confidence <= 1
        assert len(faults) == 1, f"one fault, not {[(f.kind, f.src, f.dst) for f in faults]}"


@pytest.mark.parametrize("n", [8, 256])
def test_a_healthy_group_has_no_fault(n):
    for seed in range(5):
        assert diagnose(link_incident("none", n, seed).ccl) == []


def test_edges_are_sparse_medians_per_pair():
    inc = link_incident("none", 16, 0, collectives=5)
    (e,) = edges_from_ccl(inc.ccl)
    assert len(e.src) == 16 * 4  # log2(16) sources per rank
    assert set(e.samples.tolist()) == {5}
    ranks, m = e.dense()
    assert m.shape == (16, 16)


def test_evidence_says_why():
    top = diagnose(link_incident("source", 64, 1).ccl)[0]
    assert top.evidence["hot_cells"] == top.evidence["cells"] == 6
    assert top.slowdown > 1.5


def test_bad_generator_input():
    with pytest.raises(ValueError, match="unknown link incident kind"):
        link_incident("meteor", 8, 0)
