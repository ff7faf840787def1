"""`stragglerscope advise JOB`: remedies of a stored window, printed best first and stored for the console."""
import json

import pytest

from stragglerscope.cli import main

pytestmark = pytest.mark.integration  # a real chDB store


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    from storage import open_store
    from tests.ui.conftest import fill_demo_store

    url = f"chdb://{tmp_path_factory.mktemp('advise') / 'store'}"
    store = open_store(url)
    store.setup()
    fill_demo_store(store, n_jobs=8, windows=1, seed=3)
    store.close()
    return url


def _job_with(cause):
    """The first job of the fixture's fleet with ``cause`` running plain 1F1B (the repartition remedy
    models 1F1B stage partitions; it offers nothing for interleaved jobs)."""
    from generators.fleetgen import make_fleet

    return next(f"ui-{i:03d}" for i, j in enumerate(make_fleet(8, 3, 8, 256))
                if j.cause == cause and j.layout.vpp_size == 1)


def test_advise_prints_and_stores_the_ranked_remedies(store_url, capsys):
    from storage import open_store

    job = _job_with("heavy_last_stage")
    assert main(["advise", job, "--store", store_url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{job} attempt 0 window 0:") and "1. [repartition] +" in out, out
    store = open_store(store_url)
    try:
        rows = store.run_named("job_remedies", {"job_id": job}).to_pylist()
    finally:
        store.close()
    assert rows[0]["kind"] == "repartition" and rows[0]["priority"] == 1 and rows[0]["predicted_gain"] > 0.01
    # The advice is the latest batch: running again replaces what readers see, it does not add to it.
    assert main(["advise", job, "--store", store_url, "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["kind"] for r in lines] == [r["kind"] for r in rows]


def test_advise_errors_are_one_clear_line(store_url, capsys):
    assert main(["advise", "no-such-job", "--store", store_url]) == 2
    assert "advise: error: job 'no-such-job' is not registered in the store" in capsys.readouterr().err
    assert main(["advise", _job_with("none"), "--window", "7", "--store", store_url]) == 2
    assert "has no window 7 (windows: 0)" in capsys.readouterr().err


def test_advise_defaults_to_the_latest_window_with_kept_spans(store_url, capsys):
    """The pipeline keeps raw spans of some windows only (pipeline.keep_op_spans_every_s): a newer window
    without them does not hide the advice of the one that has them; asked for by id, it is a clear error."""
    from storage import open_store
    from tests.storage.conftest import window_rows

    job = _job_with("heavy_last_stage")
    store = open_store(store_url)
    try:
        store.insert("window", window_rows(1, job=job, first_window=90))
    finally:
        store.close()
    assert main(["advise", job, "--store", store_url]) == 0
    assert capsys.readouterr().out.startswith(f"{job} attempt 0 window 0:")
    assert main(["advise", job, "--window", "90", "--store", store_url]) == 2
    err = capsys.readouterr().err
    assert "no raw op spans are kept for window 90" in err and "keep_op_spans_every_s" in err


def test_timeline_writes_the_window_the_console_draws(store_url, tmp_path, capsys):
    """`stragglerscope timeline JOB`: the latest window with raw spans, its actual and ideal timelines as a
    Perfetto trace; a job or window without spans is one clear line."""
    import gzip

    job = _job_with("heavy_last_stage")
    out = tmp_path / "t.json.gz"
    assert main(["timeline", job, "--store", store_url, "--out", str(out)]) == 0
    assert "ui.perfetto.dev" in capsys.readouterr().out
    events = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"actual dp0/pp0", "ideal dp0/pp0"} <= names
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and {e["args"]["step"] for e in spans} and all(e["dur"] >= 0 for e in spans)
    assert main(["timeline", "no-such-job", "--store", store_url, "--out", str(out)]) == 2
    assert "timeline: error: job 'no-such-job' is not registered in the store" in capsys.readouterr().err
