"""The store daemon: one process owns the chDB path, other processes read and write through it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from services.store_daemon import StoreDaemon
from storage import StoreError, open_store
from storage.daemon import DISCOVERY_FILE, HttpStore, discover
from tests.storage.conftest import window_rows

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(code: str) -> str:
    """Run ``code`` in a second Python process (repo on the path); its stdout."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_two_processes_share_a_chdb_path_through_the_daemon(tmp_path):
    url = f"chdb://{tmp_path / 'store'}"
    with StoreDaemon(url) as daemon:
        info = json.loads((tmp_path / "store" / DISCOVERY_FILE).read_text())
        assert info["url"] == daemon.url and info["pid"] == daemon.pid
        assert daemon.url.startswith("http://127.0.0.1:")
        # A writer in another process opens the chdb:// URL and is sent to the daemon.
        out = _child(f"""
            from storage import open_store
            from tests.storage.conftest import window_rows
            s = open_store({url!r})
            s.setup()
            s.insert("window", window_rows(3, job="w"))
            s.insert("window", window_rows(3, job="w"))
            s.store_offsets("src", {{("ss.ops", 0): 42}})
            print(type(s).__name__, s.window_stored(("w", 0, 10)))
        """)
        assert out == "HttpStore True"
        # This process reads what the other wrote, while the daemon holds the path.
        reader = open_store(url)
        assert isinstance(reader, HttpStore)
        assert reader.run_named("fleet_summary").to_pylist()[0]["windows"] == 3
        assert reader.load_offsets("src", ["ss.ops"], [0]) == {("ss.ops", 0): 42}
        assert reader.query("SELECT count() AS n FROM windows WHERE job_id = {j:String}", {"j": "w"}) \
            .column("n")[0].as_py() == 3
        with pytest.raises(StoreError, match="INSERT statements are refused"):
            reader.query("INSERT INTO windows_data (job_id) VALUES ('x')")
        with pytest.raises(StoreError, match="unknown query"):
            reader.run_named("nope")
        # The path itself is locked: opening it directly in a third process fails with a clear message.
        from storage.chdb_backend import ChdbStore

        with pytest.raises(StoreError, match="in use by process"):
            ChdbStore(str(tmp_path / "store"))
        reader.close()
    assert not (tmp_path / "store" / DISCOVERY_FILE).exists()
    # Without the daemon the same URL opens the path in-process and finds the data.
    s = open_store(url)
    try:
        assert type(s).__name__ == "ChdbStore"
        assert s.run_named("fleet_summary").to_pylist()[0]["windows"] == 3
    finally:
        s.close()


def test_daemon_api_matches_the_embedded_store(tmp_path):
    with StoreDaemon(f"chdb://{tmp_path / 's'}") as daemon:
        s = open_store(daemon.url)
        s.setup()
        s.insert("window", window_rows(2, job="x"))
        assert s.window_stored(("x", 0, 0)) and not s.window_stored(("x", 0, 5))
        from tests.storage.conftest import registration

        s.insert("job", registration("x"))
        assert [j["job_id"] for j in s.load_jobs()] == ["x"]
        assert s.run_named("top_wasting_jobs", {"limit": 1, "since": "2020-01-01"}).num_rows == 1
        assert s.enforce_retention() == []
        s.close()


def test_stale_discovery_file_is_removed(tmp_path):
    path = tmp_path / "store"
    path.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (path / DISCOVERY_FILE).write_text(json.dumps({"url": "http://127.0.0.1:1", "pid": dead.pid}))
    assert discover(path) is None
    assert not (path / DISCOVERY_FILE).exists()
    s = open_store(f"chdb://{path}")
    assert type(s).__name__ == "ChdbStore"
    s.close()


def test_daemon_refuses_non_chdb_urls():
    with pytest.raises(StoreError, match="serves chdb://PATH"):
        StoreDaemon("clickhouse://x@127.0.0.1:9000/db")


def test_a_daemon_that_did_not_start_reports_its_own_error_line():
    import tempfile

    d = StoreDaemon("chdb:///nowhere")
    d._log = tempfile.TemporaryFile()
    d._log.write(b"store daemon: error: Code: 60. DB::Exception: Could not find table: link_cells_data.\n"
                 b"Fatal Python error: PyGILState_Release\n<no Python frame>\n\n")
    assert "Could not find table: link_cells_data" in d._stderr_tail()
    d._log = tempfile.TemporaryFile()
    d._log.write(b"Traceback ...\nImportError: no chdb\n")
    assert d._stderr_tail() == "ImportError: no chdb"
