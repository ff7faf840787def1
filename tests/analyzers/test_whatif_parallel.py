"""The what-if analysis on several threads gives the same numbers as on one.

Threads split a pass's batch columns and the measuring's column blocks; the
parts are put together in order, so every result, to the last bit, and every
warning must be those of one thread. Small windows are forced onto threads
here (no cell minimum, one batch column per piece).
"""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

from analyzers.whatif import analyze, scenarios
from core import parallel

from .synth import vpp_window
from .test_whatif_compact import _late_optimizer


def _window():
    t, lay = vpp_window(dp=2, pp=3, vpp=2, m=3, n_steps=20, noise=0.05, seed=11)
    # Delays past int32 ns in steps that fall in different measuring ranges (columns 0-7 and 8-19).
    return _late_optimizer(_late_optimizer(t, 1, 2, 3), 0, 2, 15), lay


@pytest.fixture
def spied(monkeypatch):
    """Threads forced on; records the thread count of every call."""
    used: list[int] = []
    real = parallel.map_slices

    def spy(items, fn, n_threads):
        used.append(min(n_threads, len(items)))
        return real(items, fn, n_threads)

    monkeypatch.setattr(parallel, "map_slices", spy)
    monkeypatch.setattr(parallel, "MIN_PARALLEL_CELLS", 0)
    monkeypatch.setattr(scenarios, "BATCH_BYTES", 1)  # one batch column per piece
    return used


@pytest.mark.parametrize("template", [True, False], ids=["one-graph-batched", "graph-per-chunk"])
def test_three_threads_give_the_numbers_of_one(spied, monkeypatch, template):
    from analyzers.whatif import api

    t, lay = _window()
    orig = scenarios.run_scenarios
    kw = {"template": template} if template else {"template": False, "chunk_ops": 40}
    monkeypatch.setattr(api, "run_scenarios", lambda p, **k: orig(p, **k, **kw))
    results = {}
    for n in (1, 3):
        monkeypatch.setenv(parallel.ENV, str(n))
        spied.clear()
        res = analyze(t, lay)
        results[n] = res
        assert max(spied) == n, spied  # it really ran on that many threads
    one, three = (json.dumps(results[n].to_json_dict(), sort_keys=True) for n in (1, 3))
    assert one == three
    g1, g3 = results[1].model.run.graphs, results[3].model.run.graphs
    assert len(g1) == len(g3) and (len(g1) == 1) == template
    if template:
        assert g1[0].batch == 20
        (r1, c1, v1), (r3, c3, v3) = g1[0].delay_over, g3[0].delay_over
        assert len(r1) == 2 and r1.tolist() == r3.tolist() and c1.tolist() == c3.tolist()
        assert v1.tolist() == v3.tolist()
    assert results[3].replay_error == 0.0


def test_small_windows_stay_on_the_calling_thread(monkeypatch):
    monkeypatch.delenv(parallel.ENV, raising=False)
    assert parallel.threads(parallel.MIN_PARALLEL_CELLS - 1) == 1
    assert parallel.threads(parallel.MIN_PARALLEL_CELLS) >= 1
    monkeypatch.setenv(parallel.ENV, "2")
    assert parallel.threads(10**9) == 2
    monkeypatch.setenv(parallel.ENV, "two")  # a bad value is the default, never a failed analysis
    assert 1 <= parallel.threads(10**9) <= parallel.MAX_THREADS


def test_slices_come_back_in_item_order():
    items = list(range(11))
    out = parallel.map_slices(items, lambda part: [x * 10 for x in part], 4)
    assert out == [x * 10 for x in items]


def test_re_deliveries_are_dropped_the_same_on_threads(spied, monkeypatch):
    """The gather marks re-deliveries per range of rows; a duplicate on a range's first row is still seen."""
    t, lay = _window()
    again = t.take(list(range(0, t.num_rows, 7)))  # every 7th row delivered twice
    t2 = pa.concat_tables([t, again])
    monkeypatch.setenv(parallel.ENV, "1")
    one = analyze(t2, lay).to_json_dict()
    for n in (2, 3, 5):
        monkeypatch.setenv(parallel.ENV, str(n))
        spied.clear()
        many = analyze(t2, lay).to_json_dict()
        assert max(spied) == n
        assert json.dumps(one, sort_keys=True) == json.dumps(many, sort_keys=True)
    assert f"{again.num_rows} duplicate op spans dropped" in one["warnings"]
    monkeypatch.setenv(parallel.ENV, "1")
    assert json.dumps(analyze(t, lay).to_json_dict()["slowdown"]) == json.dumps(one["slowdown"])


@pytest.mark.parametrize("k", [2, 19])
def test_every_thread_gets_a_batch_of_short_rows(k):
    """A pass of few columns (pairs, top workers) was one batch of every step, on one thread."""
    class G:  # the two attributes _batches reads
        n, batch = 170_496, 44

    for n_thr in (1, 2, 3):
        pieces = scenarios._batches(G, k, n_thr)
        assert len(pieces) >= n_thr
        assert [c for _, _, st in pieces for c in st] == list(range(G.batch))  # every step once, in order
        assert all((b1 - b0) * k <= max(k, scenarios.ROW_CELLS) for b0, b1, _ in pieces)
