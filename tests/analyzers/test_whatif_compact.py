"""The compact internal representation must not change any number.

Narrow dtypes (int16 ranks, int32 launch delays with the rare longer ones
kept on the side) and reused scratch memory are storage choices only: results
stay those of plain int64/float64 arithmetic.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analyzers.whatif import analyze
from analyzers.whatif.simulate import Scenarios, Work, simulate

from .synth import vpp_window

LONG_NS = 3_000_000_000  # a launch delay past int32 ns (2.1 s)


def _late_optimizer(table: pa.Table, dp: int, pp: int, step: int) -> pa.Table:
    """The optimizer of one worker in one step launched LONG_NS late (nothing waits for it)."""
    hit = pc.and_(pc.and_(pc.equal(table["optype"], "optimizer"), pc.equal(table["dp_rank"], dp)),
                  pc.and_(pc.equal(table["pp_rank"], pp), pc.equal(table["step"], step)))
    start = np.where(hit.to_numpy(zero_copy_only=False), table["start_ns"].to_numpy() + LONG_NS,
                     table["start_ns"].to_numpy())
    return table.set_column(table.schema.get_field_index("start_ns"), "start_ns", pa.array(start, pa.int64()))


def test_long_launch_delays_replay_exactly(monkeypatch):
    t, lay = vpp_window(dp=2, pp=2, vpp=1, m=3, n_steps=3)
    t = _late_optimizer(t, 1, 1, 1)
    res = analyze(t, lay)
    run = res.model.run
    g = run.graphs[0]
    assert g.batch > 1 and g.delay.dtype == np.int32
    assert g.delay_over is not None and len(g.delay_over[0]) == 1
    assert float(g.delay_over[2][0]) >= LONG_NS
    assert res.replay_error == 0.0
    for s, v in res.step_time["replay"].items():
        assert v == res.step_time["actual"][s]
    # The per-chunk path (one column per graph) reads the same side table.
    from analyzers.whatif import api, scenarios

    orig = scenarios.run_scenarios
    monkeypatch.setattr(api, "run_scenarios", lambda p, **kw: orig(p, **kw, template=False))
    general = analyze(t, lay)
    assert general.model.run.graphs[0].batch == 1
    assert general.replay_error == 0.0
    a, b = res.to_json_dict(), general.to_json_dict()
    for k in ("step_time", "slowdown", "by_optype", "by_dp_rank", "by_pp_rank", "M_W", "M_S"):
        assert json.dumps(a[k], sort_keys=True) == json.dumps(b[k], sort_keys=True), k


def test_narrow_columns():
    t, lay = vpp_window(dp=2, pp=2, vpp=2, m=3, n_steps=2)
    p = analyze(t, lay).model.prepared
    assert p.dp.dtype == np.int16 and p.pp.dtype == np.int16 and p.step_idx.dtype == np.int16
    assert p.seq.dtype == np.int16 and p.mb.dtype == np.int16
    assert p.start.dtype == np.int64
    wide = t.set_column(t.schema.get_field_index("seq_id"), "seq_id",
                        pc.add(t["seq_id"], pa.scalar(100_000, pa.int32())))
    p2 = analyze(wide, lay).model.prepared
    assert p2.seq.dtype == np.int32 and int(p2.seq.min()) >= 100_000


def test_reused_scratch_memory_gives_the_same_ends():
    t, lay = vpp_window(dp=2, pp=3, vpp=2, m=3, n_steps=4, noise=0.05, seed=3)
    run = analyze(t, lay).model.run
    g, ideal = run.graphs[0], run.ideal_arrays[0]
    keys = np.zeros((g.n, 5), np.int32)
    keys[:, 2] = g.dp
    sc = Scenarios(("T", "replay", "ideal", "dp0"), np.array([0, 0, 0, 2]), np.array([0, 0, 0, 0]),
                   np.array([False, False, True, False]), np.array([False, True, False, False]))
    work = Work()
    for b0, b1 in ((0, 2), (2, 4), (0, 1), (0, 4)):
        fresh, _ = simulate(g, ideal, keys, sc, b0=b0, b1=b1)
        reused, _ = simulate(g, ideal, keys, sc, b0=b0, b1=b1, work=work)
        assert np.array_equal(fresh, reused)


def test_more_long_delays_than_the_first_room_are_all_kept(monkeypatch):
    """The measuring kernel reports how many long delays there were when they did not fit; none is lost."""
    from analyzers.whatif import graph

    t, lay = vpp_window(dp=2, pp=2, vpp=1, m=3, n_steps=3)
    t = _late_optimizer(_late_optimizer(t, 1, 1, 1), 0, 1, 2)
    expected = analyze(t, lay)
    monkeypatch.setattr(graph, "_over_room", lambda g, n_columns: 0)
    res = analyze(t, lay)
    g = res.model.run.graphs[0]
    assert g.delay_over is not None and len(g.delay_over[0]) == 2
    assert list(g.delay_over[0]) == sorted(g.delay_over[0])  # by row: a pass reads them in order
    assert res.replay_error == 0.0
    assert json.dumps(res.to_json_dict()["step_time"]) == json.dumps(expected.to_json_dict()["step_time"])
