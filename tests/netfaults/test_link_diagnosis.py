"""Real faults injected in a real network name the slow link, NIC or receiver, on unchanged gloo jobs (issue 19).

Every rank of the training zoo runs in its own network namespace behind a
bridge (tests/netfaults/fabric.py); ``tc`` shapes one rank's egress (a slow
NIC), its ingress (a slow receiver) or one directed link; a compute delay on
one rank is the late-sender control. The job runs under ``stragglerscope
trace`` into the real broker and a real ``stragglerscope run`` pipeline; the
findings are read back from the store. One run per class at the severe level
here; benchmarks/diagnosis_accuracy.py ``--real-runs`` scores both levels
over ten runs per class.
"""
from __future__ import annotations

import pytest

from tests.netfaults.fabric import netns_unavailable
from tests.netfaults.scenarios import WINDOW, Outcome, Scenario, run, scenarios

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The pipeline's every class, a data-parallel NIC, a late rank of a hand-written ring (each rank trades with
# both neighbours at once: every receiver waits for somebody, and only its arrival against its two peers,
# step by step, names it; analyzers/links/measured.exchange_arrivals), and a slow link of a flat ring, where a
# rank sends to one peer only and its path probe (ingest/path_probe.py) tells the link from its NIC.
CASES = (scenarios("pipe", "severe") + [s for s in scenarios("hier", "severe") if s.cls == "source"]
         + [s for s in scenarios("ring", "severe") if s.cls == "noncomm_slow"]
         + [s for s in scenarios("flat", "severe") if s.cls == "link"])


@pytest.fixture(scope="module")
def fleet(broker, tmp_path_factory):
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"network namespaces refused on this machine: {reason}")
    from tests.fleet import fleet_config, start_fleet, stop_fleet

    d = tmp_path_factory.mktemp("netfault-fleet")
    cfg = fleet_config(d, broker.bootstrap)
    proc, store = start_fleet(cfg, d / "run.log")
    yield cfg, store
    stop_fleet(proc, store)


@pytest.fixture(scope="module")
def report(artifacts):
    lines: list[str] = []
    yield lines
    (artifacts / "netfault_links.txt").write_text("\n".join(lines) + "\n")


def _line(o: Outcome) -> str:
    return (f"{o.scenario.name:<28} fault {o.scenario.fault:<20} expect {o.scenario.expect} found {o.found} "
            f"{'ok' if o.right else 'WRONG'} in {o.seconds_to_verdict:.1f} s")


@pytest.mark.parametrize("scn", CASES, ids=lambda s: s.name)
def test_the_fault_is_named(scn: Scenario, fleet, report):
    cfg, store = fleet
    out = run(scn, cfg, store)
    report.append(_line(out))
    if not out.right:
        # Inside the whole suite on 2 shared cores a run now and then goes wrong (2026-11-28: a healthy
        # pipeline's 0>2 flow moved 0.66 MB at 2 MB/s while its receiver computed, named a link at 0.99;
        # BENCHMARKS.md has the rates). Measured again once: a wrong method is wrong both times.
        first = out
        out = run(scn, cfg, store)
        report.append(_line(out) + f"   (again; first: {first.found})")
    assert out.right, f"{scn.name}: found {out.found}, want {scn.expect}\nfaults: {out.faults}\n{out.log[-3000:]}"
    cells = store.run_named("job_link_cells", {"job_id": out.job_id, "window_id": WINDOW}).to_pylist()
    p2p = {(c["src"], c["dst"]) for c in cells if c["group"] == "p2p"}
    if scn.job == "pipe":  # the whole matrix is stored, not only the flagged cells
        assert p2p == {(0, 2), (2, 0), (1, 3), (3, 1)}
    if scn.job == "ring":  # no collective in its steps: the matrix is its 16 neighbour pairs
        assert p2p == {(r, (r + d) % 8) for r in range(8) for d in (1, -1)}
        assert out.faults[0]["confidence"] >= 0.5, out.faults[0]
    else:
        assert any(c["dst"] == -1 for c in cells), "collective members are in the matrix"
