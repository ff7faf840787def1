"""`stragglerscope whatif` reads golden traces a row group at a time (core.golden._read_lean).

Whatever the file looks like (several row groups with their own op-type
dictionaries, plain string op types, nulls, NaN times, wide or unsigned ids,
optional columns missing), the command must give the JSON of the whole-file
OP_SPAN table, or fall back to the whole-file read where the streamed one
cannot be done.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from analyzers.whatif import analyze
from actions.whatif_files import whatif_files
from core import golden, parallel
from core.golden import load_golden

ST = Path(__file__).resolve().parent.parent / "golden" / "whatif" / "ST"


def _st() -> pa.Table:
    return pq.read_table(ST / "trace-ST.parquet")


def _write(tmp_path: Path, t: pa.Table, row_group_size: int = 1000) -> tuple[Path, Path]:
    trace = tmp_path / "trace.parquet"
    pq.write_table(t, trace, row_group_size=row_group_size)
    meta = tmp_path / "meta.yaml"
    meta.write_text((ST / "meta-ST.yaml").read_text())
    return trace, meta


def _same_as_whole_file(tmp_path: Path, trace: Path, meta: Path) -> dict:
    got = whatif_files(trace, meta, tmp_path / "o.json")
    want = analyze(*load_golden(trace, meta)).to_json_dict()
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    return got


def _set(t: pa.Table, name: str, arr) -> pa.Table:
    return t.set_column(t.schema.get_field_index(name), name, arr)


@pytest.mark.parametrize("threads", [1, 3])
def test_row_groups_with_their_own_dictionaries(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(parallel, "MIN_PARALLEL_CELLS", 0)  # row groups read on threads
    monkeypatch.setenv(parallel.ENV, str(threads))
    t = _st()
    # Each row group's op types dictionary-encoded on its own: a row group's dictionary lists only its types,
    # in its own order.
    parts = []
    for off in range(0, t.num_rows, 1000):
        part = t.slice(off, 1000)
        names = part["optype"].cast(pa.string())
        parts.append(_set(part, "optype", pc.dictionary_encode(names.take(pa.array(
            np.arange(len(names))[::-1])).combine_chunks()).take(pa.array(np.arange(len(names))[::-1]))))
    t2 = pa.concat_tables(parts)
    trace, meta = _write(tmp_path, t2)
    assert pq.ParquetFile(trace).num_row_groups == 7
    lean, _ = load_golden(trace, meta, lean=True)
    assert lean["optype"].num_chunks == 1 and pa.types.is_dictionary(lean["optype"].type)
    assert lean["dp_rank"].type == pa.int32() and lean["gmc"].type == pa.int16() and lean["step"].type == pa.int32()
    _same_as_whole_file(tmp_path, trace, meta)


def test_plain_strings_nulls_and_nan_times(tmp_path):
    t = _st()
    n = t.num_rows
    names = t["optype"].cast(pa.string()).to_pylist()
    names[5] = None  # an op with no type: rejected with the unknown ones
    names[7] = "not-an-op"
    t = _set(t, "optype", pa.array(names, pa.string()))
    start = t["start_ts"].to_numpy().copy()
    start[11] = np.nan
    t = _set(t, "start_ts", pa.array(start))
    dur = t["duration"].to_pylist()
    dur[13] = None
    t = _set(t, "duration", pa.array(dur, pa.float32()))
    seq = t["seq_id"].to_pylist()
    seq[17] = None  # an optional id: its default
    t = _set(t, "seq_id", pa.array(seq, pa.int32()))
    trace, meta = _write(tmp_path, t, row_group_size=n // 3 + 1)
    d = _same_as_whole_file(tmp_path, trace, meta)
    assert any("unknown types" in w for w in d["warnings"]), d["warnings"]
    assert any("non-finite" in w for w in d["warnings"]), d["warnings"]


def test_missing_optional_columns_and_unsigned_ids(tmp_path):
    t = _st().drop_columns(["mb_id", "rank"])
    t = _set(t, "dp_rank", t["dp_rank"].cast(pa.uint32()))
    trace, meta = _write(tmp_path, t)
    lean, _ = load_golden(trace, meta, lean=True)
    assert "mb_id" not in lean.column_names and lean["dp_rank"].type == pa.int32()
    _same_as_whole_file(tmp_path, trace, meta)


@pytest.mark.parametrize("change", ["float ids", "steps past int32", "ids past int32"])
def test_files_it_cannot_stream_are_read_whole(tmp_path, monkeypatch, change):
    monkeypatch.setattr(parallel, "MIN_PARALLEL_CELLS", 0)  # a value that does not fit, seen on a thread
    monkeypatch.setenv(parallel.ENV, "3")
    t = _st()
    if change == "float ids":
        t = _set(t, "stage", t["stage"].cast(pa.float64()))
    elif change == "steps past int32":
        t = _set(t, "step", pc.add(t["step"], pa.scalar(2**33, pa.int64())))
    else:
        t = _set(t, "seq_id", pc.add(t["seq_id"].cast(pa.int64()), pa.scalar(2**40, pa.int64())))
    trace, meta = _write(tmp_path, t)
    calls = []
    real = golden._read_lean
    monkeypatch.setattr(golden, "_read_lean", lambda *a: calls.append(real(*a)) or calls[-1])
    if change != "ids past int32":
        _same_as_whole_file(tmp_path, trace, meta)
    else:  # the whole-file path says what is wrong
        with pytest.raises(ValueError, match="seq_id"):
            whatif_files(trace, meta, tmp_path / "o.json")
    assert calls == [None]
