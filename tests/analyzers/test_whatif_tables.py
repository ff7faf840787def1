"""The what-if result's own conversion to result tables (analyzers/whatif/tables.py)."""
from __future__ import annotations

import math

from analyzers.whatif import analyze, analyze_model, summarise
from analyzers.whatif.tables import step_times, to_tables, window_fields
from core import schema as S

from .test_whatif_jobs import _drop_worker, job

KEY = ("j", 0, 100)


def test_rows_conform_to_their_schemas_with_int_keys():
    t, lay = job(dp=2, pp=2)
    res = analyze(t, lay)
    tables = to_tables(res, KEY)
    for kind, schema in (("step_slowdown", S.STEP_SLOWDOWN), ("optype_slowdown", S.OPTYPE_SLOWDOWN),
                         ("worker_slowdown", S.WORKER_SLOWDOWN)):
        assert tables[kind].num_rows, kind
        assert tables[kind].schema == schema, kind
    tables = {kind: t.to_pylist() for kind, t in tables.items()}
    steps = [r["step"] for r in tables["step_slowdown"]]
    assert steps == sorted(res.step_time["actual"]) == sorted(step_times(res)["actual"])
    for r in tables["step_slowdown"]:
        assert math.isclose(r["slowdown"], res.step_slowdown[r["step"]])
    window = [r for r in tables["optype_slowdown"] if r["step"] == -1]
    assert {r["optype"]: r["slowdown"] for r in window} == res.by_optype
    whole = {(r["dp_rank"], r["pp_rank"]): r["s_w"] for r in tables["worker_slowdown"] if r["step"] == -1}
    assert whole == {(d, p): res.worker_slowdown[p][d] for d in range(2) for p in range(2)}
    per_step = [r for r in tables["worker_slowdown"] if r["step"] >= 0]
    assert len(per_step) == len(steps) * 4 and all(r["s_w"] == min(r["s_dp"], r["s_pp"]) for r in per_step)


def test_an_absent_worker_has_no_per_step_cells_and_the_window_says_incomplete():
    t, lay = job(dp=2, pp=3)
    res = analyze(_drop_worker(t, 1, 1), lay)
    workers = to_tables(res, KEY)["worker_slowdown"].to_pylist()
    per_step = {(r["dp_rank"], r["pp_rank"]) for r in workers if r["step"] >= 0}
    assert (1, 1) not in per_step and len(per_step) == 5
    fields = window_fields(res)
    assert fields["complete"] is False and math.isfinite(fields["slowdown"])
    assert any("incomplete" in w for w in fields["warnings"])


def test_analyze_is_the_summary_of_the_public_model():
    t, lay = job(dp=2, pp=2)
    model = analyze_model(t, lay)
    assert model.prepared.n == t.num_rows and len(model.run.steps) > 0
    again = summarise(model)
    assert again.to_json_dict() == analyze(t, lay).to_json_dict()
    assert again.model is model


def test_step_and_rank_keys_are_ints_in_the_result_and_strings_in_its_json():
    t, lay = job(dp=2, pp=2)
    res = analyze(t, lay)
    assert list(res.step_slowdown) == list(res.steps) == list(res.step_time["actual"])
    assert set(res.by_dp_rank) == {0, 1} and set(res.by_pp_rank) == {0, 1}
    assert all(set(per) == {0, 1} for per in res.by_dp_rank_per_step.values())
    assert list(res.by_optype_per_step) == list(res.steps)
    d = res.to_json_dict()
    assert list(d["step_slowdown"]) == [str(s) for s in res.steps] == list(d["step_time"]["ideal"])
    assert set(d["by_dp_rank"]) == {"0", "1"} and set(d["by_pp_rank_per_step"][str(res.steps[0])]) == {"0", "1"}
