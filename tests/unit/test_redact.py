"""Secrets stay secret: passwords in URLs, query strings, messages, logs and one-line errors are ***."""
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core import config as C
from core.redact import RedactingFilter, add_secret, redact

ROOT = Path(__file__).resolve().parents[2]
SECRET = "SuperSecret42"


@pytest.mark.parametrize("text, want", [
    ("clickhouse://admin:SuperSecret42@ch:9000/db", "clickhouse://admin:***@ch:9000/db"),
    ("store clickhouse://admin:p%40ss@ch:9000/db (served)", "store clickhouse://admin:***@ch:9000/db (served)"),
    ("'clickhouse://admin:SuperSecret42@ch:9000/bad-db'", "'clickhouse://admin:***@ch:9000/bad-db'"),
    ("clickhouse://admin:p@ss@ch:9000/db", "clickhouse://admin:***@ch:9000/db"),  # an unencoded @
    ("clickhouse://default:@127.0.0.1:9000/default", "clickhouse://default:@127.0.0.1:9000/default"),
    ("http://127.0.0.1:8123/x?user=a&password=SuperSecret42&db=b", "http://127.0.0.1:8123/x?user=a&password=***&db=b"),
    ("{'sasl_plain_password': 'SuperSecret42', 'acks': 1}", "{'sasl_plain_password': '***', 'acks': 1}"),
    ('{"password": "SuperSecret42"}', '{"password": "***"}'),
    ("STRAGGLERSCOPE_STORE_PASSWORD=SuperSecret42 x", "STRAGGLERSCOPE_STORE_PASSWORD=*** x"),
    ("token: abc.def", "token: ***"),
    ("Failed to connect to admin:SuperSecret42@h:9000", "Failed to connect to admin:***@h:9000"),
])
def test_passwords_are_masked(text, want):
    assert redact(text) == want


@pytest.mark.parametrize("text", [
    "Code: 193. DB::Exception: Wrong password for user admin.",
    "clickhouse://admin@ch:9000/db?password_file=/run/secrets/ch",
    "no Kafka broker reachable at 127.0.0.1:9092,127.0.0.2:9092",
    "http://127.0.0.1:8123",
    "tokens=5 secretary: x",
    "sasl_plain_password=None",
])
def test_what_is_no_secret_is_left_alone(text):
    assert redact(text) == text


def test_registered_secrets_are_masked_anywhere():
    add_secret("Registered-Secret/99")
    assert redact("got Registered-Secret/99 and Registered-Secret%2F99") == "got *** and ***"
    add_secret("abc")  # too short to mask safely: ordinary words would go
    assert redact("abc") == "abc"


def test_errors_redact_their_message():
    from core.kafka_admin import BrokerError
    from ray_jobs.errors import PipelineError
    from storage import StoreError

    for cls in (StoreError, BrokerError, PipelineError):
        e = cls(f"cannot open clickhouse://admin:{SECRET}@h:9000/db\nsecond line")
        assert SECRET not in str(e) and "admin:***@h" in str(e) and "\n" not in str(e)


def _record_with_traceback() -> logging.LogRecord:
    try:
        raise ConnectionError(f"refused by clickhouse://admin:{SECRET}@h:9000/db")
    except ConnectionError:
        return logging.LogRecord("clickhouse_driver.connection", logging.WARNING, __file__, 1,
                                 "Failed to connect to %s", ("admin:" + SECRET + "@h",), sys.exc_info())


def test_log_filter_redacts_messages_and_tracebacks_for_text_and_json():
    from core.logs import JsonFormatter

    for fmt in (logging.Formatter("%(levelname)s %(message)s"), JsonFormatter()):
        out = io.StringIO()
        handler = logging.StreamHandler(out)
        handler.setFormatter(fmt)
        handler.addFilter(RedactingFilter())
        handler.handle(_record_with_traceback())
        text = out.getvalue()
        assert SECRET not in text and "***" in text, text
        assert "ConnectionError" in text  # the traceback is kept, redacted
        if isinstance(fmt, JsonFormatter):
            assert "ConnectionError" in json.loads(text)["exc"]


# -- where the password comes from -------------------------------------------------------------

def test_password_from_the_environment_goes_into_the_url():
    cfg = C.load(env={"STRAGGLERSCOPE_STORE": "clickhouse://admin@ch:9000/db",
                      "STRAGGLERSCOPE_STORE_PASSWORD": "p@ss word"})
    assert cfg.store.url == "clickhouse://admin:p%40ss%20word@ch:9000/db"
    assert "p@ss" not in repr(cfg) and "p@ss" not in repr(cfg.store)
    assert C.with_store_credentials(cfg) == cfg  # idempotent
    assert redact(cfg.store.url) == "clickhouse://admin:***@ch:9000/db"


def test_password_file_goes_into_the_url_as_a_reference(tmp_path):
    cfg = C.load(env={"STRAGGLERSCOPE_STORE": "clickhouse://admin@ch:9000/db",
                      "STRAGGLERSCOPE_STORE_PASSWORD_FILE": str(tmp_path / "pw")})
    assert cfg.store.url == f"clickhouse://admin@ch:9000/db?password_file={str(tmp_path / 'pw').replace('/', '%2F')}"
    # A store URL given later (--store) gets it too.
    again = C.with_store_credentials(cfg.replace(store={"url": "clickhouse://admin@other:9000/db"}))
    assert again.store.url.startswith("clickhouse://admin@other:9000/db?password_file=")


def test_password_sources_are_exclusive_and_never_in_a_file(tmp_path):
    with pytest.raises(C.ConfigError, match="keep one"):
        C.load(env={"STRAGGLERSCOPE_STORE": "clickhouse://admin:x@ch:9000/db", "STRAGGLERSCOPE_STORE_PASSWORD": "y"})
    with pytest.raises(C.ConfigError, match="keep one"):
        C.load(env={"STRAGGLERSCOPE_STORE_PASSWORD": "y", "STRAGGLERSCOPE_STORE_PASSWORD_FILE": "/f",
                    "STRAGGLERSCOPE_STORE": "clickhouse://a@h/db"})
    f = tmp_path / "c.toml"
    f.write_text('[store]\npassword = "SuperSecret42"\n')
    with pytest.raises(C.ConfigError, match="STRAGGLERSCOPE_STORE_PASSWORD") as e:
        C.load(str(f), env={})
    assert SECRET not in str(e.value)
    # Not a server store: nothing to do.
    assert C.load(env={"STRAGGLERSCOPE_STORE_PASSWORD": "y"}).store.url == C.StoreConfig().url


def test_help_and_config_name_the_password_sources(capsys):
    from stragglerscope.cli import main

    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "password_file" in out and "STRAGGLERSCOPE_STORE_PASSWORD" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "STRAGGLERSCOPE_STORE_PASSWORD" in out and "password_file" in out


def test_open_store_reads_the_password_file(tmp_path):
    from storage import StoreError, _server_credentials, open_store

    pw = tmp_path / "pw"
    pw.write_text("s3cr/et@x\n")
    assert _server_credentials(f"clickhouse://admin@h:9000/db?password_file={pw}") == \
        "clickhouse://admin:s3cr%2Fet%40x@h:9000/db"
    assert redact("refused: s3cr/et@x") == "refused: ***"  # registered when read
    with pytest.raises(StoreError, match="cannot read the store password file"):
        open_store(f"clickhouse://admin@h:9000/db?password_file={tmp_path / 'missing'}")
    with pytest.raises(StoreError, match="keep one"):
        open_store(f"clickhouse://admin:x@h:9000/db?password_file={pw}")


# -- the command line, as users run it ----------------------------------------------------------

def _cli(*args, env_extra=None, timeout=60):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "stragglerscope", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
@pytest.mark.parametrize("db", ["db", "bad-db"])
def test_unreachable_store_is_one_line_without_the_password(db):
    r = _cli("sql", "fleet_summary", "--store", f"clickhouse://admin:{SECRET}@127.0.0.1:{_closed_port()}/{db}")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert SECRET not in out and "Traceback" not in out, out
    assert len(r.stderr.strip().splitlines()) == 1, out
    assert "admin:***@" in out or "unreachable" in out


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_verbose_shows_library_logs_redacted():
    r = _cli("-v", "sql", "fleet_summary", "--store", f"clickhouse://admin:{SECRET}@127.0.0.1:{_closed_port()}/db")
    assert r.returncode == 2
    assert SECRET not in r.stdout + r.stderr
