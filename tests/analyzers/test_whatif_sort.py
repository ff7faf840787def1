"""The analyzer's row order: (step, dp, pp, stream, start, seq), equal rows in input order.

The compiled counting sort (``kernels.sort_rows``) and the lexsort it falls
back to for sparse keys must both give exactly ``np.lexsort``'s order, also
for streams that arrive out of order, equal starts and re-deliveries.
"""
from __future__ import annotations

import numpy as np
import pytest

from analyzers.whatif import load
from analyzers.whatif.opcodes import STREAM_OF_CODE
from core.layout import JobLayout


def _rows(seed: int, n: int, dp: int, pp: int, n_steps: int, shuffled: float):
    rng = np.random.default_rng(seed)
    step_idx = rng.integers(0, n_steps, n).astype(np.int32)
    d = rng.integers(0, dp, n).astype(np.int32)
    p = rng.integers(0, pp, n).astype(np.int32)
    codes = rng.integers(0, len(STREAM_OF_CODE), n).astype(np.int8)
    rel = np.sort(rng.integers(0, 50, n)).astype(np.int64)  # in order, few distinct: many equal starts
    seq = rng.integers(0, 4, n).astype(np.int32)
    swap = rng.random(n) < shuffled  # some rows out of order
    rel[swap] = rng.integers(0, 50, int(swap.sum()))
    return step_idx, d, p, codes, rel, seq


@pytest.mark.parametrize("seed,shuffled", [(0, 0.0), (1, 0.05), (2, 1.0)])
@pytest.mark.parametrize("dp,pp,n_steps", [(3, 2, 5), (1, 1, 2)], ids=["small-buckets", "large-buckets"])
def test_the_counting_sort_gives_the_lexsort_order(seed, shuffled, dp, pp, n_steps):
    """Buckets of about 170 rows are put in order by insertion, of thousands by two stable sorts."""
    lay = JobLayout(dp_size=dp, pp_size=pp)
    step_idx, d, p, codes, rel, seq = _rows(seed, 20_000, dp, pp, n_steps, shuffled)
    sizes = np.bincount(load._major_key(step_idx, d, p, codes, lay))
    assert (sizes.max() <= load.kernels.INSERTION_MAX) == (dp > 1)
    expected = np.lexsort((seq, rel, load._major_key(step_idx, d, p, codes, lay)))
    got = load._sort_order(step_idx, d, p, codes, rel, seq, lay, n_steps)
    assert np.array_equal(got, expected)


def test_sparse_keys_fall_back_to_the_lexsort(monkeypatch):
    """Few ops over very many worker-steps: no counter per stream, the same order."""
    lay = JobLayout(dp_size=4096, pp_size=8)
    step_idx, d, p, codes, rel, seq = _rows(3, 1_000, 4096, 8, 200, 0.5)
    called = []
    monkeypatch.setattr(load.kernels, "sort_rows", lambda *a: called.append(1))
    got = load._sort_order(step_idx, d, p, codes, rel, seq, lay, 200)
    assert not called
    assert np.array_equal(got, np.lexsort((seq, rel, load._major_key(step_idx, d, p, codes, lay))))
