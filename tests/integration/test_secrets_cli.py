"""Secrets stay secret and expected failures stay one line (issue 18): the CLI as users run it.

Unreachable store, broker or Ray, a wrong password: exit code 2, one line on
stderr, no traceback (the client libraries' own logs included), and the
password nowhere in stdout or stderr.
"""
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SECRET = "SuperSecret42"


def _cli(*args, env_extra=None, timeout=120):
    env = dict(os.environ, STRAGGLERSCOPE_PIPELINE_METRICS_PORT="-1", **(env_extra or {}))
    for k in ("STRAGGLERSCOPE_STORE", "STRAGGLERSCOPE_STORE_PASSWORD", "STRAGGLERSCOPE_STORE_PASSWORD_FILE"):
        if k not in (env_extra or {}):
            env.pop(k, None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "stragglerscope", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=timeout)
    r.seconds = time.monotonic() - t0
    return r


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _expected_failure(r, *secrets, says: str):
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out
    for s in secrets:
        assert s not in out, out
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("stragglerscope ") and ": error: " in last and says in last, out
    # Progress lines before it are ours (fixed-width labels), never a library's log line.
    assert all(line[:11].rstrip() in ("logs", "broker", "topics", "store", "ray", "metrics") for line in
               r.stderr.strip().splitlines()[:-1]), out


def test_run_against_an_unreachable_server_store_hides_the_password(tmp_path):
    url = f"clickhouse://admin:{SECRET}@127.0.0.1:{_closed_port()}/db"
    r = _cli("run", env_extra={"STRAGGLERSCOPE_STORE": url})
    _expected_failure(r, SECRET, says="unreachable")
    assert "store      clickhouse://admin:***@127.0.0.1:" in r.stderr


def test_unreachable_broker_is_one_line():
    r = _cli("run", env_extra={"STRAGGLERSCOPE_KAFKA_BOOTSTRAP": f"127.0.0.1:{_closed_port()}"})
    _expected_failure(r, says="no Kafka broker reachable")


def test_a_broker_that_never_answers_is_one_line_without_library_logs():
    """Something accepts the connection and says nothing: kafka-python logs errors as it gives up."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        r = _cli("run", env_extra={"STRAGGLERSCOPE_KAFKA_BOOTSTRAP": f"127.0.0.1:{srv.getsockname()[1]}"})
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()
    _expected_failure(r, says="cannot reach Kafka")
    # No kafka-python logger (kafka.net.manager, kafka.cluster, ...) reached the terminal; our hint may
    # name settings such as kafka.security_protocol.
    assert not re.search(r"\bkafka\.(net|conn|client|cluster|admin|consumer|producer|protocol)\b", r.stderr), r.stderr


def test_unreachable_ray_fails_fast_in_one_line(tmp_path):
    """ray.init() to a closed port retries for minutes (over 5 in our measurement): checked first."""
    r = _cli("run", env_extra={"STRAGGLERSCOPE_RAY_ADDRESS": f"127.0.0.1:{_closed_port()}",
                               "STRAGGLERSCOPE_STORE": f"chdb://{tmp_path / 'store'}"})
    _expected_failure(r, says="no Ray cluster reachable")
    assert r.seconds < 90


def test_a_ray_address_that_is_not_ray_fails_in_one_line(tmp_path):
    """A port that accepts and never speaks gRPC (a broker's, say): ray.init retried for ever (killed at 100 s)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    try:
        r = _cli("run", env_extra={"STRAGGLERSCOPE_RAY_ADDRESS": f"127.0.0.1:{srv.getsockname()[1]}",
                                   "STRAGGLERSCOPE_STORE": f"chdb://{tmp_path / 'store'}"})
    finally:
        srv.close()
    _expected_failure(r, says="is not a Ray head")
    assert r.seconds < 90


@pytest.fixture(scope="module")
def secured_server():
    from services.clickhouse_server import ClickHouseServer, find_server_binary

    if not find_server_binary():
        pytest.skip("clickhouse-server is not installed")
    with ClickHouseServer(user="admin", password=SECRET) as srv:
        yield srv


def test_wrong_password_is_one_line_and_neither_password_shows(secured_server):
    url = f"clickhouse://admin:WrongPass99@127.0.0.1:{secured_server.tcp_port}/db"
    r = _cli("sql", "fleet_summary", "--store", url)
    _expected_failure(r, SECRET, "WrongPass99", says="Wrong password")


def test_password_from_the_environment_or_a_file(secured_server, tmp_path):
    url = f"clickhouse://admin@127.0.0.1:{secured_server.tcp_port}/db"
    r = _cli("sql", "fleet_summary", "--store", url, env_extra={"STRAGGLERSCOPE_STORE_PASSWORD": SECRET})
    assert r.returncode == 0, r.stderr
    pw = tmp_path / "pw"
    pw.write_text(SECRET + "\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\nurl = "{url}"\npassword_file = "{pw}"\n')
    r = _cli("sql", "fleet_summary", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    pw.write_text("not-it\n")
    r = _cli("sql", "fleet_summary", "--config", str(cfg))
    _expected_failure(r, SECRET, "not-it", says="Wrong password")
