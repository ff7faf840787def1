"""Key bookkeeping of Store.insert (storage.keys): duplicate detection by hashes, high-water marks."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from storage import keys as K
from tests.storage.conftest import window_rows


def _table(jobs, attempts, wids, extra=None):
    t = pa.table({"job_id": pa.array(jobs, pa.string()), "attempt": pa.array(attempts, pa.int32()),
                  "window_id": pa.array(wids, pa.int64())})
    return t.append_column("x", pa.array(extra if extra is not None else list(range(len(jobs)))))


KEY = ["job_id", "attempt", "window_id"]


def test_distinct_keys_are_proven_and_duplicates_are_not():
    rng = np.random.default_rng(0)
    n = 50_000
    t = _table([f"job-{j}" for j in rng.integers(0, 300, n)], [0] * n, np.arange(n) * 10)
    assert K.keys_distinct(t, KEY)
    dup = pa.concat_tables([t, t.slice(123, 1)])
    assert not K.keys_distinct(dup, KEY)
    # Keys differing in one column only, and the same values in swapped columns, hash apart.
    t2 = _table(["a", "a", "b", "b"], [0, 1, 0, 1], [1, 1, 1, 1])
    assert K.keys_distinct(t2, KEY)
    assert K.keys_distinct(_table(["a", "a"], [1, 2], [2, 1]), KEY)


def test_first_of_each_key_keeps_first_rows_in_order():
    t = _table(["a", "b", "a", "c", "b", "a"], [0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1], extra=[10, 11, 12, 13, 14, 15])
    out = K.first_of_each_key(t, KEY)
    assert out.column("x").to_pylist() == [10, 11, 13, 15]
    same = _table(["a", "b"], [0, 0], [1, 1])
    assert K.first_of_each_key(same, KEY) is same  # nothing to drop: the table itself


def test_a_hash_collision_falls_back_to_the_exact_group_by(monkeypatch):
    """Equal hashes only send the batch to the exact path, which keeps every distinct key."""
    monkeypatch.setattr(K, "key_hashes", lambda rows, key, enc=None: np.zeros(rows.num_rows, np.uint64))
    t = _table(["a", "b", "c"], [0, 0, 0], [1, 2, 3])
    assert not K.keys_distinct(t, KEY)
    assert K.first_of_each_key(t, KEY).num_rows == 3


def test_columns_it_cannot_hash_are_not_proven_distinct():
    t = pa.table({"k": pa.array([1.0, 2.0])})
    assert K.key_hashes(t, ["k"]) is None and not K.keys_distinct(t, ["k"])
    nulls = pa.table({"k": pa.array([1, None], pa.int64())})
    assert not K.keys_distinct(nulls, ["k"])
    chunked = pa.concat_tables([_table(["a"], [0], [1]), _table(["a"], [0], [1])])  # two chunks, one dictionary
    assert not K.keys_distinct(chunked, KEY)


class _Lookups:
    def __init__(self, stored):
        self.stored, self.calls = stored, []

    def __call__(self, jobs):
        self.calls.append(list(jobs))
        return {k: v for k, v in self.stored.items() if k[0] in jobs}


def test_high_water_splits_fresh_rows_from_rows_to_check():
    hw = K.HighWater()
    look = _Lookups({("a", 0): 20})
    # a: windows 30, 40 above the stored 20 -> fresh; b: nothing stored -> fresh.
    fresh, rest, pending = hw.split("t", _table(["a", "a", "b"], [0, 0, 0], [30, 40, 0]), look)
    assert (fresh.num_rows, rest.num_rows) == (3, 0) and look.calls == [["a", "b"]]
    pending.commit()
    # A replay of a's window 30 and a new window of b: a goes to the check, b does not, and nothing is looked up.
    fresh, rest, pending = hw.split("t", _table(["a", "b"], [0, 0], [30, 10]), look)
    assert fresh.column("job_id").to_pylist() == ["b"] and rest.column("job_id").to_pylist() == ["a"]
    assert len(look.calls) == 1
    # Another attempt of a is a group of its own (nothing stored), but a's rows all go to the check.
    fresh, rest, _ = hw.split("t", _table(["a", "a"], [1, 0], [0, 50]), look)
    assert (fresh.num_rows, rest.num_rows) == (2, 0)
    fresh, rest, _ = hw.split("t", _table(["a", "a"], [1, 0], [0, 40]), look)
    assert (fresh.num_rows, rest.num_rows) == (0, 2)


def test_marks_move_only_on_commit_and_tables_are_separate():
    hw = K.HighWater()
    look = _Lookups({})
    _f, _r, pending = hw.split("t", _table(["a"], [0], [10]), look)
    # Not committed (the engine's insert failed): the same rows are still fresh, not "stored".
    fresh, rest, pending = hw.split("t", _table(["a"], [0], [10]), look)
    assert (fresh.num_rows, rest.num_rows) == (1, 0)
    pending.commit()
    fresh, rest, _ = hw.split("t", _table(["a"], [0], [10]), look)
    assert (fresh.num_rows, rest.num_rows) == (0, 1)
    fresh, rest, _ = hw.split("u", _table(["a"], [0], [10]), look)
    assert (fresh.num_rows, rest.num_rows) == (1, 0)
    hw.forget()
    fresh, rest, _ = hw.split("t", _table(["a"], [0], [10]), look)
    assert (fresh.num_rows, rest.num_rows) == (1, 0)  # forgotten and looked up again (the fake stores nothing)


def test_marks_are_bounded():
    hw = K.HighWater(max_groups=3)
    look = _Lookups({})
    for j in "abcd":
        hw.split("t", _table([j], [0], [1]), look)[2].commit()
    assert len(hw._tables["t"]) <= 3
    assert look.calls[-1] == ["d"]


@pytest.mark.integration
def test_chdb_replays_below_the_mark_are_still_checked(tmp_path):
    """The marks are per path, shared by every store of it in this process, and learned from the table."""
    from storage import open_store

    url = f"chdb://{tmp_path / 'store'}"
    a = open_store(url)
    a.setup()
    a.insert("window", window_rows(5, job="j"))  # windows 0..40
    b = open_store(url)  # the same path: the same session and marks
    b.insert("window", window_rows(3, job="j", first_window=30))  # 30, 40 stored; 50 new
    b.insert("window", window_rows(1, job="j", first_window=10))  # a late replay below the mark
    count = "SELECT count() AS n FROM windows_data WHERE job_id = 'j'"
    assert a.query(count).column("n")[0].as_py() == 6
    b.close()
    a.close()
    # Reopened: the marks are learned from the stored rows again.
    c = open_store(url)
    c.insert("window", window_rows(7, job="j"))  # 0..60: only 60 is new
    assert c.query(count).column("n")[0].as_py() == 7
    c.close()


def test_mark_is_learned_once_per_job_attempt():
    hw = K.HighWater()
    look = _Lookups({("a", 0): 20, ("a", 1): 5})
    assert hw.mark("t", "a", 0, look) == 20 and hw.mark("t", "a", 0, look) == 20
    assert hw.mark("t", "a", 1, look) == 5  # learned by a's lookup already
    assert hw.mark("t", "b", 0, look) == K._NOTHING_STORED
    assert look.calls == [["a"], ["b"]]
    # split() finds the marks known: nothing is looked up again.
    fresh, rest, _ = hw.split("t", _table(["a", "b"], [0, 0], [30, 0]), look)
    assert (fresh.num_rows, rest.num_rows) == (2, 0) and len(look.calls) == 2


@pytest.mark.integration
def test_chdb_window_stored_answers_new_windows_from_the_mark(tmp_path, monkeypatch):
    """A shard asks about every window it sees first: above the job's mark the answer needs no query, and
    the answers are those of the table."""
    from storage import open_store

    s = open_store(f"chdb://{tmp_path / 'store'}")
    s.setup()
    s.insert("window", window_rows(3, job="j"))  # windows 0, 10, 20
    s.insert("window", window_rows(1, job="j", first_window=40))  # 30 is a gap
    selects = []
    real = s._select
    monkeypatch.setattr(s, "_select", lambda sql, *a, **k: selects.append(sql) or real(sql, *a, **k))
    assert [s.window_stored(("j", 0, w)) for w in (0, 20, 30, 40)] == [True, True, False, True]
    n = len(selects)
    assert not s.window_stored(("j", 0, 50)) and not s.window_stored(("j", 0, 1000))
    assert len(selects) == n, "windows above the mark were answered without a query"
    assert not s.window_stored(("k", 0, 0)) and not s.window_stored(("k", 0, 10))
    assert len(selects) == n + 1, "a job never stored costs one lookup, then none"
    s.insert("window", window_rows(1, job="k", first_window=10))
    assert s.window_stored(("k", 0, 10)) and not s.window_stored(("k", 0, 0))
    s.close()
