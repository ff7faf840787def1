"""General jobs and bad input: the analyzer handles every layout and never crashes on data."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzers.whatif import WhatIfInputError, analyze
from actions.whatif_files import whatif_files
from core.golden import GoldenTraceError, load_golden
from core.layout import JobLayout
from core.schema import OP_SPAN
from generators.fleetgen import JobSpec, generate_window

from .synth import overlap_dp, vpp_window, with_noop_sends


def job(dp=2, pp=3, tp=1, cp=1, m=4, steps=2, cause="none", seed=0, **kw) -> tuple[pa.Table, JobLayout]:
    lay = JobLayout(dp_size=dp, pp_size=pp, tp_size=tp, cp_size=cp)
    spec = JobSpec(job_id=f"j{dp}{pp}{cp}", layout=lay, num_microbatches=m, cause=cause, seed=seed, **kw)
    return generate_window(spec, 10, steps, 10**12), lay


def assert_clean(res, *, n_warn: int = 0):
    d = res.to_json_dict()
    json.dumps(d, allow_nan=False)
    assert res.replay_error < 1e-9
    assert len(res.warnings) == n_warn, res.warnings
    assert np.isfinite(res.slowdown) and res.slowdown >= 0.99
    for s, v in d["step_time"]["replay"].items():
        assert v == pytest.approx(d["step_time"]["actual"][s], rel=1e-9)
    return d


@pytest.mark.parametrize("dp,pp,vpp,m", [(2, 2, 2, 4), (1, 3, 2, 3), (3, 2, 3, 2)])
def test_vpp_jobs(dp, pp, vpp, m):
    t, lay = vpp_window(dp=dp, pp=pp, vpp=vpp, m=m, noise=0.03)
    d = assert_clean(analyze(t, lay))
    assert set(d["by_pp_rank"]) == {str(x) for x in range(pp)}
    assert "forward-pp-comm" in d["by_optype"] and "backward-pp-comm" in d["by_optype"]


def test_vpp_noop_sends_are_dropped_and_reported():
    t, lay = vpp_window(dp=2, pp=2, vpp=2, m=3)
    base = analyze(t, lay)
    res = analyze(with_noop_sends(t, lay), lay)
    assert res.slowdown == pytest.approx(base.slowdown, rel=1e-12)
    assert res.step_time == base.step_time
    assert any("no-ops" in w for w in res.warnings)


def test_context_parallel():
    t, lay = job(dp=2, pp=2, cp=2)
    d = assert_clean(analyze(t, lay))
    assert d["layout"]["world_size"] == 8 and "params-all-gather" in d["by_optype"]


def test_no_pipeline_parallelism():
    t, lay = job(dp=4, pp=1)
    d = assert_clean(analyze(t, lay))
    assert "forward-pp-comm" not in d["by_optype"] and "embedding-grads-all-reduce" not in d["by_optype"]
    assert d["worker_slowdown"] and len(d["worker_slowdown"]) == 1


def test_no_data_parallelism():
    t, lay = job(dp=1, pp=4)
    d = assert_clean(analyze(t, lay))
    assert "grads-reduce-scatter" not in d["by_optype"]
    assert d["by_dp_rank"]["0"] == pytest.approx(d["slowdown"], rel=1e-9)


def test_single_worker():
    t, lay = job(dp=1, pp=1)
    assert_clean(analyze(t, lay))


def test_overlapped_dp():
    t, lay = job(dp=2, pp=3)
    d = assert_clean(analyze(overlap_dp(t), lay))
    assert "separate-grads-all-reduce" in d["by_optype"] and "grads-reduce-scatter" in d["by_optype"]


def test_chunked_steps_give_the_same_result():
    t, lay = job(dp=2, pp=3, steps=4, cause="slow_worker", cause_dp=1, cause_pp=2, cause_factor=1.5)
    one = analyze(t, lay).to_json_dict()
    many = analyze(t, lay, chunk_ops=50).to_json_dict()
    for k in ("slowdown", "M_W", "M_S", "by_optype", "by_dp_rank", "by_pp_rank", "step_time"):
        assert json.dumps(one[k], sort_keys=True) == json.dumps(many[k], sort_keys=True), k


def _drop_worker(t: pa.Table, dp: int, pp: int) -> pa.Table:
    m = pc.and_(pc.equal(t["dp_rank"], dp), pc.equal(t["pp_rank"], pp))
    return t.filter(pc.invert(m))


def test_missing_worker_is_flagged():
    t, lay = job(dp=2, pp=3)
    res = analyze(_drop_worker(t, 1, 1), lay)
    assert res.complete is False and res.missing_workers == [[1, 1]]
    assert any("incomplete" in w for w in res.warnings)
    d = res.to_json_dict()
    assert d["worker_slowdown"][1][1] is None and np.isfinite(d["slowdown"])


def test_missing_worker_refused_when_complete_required():
    t, lay = job(dp=2, pp=3)
    with pytest.raises(WhatIfInputError, match="dp1/pp1"):
        analyze(_drop_worker(t, 1, 1), lay, allow_incomplete=False)


def test_unknown_optypes_are_ignored_and_reported():
    t, lay = job()
    i = t.schema.get_field_index("optype")
    extra = t.slice(0, 5).set_column(i, t.schema.field(i), pa.array(["mystery-op"] * 5, pa.string()))
    res = analyze(pa.concat_tables([t, extra]), lay)
    base = analyze(t, lay)
    assert res.unknown_optypes == ["mystery-op"] and res.slowdown == base.slowdown
    assert any("unknown" in w for w in res.warnings)


def test_duplicates_are_dropped_and_reported():
    t, lay = job()
    res = analyze(pa.concat_tables([t, t.slice(10, 40)]), lay)
    assert res.slowdown == analyze(t, lay).slowdown
    assert any("40 duplicate" in w for w in res.warnings)


def test_negative_null_and_nan_durations_are_rejected():
    t, lay = job()
    dur = t["duration_ns"].to_numpy().copy()
    dur[3] = -5
    i = t.schema.get_field_index("duration_ns")
    neg = t.set_column(i, t.schema.field(i), pa.array(dur))
    res = analyze(neg, lay)
    assert any("negative duration" in w for w in res.warnings)
    mask = np.zeros(len(dur), bool)
    mask[7] = True
    nul = t.set_column(i, pa.field("duration_ns", pa.int64()), pa.array(dur.clip(0), mask=mask))
    assert any("null or non-finite" in w for w in analyze(nul, lay).warnings)
    fl = dur.clip(0).astype(float)
    fl[9] = np.nan
    nan = t.set_column(i, pa.field("duration_ns", pa.float64()), pa.array(fl))
    res = analyze(nan, lay)
    assert any("null or non-finite" in w for w in res.warnings) and np.isfinite(res.slowdown)


def test_dependency_cycle_names_the_ops():
    # Stage 1 runs backward 0 before forward 1: stage 2 needs forward 1 before it can send
    # backward 0 back, so neither can proceed (a deadlock in the trace's op order).
    t, lay = job(dp=1, pp=4, m=4, steps=1)
    df = t.to_pandas()
    s1 = df[(df.pp_rank == 1)]
    f1 = s1[(s1.optype == "forward-compute") & (s1.seq_id == 1)].index[0]
    b0 = s1[(s1.optype == "backward-compute") & (s1.seq_id == 0)].index[0]
    df.loc[b0, "start_ns"] = df.loc[f1, "start_ns"] - 1
    bad = pa.Table.from_pandas(df, schema=OP_SPAN, preserve_index=False)
    with pytest.raises(WhatIfInputError, match=r"dependency cycle: .*pp1 (forward|backward)-compute"):
        analyze(bad, lay)


def test_missing_columns_and_bad_files(tmp_path):
    t, lay = job()
    with pytest.raises(WhatIfInputError, match="start_ns"):
        analyze(t.drop_columns(["start_ns"]), lay)
    with pytest.raises(WhatIfInputError, match="no usable"):
        analyze(t.slice(0, 0), lay)
    with pytest.raises(WhatIfInputError, match="not found"):
        whatif_files(tmp_path / "nope.parquet", tmp_path / "nope.yaml", tmp_path / "o.json")
    meta = tmp_path / "m.yaml"
    meta.write_text("dp_size: 2\n")
    with pytest.raises(GoldenTraceError, match="pp_size"):
        load_golden(tmp_path / "nope.parquet", meta)
    with pytest.raises(WhatIfInputError, match="pp_size"):  # the what-if's CLI keeps its one error type
        whatif_files(tmp_path / "nope.parquet", meta, tmp_path / "o.json")
    meta.write_text("- just a list\n")
    with pytest.raises(GoldenTraceError, match="mapping"):
        load_golden(tmp_path / "nope.parquet", meta)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_garbage_never_crashes(data):
    """Random rows: the analyzer returns a result or raises WhatIfInputError, nothing else."""
    from core.optypes import OPTYPES

    n = data.draw(st.integers(0, 60))
    ints = lambda lo, hi: st.lists(st.integers(lo, hi), min_size=n, max_size=n)
    rows = {
        "dp_rank": data.draw(ints(-1, 2)), "pp_rank": data.draw(ints(0, 2)), "step": data.draw(ints(0, 2)),
        "optype": data.draw(st.lists(st.sampled_from(list(OPTYPES) + ["x"]), min_size=n, max_size=n)),
        "start_ns": data.draw(ints(0, 10**7)), "duration_ns": data.draw(ints(-10, 10**6)),
        "seq_id": data.draw(ints(0, 3)), "mc": data.draw(ints(-1, 1)), "gmc": data.draw(ints(-1, 5)),
        "mb_id": data.draw(ints(-1, 3)),
    }
    t = pa.table({k: pa.array(v, OP_SPAN.field(k).type) for k, v in rows.items()})
    try:
        res = analyze(t, JobLayout(dp_size=2, pp_size=2, vpp_size=2))
    except WhatIfInputError:
        return
    json.dumps(res.to_json_dict(), allow_nan=False)


@pytest.mark.parametrize("maker", [
    lambda: job(dp=3, pp=3, steps=3, cause="slow_worker", cause_dp=1, cause_pp=2, cause_factor=1.5),
    lambda: vpp_window(dp=2, pp=2, vpp=2, m=3, n_steps=3, noise=0.05),
    lambda: job(dp=4, pp=1, steps=2, cause="gc", cause_factor=5.0),
])
def test_batched_and_per_chunk_graphs_agree(maker, monkeypatch):
    """Regular windows use one graph for all steps; the general per-chunk path must agree."""
    from analyzers.whatif import scenarios

    t, lay = maker()
    batched = analyze(t, lay)
    assert batched.model.run.graphs[0].batch > 1
    orig = scenarios.run_scenarios
    monkeypatch.setattr(scenarios, "run_scenarios", lambda p, **kw: orig(p, **kw, template=False))
    from analyzers.whatif import api

    monkeypatch.setattr(api, "run_scenarios", scenarios.run_scenarios)
    general = analyze(t, lay)
    assert general.model.run.graphs[0].batch == 1
    a, b = batched.to_json_dict(), general.to_json_dict()
    for k in ("slowdown", "launch_slowdown", "M_W", "M_S", "by_optype", "by_dp_rank", "by_pp_rank", "step_time",
              "by_dp_rank_per_step", "worker_slowdown", "replay_error"):
        assert json.dumps(a[k], sort_keys=True) == json.dumps(b[k], sort_keys=True), k


def test_the_command_reads_golden_traces_lean_with_the_same_result(tmp_path):
    """`whatif` reads only the analyzer's columns (op types still dictionary-encoded): the same JSON."""
    d = Path(__file__).resolve().parent.parent / "golden" / "whatif" / "ST"
    got = whatif_files(d / "trace-ST.parquet", d / "meta-ST.yaml", tmp_path / "o.json")
    full = analyze(*load_golden(d / "trace-ST.parquet", d / "meta-ST.yaml")).to_json_dict()
    assert json.dumps(got, sort_keys=True) == json.dumps(full, sort_keys=True)
