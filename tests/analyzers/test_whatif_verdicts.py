"""Root-cause verdicts (docs/whatif.md, section 6) on fleetgen jobs with a known injected cause."""
from __future__ import annotations

import pytest

from analyzers.whatif import analyze
from core.layout import JobLayout
from generators.fleetgen import JobSpec, generate_window, make_fleet

EXPECTED = {"slow_worker": "worker", "heavy_last_stage": "last_stage_imbalance",
            "seq_imbalance": "sequence_imbalance", "gc": "gc", "none": ""}
LAYOUTS = [JobLayout(4, 4, 2), JobLayout(8, 2, 1), JobLayout(2, 4, 1, cp_size=2), JobLayout(4, 4, 2, vpp_size=2),
           JobLayout(4, 2, 1, vpp_size=3)]


def run(cause: str, lay: JobLayout, seed: int = 0, **kw):
    factor = {"none": 1.0, "slow_worker": 1.6, "heavy_last_stage": 1.4, "seq_imbalance": 1.35, "gc": 6.0}[cause]
    spec = JobSpec(job_id=f"v-{cause}", layout=lay, num_microbatches=2 * lay.pp_size, cause=cause, seed=seed,
                   cause_dp=lay.dp_size - 1, cause_pp=lay.pp_size // 2, cause_factor=factor, **kw)
    return analyze(generate_window(spec, 40, 4, 10**12), lay)


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda l: f"dp{l.dp_size}pp{l.pp_size}cp{l.cp_size}vpp{l.vpp_size}")
@pytest.mark.parametrize("cause", list(EXPECTED))
def test_main_verdict_matches_the_injected_cause(cause, lay):
    res = run(cause, lay)
    assert res.verdict == EXPECTED[cause], (res.slowdown, res.verdicts)
    if cause == "none":
        assert res.slowdown == pytest.approx(1.0, abs=0.03) and res.verdicts == []
    else:
        v = res.verdicts[0]
        assert v["summary"] and v["evidence"] and res.slowdown > 1.05


def test_worker_verdict_names_the_slow_worker():
    lay = LAYOUTS[0]
    ev = run("slow_worker", lay).verdicts[0]["evidence"]
    cell = ev["top_workers"][0]
    assert (cell["dp_rank"], cell["pp_rank"]) == (lay.dp_size - 1, lay.pp_size // 2) and ev["M_W"] > 0.5


def test_stage_and_sequence_evidence():
    st = run("heavy_last_stage", LAYOUTS[0]).verdicts[0]["evidence"]
    assert st["M_S"] >= 0.5 and st["S_pp_last"] == max(st["S_pp"].values())
    seq = run("seq_imbalance", LAYOUTS[0]).verdicts[0]["evidence"]
    assert seq["corr_fwd_bwd"] >= 0.9 and seq["pairs"] > 50
    gc = run("gc", LAYOUTS[0]).verdicts[0]["evidence"]
    assert gc["gc_ops_nonzero"] > 0 and gc["S_gc"] > 1.05


def test_fleet_scores():
    """Across a generated fleet, the main verdict is the injected cause for nearly every job."""
    jobs = make_fleet(n_jobs=15, seed=3, min_gpus=8, max_gpus=128)
    hits = 0
    for spec in jobs:
        res = analyze(generate_window(spec, 0, 3, 10**12), spec.layout)
        hits += res.verdict == EXPECTED[spec.cause]
    assert hits >= 13, hits


def test_communication_verdict_when_a_collective_dominates():
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    lay = JobLayout(4, 2, 1)
    t = generate_window(JobSpec(job_id="comm", layout=lay, num_microbatches=4), 0, 4, 10**12)
    # One DP rank's reduce-scatter transfers are slow in every step: a slow NIC.
    slow = pc.and_(pc.equal(t["optype"], "grads-reduce-scatter"), pc.equal(t["dp_rank"], 2)).to_numpy(
        zero_copy_only=False)
    dur = t["duration_ns"].to_numpy().copy()
    dur[slow] += 400_000_000
    i = t.schema.get_field_index("duration_ns")
    res = analyze(t.set_column(i, t.schema.field(i), pa.array(dur)), lay)
    kinds = [v["kind"] for v in res.verdicts]
    assert "communication" in kinds, res.verdicts
    ev = res.verdicts[kinds.index("communication")]["evidence"]
    assert ev["optype"] == "grads-reduce-scatter" and ev["S_t"] == max(ev["by_optype"].values())
    assert np.isfinite(res.slowdown) and res.slowdown > 1.05


def test_one_slow_worker_in_the_last_stage_is_a_worker_not_a_heavy_stage():
    """Issue 52: a DP2 x PP2 job whose rank in dp 1 of the last stage was late got "Last pipeline stage too heavy"
    although both stages compute the same: fixing the stage fixes that worker too (M_S), but only one of the
    stage's replicas is slow."""
    lay = JobLayout(2, 2, 1)
    spec = JobSpec(job_id="v-late", layout=lay, num_microbatches=4, cause="slow_worker", cause_dp=1, cause_pp=1,
                   cause_factor=1.6)
    res = analyze(generate_window(spec, 40, 4, 10**12), lay)
    kinds = [v["kind"] for v in res.verdicts]
    assert kinds[0] == "worker" and "last_stage_imbalance" not in kinds, res.verdicts
    cell = res.verdicts[0]["evidence"]["top_workers"][0]
    assert (cell["dp_rank"], cell["pp_rank"]) == (1, 1)
