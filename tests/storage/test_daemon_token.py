"""The store daemon's token: a real daemon process, raw HTTP requests, and a second local user where we can be one.

Nothing is mocked: the daemon is ``python -m storage.daemon`` in a child
process, the refused requests are plain ``urllib`` requests, and "another
local user" is a process running as ``nobody`` (only when the tests run as root).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.store_daemon import StoreDaemon
from storage import StoreError, open_store
from storage.daemon import DISCOVERY_FILE, TOKEN_FILE, HttpStore
from storage.daemon.wire import encode
from tests.storage.conftest import window_rows

pytestmark = pytest.mark.integration


def _raw(port: int, method: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """POST /v1/<method> with urllib, as any local process could; (HTTP status, the answer's JSON line)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{method}", data=body, method="POST",
                                 headers={"Content-Type": "application/octet-stream", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read().split(b"\n", 1)[0])
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().split(b"\n", 1)[0])


def _windows(store, job: str) -> int:
    return store.query("SELECT count() AS n FROM windows WHERE job_id = {j:String}", {"j": job}).column("n")[0].as_py()


def test_only_requests_with_the_token_are_served(tmp_path):
    path = tmp_path / "store"
    with StoreDaemon(f"chdb://{path}") as daemon:
        token_file = path / TOKEN_FILE
        # The URL that travels (to Ray actors, the console, daemon.json, logs) names the file, not the token.
        assert daemon.url == f"http://127.0.0.1:{daemon.port}?token_file={token_file}"
        assert json.loads((path / DISCOVERY_FILE).read_text())["url"] == daemon.url
        info = json.loads(token_file.read_text())
        token = info["token"]
        assert len(token) >= 40 and info["url"] == f"http://127.0.0.1:{daemon.port}"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert token not in daemon.url and token not in (path / DISCOVERY_FILE).read_text()

        store = open_store(daemon.url)
        store.setup()
        insert = encode({"kind": "window"}, window_rows(2, job="intruder"))
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 403),
                                ({"Authorization": f"Bearer {token[:-1]}"}, 403),
                                ({"Authorization": f"Basic {token}"}, 403), ({"Authorization": token}, 403)):
            code, answer = _raw(daemon.port, "insert", insert, headers)
            assert code == status, (headers, code, answer)
            assert "refused" in answer["error"] and token not in json.dumps(answer)
        code, _ = _raw(daemon.port, "store_offsets", encode({"source_id": "s", "offsets": [["t", 0, 9]]}))
        assert code == 401
        with pytest.raises(urllib.error.HTTPError) as refused_get:  # GET /ping too
            urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/ping", timeout=10)
        assert refused_get.value.code == 401
        assert _windows(store, "intruder") == 0 and store.load_offsets("s", ["t"], [0]) == {}

        # The same raw request with the token is served: the token is all that stood in the way.
        code, answer = _raw(daemon.port, "insert", insert, {"Authorization": f"Bearer {token}"})
        assert (code, answer) == (200, {"ok": True})
        assert _windows(store, "intruder") == 2
        # chdb://PATH finds the daemon and its token as before.
        other = open_store(f"chdb://{path}")
        assert isinstance(other, HttpStore) and other.window_stored(("intruder", 0, 0))
        other.close()

        # A URL without the token file: one clear line that says what to add.
        with pytest.raises(StoreError, match=r"wants its token \(add \?token_file=.*daemon\.token to the URL"):
            open_store(f"http://127.0.0.1:{daemon.port}")
        with pytest.raises(StoreError, match="unknown parameter 'token'"):
            open_store(f"http://127.0.0.1:{daemon.port}?token={token}")
        store.close()
    assert not token_file.exists() and not (path / DISCOVERY_FILE).exists()  # the daemon took both away


def test_a_token_file_others_may_read_is_refused(tmp_path):
    path = tmp_path / "store"
    with StoreDaemon(f"chdb://{path}") as daemon:
        token_file = path / TOKEN_FILE
        for mode in (0o644, 0o640, 0o604, 0o620):
            token_file.chmod(mode)
            with pytest.raises(StoreError, match=f"open to other users \\(mode 0{mode:o}\\).*chmod 600") as e:
                open_store(daemon.url)
            assert json.loads(token_file.read_text())["token"] not in str(e.value)
        token_file.chmod(0o600)
        store = open_store(daemon.url)
        assert store.window_stored(("nobody", 0, 0)) is False
        store.close()
        # A token written for a daemon at another address is not sent to this one (nor to whoever listens there).
        moved = tmp_path / "moved.token"
        info = json.loads(token_file.read_text())
        fd = os.open(moved, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({**info, "url": "http://127.0.0.1:1"}, f)
        with pytest.raises(StoreError, match="is for the store daemon at http://127.0.0.1:1, not"):
            open_store(f"http://127.0.0.1:{daemon.port}?token_file={moved}")
        with pytest.raises(StoreError, match="cannot read the store daemon's token file .*No such file"):
            open_store(f"http://127.0.0.1:{daemon.port}?token_file={tmp_path / 'none'}")


def test_a_daemon_restarted_on_the_same_port_has_a_new_token_and_clients_follow(tmp_path):
    path = tmp_path / "store"
    with StoreDaemon(f"chdb://{path}") as first:
        port, url = first.port, first.url
        client = open_store(url)
        client.setup()
        client.insert("window", window_rows(1, job="before"))
        old = json.loads((path / TOKEN_FILE).read_text())["token"]
    with StoreDaemon(f"chdb://{path}", port=port) as second:
        assert second.url == url
        new = json.loads((path / TOKEN_FILE).read_text())["token"]
        assert new != old
        code, _ = _raw(port, "window_stored", encode({"key": ["before", 0, 0]}), {"Authorization": f"Bearer {old}"})
        assert code == 403  # the old daemon's token opens nothing
        # The client opened against the first daemon reads the file again once refused, and goes on.
        client.insert("window", window_rows(1, job="after"))
        assert client.window_stored(("before", 0, 0)) and client.window_stored(("after", 0, 0))
        client.close()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to run as another user")
def test_another_local_user_can_neither_read_the_token_nor_write():
    """As ``nobody``: the store's directory is open to it (0755), the token file (0600) is not, nor the daemon."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if not python:
        pytest.skip("no /usr/bin/python3 for the other user")
    base = Path(tempfile.mkdtemp(prefix="ss-token-"))
    try:
        base.chmod(0o755)
        path = base / "store"
        with StoreDaemon(f"chdb://{path}") as daemon:
            path.chmod(0o755)
            store = open_store(daemon.url)
            store.setup()
            body = encode({"kind": "window"}, window_rows(1, job="nobody"))
            (base / "body").write_bytes(body)
            (base / "body").chmod(0o644)
            code = textwrap.dedent(f"""
                import json, os, urllib.request, urllib.error
                out = {{"uid": os.getuid()}}
                try:
                    open({str(path / TOKEN_FILE)!r}).read()
                    out["read"] = "yes"
                except PermissionError:
                    out["read"] = "denied"
                out["listed"] = {TOKEN_FILE!r} in os.listdir({str(path)!r})
                req = urllib.request.Request("http://127.0.0.1:{daemon.port}/v1/insert",
                                             data=open({str(base / 'body')!r}, "rb").read(), method="POST")
                try:
                    urllib.request.urlopen(req, timeout=30)
                    out["insert"] = 200
                except urllib.error.HTTPError as e:
                    out["insert"] = e.code
                print(json.dumps(out))
            """)
            run = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, user=65534,
                                 group=65534, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"})
            assert run.returncode == 0, run.stderr
            seen = json.loads(run.stdout)
            assert seen == {"uid": 65534, "read": "denied", "listed": True, "insert": 401}, seen
            assert _windows(store, "nobody") == 0
            store.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
