"""core.arrow_numpy: Arrow <-> numpy from the buffers, the same values as pyarrow's own conversions."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from core.arrow_numpy import array, is_null, strings, values

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize("typ", [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint32(), pa.float32(),
                                 pa.float64()])
def test_values_of_slices_and_chunks(typ):
    a = pa.array(np.arange(100) - (0 if pa.types.is_unsigned_integer(typ) else 40), type=typ)
    for arr in (a, a.slice(7, 50), pa.chunked_array([a.slice(3, 10), a.slice(60, 5)]), pa.chunked_array([a])):
        want = arr.to_numpy() if isinstance(arr, pa.Array) else np.concatenate([c.to_numpy() for c in arr.chunks])
        got = values(arr)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_one_chunk_without_nulls_is_not_copied():
    x = np.arange(10, dtype=np.int64)
    a = pa.Array.from_buffers(pa.int64(), 10, [None, pa.py_buffer(x)])
    assert np.shares_memory(values(a), x)


def test_nulls_become_the_given_value_or_what_pyarrow_gives():
    a = pa.array([1, None, 3, None, 5], pa.int32()).slice(1)
    assert values(a, -1).tolist() == [-1, 3, -1, 5]
    assert is_null(a).tolist() == [True, False, True, False]
    assert np.isnan(values(a)[0])  # no fill value: pyarrow's float with NaN
    assert is_null(pa.chunked_array([a, pa.array([7], pa.int32())])).tolist() == [True, False, True, False, False]


def test_booleans_and_strings():
    b = pa.array([True, False, True, True, False, False, True, False, True]).slice(2)
    assert values(b).tolist() == b.to_pylist()
    s = strings(["forward-compute", "", "ö"])
    assert s.to_pylist() == ["forward-compute", "", "ö"] and s.type == pa.string()


def test_array_round_trip_with_a_mask():
    x = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5], np.int64)
    mask = np.zeros(len(x), bool)
    mask[[1, 8]] = True
    a = array(x, mask)
    assert a.to_pylist() == [None if m else int(v) for v, m in zip(x, mask)]
    assert array(x).null_count == 0 and array(x).to_pylist() == x.tolist()
    flags = np.array([True, False, True] * 5)
    assert array(flags).to_pylist() == flags.tolist()


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_the_whatif_command_does_not_import_pandas():
    """The reason for this module: half a second of every `stragglerscope whatif` run."""
    g = ROOT / "tests" / "golden" / "whatif" / "ST"
    code = ("import sys; from actions.whatif_files import whatif_files; "
            f"whatif_files({str(g / 'trace-ST.parquet')!r}, {str(g / 'meta-ST.yaml')!r}, '/dev/null'); "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
