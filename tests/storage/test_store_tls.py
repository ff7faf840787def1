"""TLS and authentication to a real ClickHouse 18.16 server: its secure native port, a CA made here, a password.

The certificates are made with the ``openssl`` command in a temporary
directory (``tests.tls.make_certs``): a CA, a server certificate for IP
127.0.0.1 and the name ``localhost`` signed by it, a client certificate,
and a second CA that signed nothing of this server's. The servers listen on 127.0.0.1 only
and stop at the end of the module. Skipped only when ``clickhouse-server``
or ``openssl`` is not installed.
"""
from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from services.clickhouse_server import ClickHouseServer, find_server_binary
from storage import StoreError, open_store
from tests.storage.conftest import window_rows
from tests.tls import Certs, make_certs

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
USER = "ss_writer"
PASSWORD = "Tls-" + uuid.uuid4().hex  # not a word: any message that shows it is a leak


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Certs:
    if not find_server_binary():
        pytest.skip("clickhouse-server is not installed (apt-get install clickhouse-server)")
    if not shutil.which("openssl"):
        pytest.skip("the openssl command is not installed (apt-get install openssl)")
    certs = make_certs(tmp_path_factory.mktemp("pki"))
    fd = os.open(certs.ca.parent / "password", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(PASSWORD + "\n")
    return certs


def _password_file(pki: Certs) -> Path:
    return pki.ca.parent / "password"


@pytest.fixture(scope="module")
def tls_server(pki):
    """18.16 with a password-protected user, its plain native port and a secure one (server certificate only)."""
    with ClickHouseServer(user=USER, password=PASSWORD, tls_cert=pki.server_cert, tls_key=pki.server_key) as s:
        yield s


@pytest.fixture(scope="module")
def mtls_server(pki):
    """The same, but its secure port asks for a client certificate signed by the CA."""
    with ClickHouseServer(user=USER, password=PASSWORD, tls_cert=pki.server_cert, tls_key=pki.server_key,
                          tls_client_ca=pki.ca) as s:
        yield s


def _db() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


def _drop(store) -> None:
    store._execute(f"DROP DATABASE IF EXISTS `{store.database}`")
    store.close()


def _refused(url: str, match: str, within_s: float = 5.0) -> str:
    """The StoreError that opening ``url`` gives: matching ``match``, one line, no password, in bounded time."""
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=match) as e:
        open_store(url)
    took = time.monotonic() - t0
    text = str(e.value)
    assert took < within_s, f"{took:.1f} s: {text}"
    assert PASSWORD not in text and "\n" not in text, text
    return text


def test_store_over_tls_with_the_ca_round_trips_project_tables(tls_server, pki):
    url = tls_server.store_url(_db(), secure=True, with_password=False, ca_certs=pki.ca,
                               password_file=_password_file(pki))
    assert PASSWORD not in url
    t0 = time.monotonic()
    store = open_store(url)
    opened_s = time.monotonic() - t0
    try:
        # It is TLS, to the secure port, checked against our CA: the socket says so, and so does the certificate.
        sock = store._client.connection.socket
        assert isinstance(sock, ssl.SSLSocket) and sock.version() in ("TLSv1.2", "TLSv1.3")
        assert sock.getpeername()[1] == tls_server.tcp_port_secure != tls_server.tcp_port
        assert ("IP Address", "127.0.0.1") in sock.getpeercert()["subjectAltName"]
        assert store.address == f"127.0.0.1:{tls_server.tcp_port_secure}"
        store.setup()
        store.insert("window", window_rows(3, job="tls"))
        store.insert("window", window_rows(3, job="tls"))  # idempotent, as on a plain connection
        assert store.window_stored(("tls", 0, 0)) and not store.window_stored(("tls", 0, 30))
        assert store.run_named("fleet_summary").to_pylist()[0]["windows"] == 3
        n = store.query("SELECT count() AS n FROM windows WHERE job_id = {j:String}", {"j": "tls"})
        assert n.column("n")[0].as_py() == 3  # free SQL: a second connection, over TLS as well
        assert isinstance(store._read_client.connection.socket, ssl.SSLSocket)
        store.store_offsets("src", {("ss.ops", 0): 7})
        assert store.load_offsets("src", ["ss.ops"], [0]) == {("ss.ops", 0): 7}
        assert PASSWORD not in store.url and PASSWORD not in repr(store)
    finally:
        _drop(store)
    print(f"open over TLS: {opened_s:.3f} s")


def test_server_hostname_and_verify(tls_server, pki):
    db = _db()
    # The certificate names localhost as well: checked against that name while connecting to 127.0.0.1.
    store = open_store(tls_server.store_url(db, secure=True, ca_certs=pki.ca, server_hostname="localhost"))
    _drop(store)
    _refused(tls_server.store_url(db, secure=True, ca_certs=pki.ca, server_hostname="other.test"),
             r"TLS to ClickHouse server at 127\.0\.0\.1:\d+ failed: the server's certificate does not name this host")
    # verify=0 encrypts without checking who answers (and says nothing about the CA): it connects.
    store = open_store(tls_server.store_url(db, secure=True, verify=0))
    assert isinstance(store._client.connection.socket, ssl.SSLSocket)
    _drop(store)


def test_wrong_ca_is_one_clear_line(tls_server, pki):
    text = _refused(tls_server.store_url(_db(), secure=True, ca_certs=pki.other_ca),
                    r"the server's certificate is not signed by a CA in ca_certs=.*other-ca\.pem")
    assert text.startswith(f"TLS to ClickHouse server at 127.0.0.1:{tls_server.tcp_port_secure} failed")
    # No ca_certs: the default bundle does not know our CA either.
    _refused(tls_server.store_url(_db(), secure=True), "not signed by a CA in the default CA bundle")


def test_wrong_ca_from_the_command_line_is_one_line_without_traceback(tls_server, pki):
    url = tls_server.store_url(_db(), secure=True, ca_certs=pki.other_ca)
    run = subprocess.run([sys.executable, "-m", "stragglerscope", "sql", "fleet_summary", "--store", url],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = run.stdout + run.stderr
    assert run.returncode == 2, out
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in out, out
    assert "not signed by a CA" in out and PASSWORD not in out, out


def test_secure_against_the_plain_port_fails_fast(tls_server, pki):
    plain = f"clickhouse://{USER}@127.0.0.1:{tls_server.tcp_port}/{_db()}?secure=1&ca_certs={pki.ca}" \
            f"&password_file={_password_file(pki)}"
    _refused(plain, r"failed: the port does not speak TLS: use the server's secure native port", within_s=3.0)
    # The other way round: plain text to the TLS port is refused by the server at once, too.
    _refused(tls_server.store_url(_db()).replace(f":{tls_server.tcp_port}/", f":{tls_server.tcp_port_secure}/"),
             r"is unreachable: .*\(if that is the server's secure port, add secure=1\)", within_s=3.0)


def test_a_port_that_never_answers_is_bounded_by_connect_timeout(pki):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        _refused(f"clickhouse://u@127.0.0.1:{port}/db?secure=1&ca_certs={pki.ca}&connect_timeout=1",
                 r"did not complete the TLS handshake and its hello within 1 s", within_s=4.0)
        # Plain text: the server's hello never comes; before, this waited the 300 s query timeout.
        _refused(f"clickhouse://u@127.0.0.1:{port}/db?connect_timeout=1", r"127\.0\.0\.1:\d+ is unreachable",
                 within_s=4.0)


def test_wrong_password_is_refused_and_not_shown(tls_server, pki):
    wrong = "Wrong-" + uuid.uuid4().hex
    for url in (f"clickhouse://{USER}:{wrong}@127.0.0.1:{tls_server.tcp_port_secure}/{_db()}"
                f"?secure=1&ca_certs={pki.ca}",
                f"clickhouse://{USER}:{wrong}@127.0.0.1:{tls_server.tcp_port}/{_db()}"):
        text = _refused(url, f"ClickHouse server at 127.0.0.1:\\d+ refused the login: Code: 193\\. .*Wrong password "
                             f"for user {USER}")
        assert wrong not in text and "Stack trace" not in text, text
    wrong_file = pki.ca.parent / "wrong-password"
    wrong_file.write_text(wrong)
    text = _refused(tls_server.store_url(_db(), secure=True, with_password=False, ca_certs=pki.ca,
                                         password_file=wrong_file), "refused the login")
    assert wrong not in text
    # No password at all: the user has one, so the server says no as well.
    _refused(tls_server.store_url(_db(), secure=True, with_password=False, ca_certs=pki.ca),
             "refused the login")


def test_client_certificate(mtls_server, pki):
    db = _db()
    _refused(mtls_server.store_url(db, secure=True, ca_certs=pki.ca),
             r"asks for a client certificate[:,] set certfile=")  # TLS 1.3: the alert, or (seldom) a reset
    store = open_store(mtls_server.store_url(db, secure=True, ca_certs=pki.ca, certfile=pki.client_cert,
                                             keyfile=pki.client_key))
    store.setup()
    store.insert("window", window_rows(1, job="mtls"))
    assert store.window_stored(("mtls", 0, 0))
    _drop(store)
    # A certificate is not a login on 18.16: the password still decides.
    _refused(mtls_server.store_url(db, secure=True, with_password=False, ca_certs=pki.ca,
                                   certfile=pki.client_cert, keyfile=pki.client_key), "refused the login")


def test_bad_tls_parameters_are_one_line_store_errors(tmp_path):
    """No server needed: every parameter is checked before anything connects."""
    tmp_path.joinpath("not-pem").write_text("hello\n")
    key = tmp_path / "enc.key"
    if shutil.which("openssl"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-passout", "pass:k3y-pass", "-days", "1",
                        "-subj", "/CN=enc", "-keyout", "enc.key", "-out", "enc.crt"], cwd=tmp_path, check=True,
                       capture_output=True, timeout=60)
    base = f"clickhouse://u:{PASSWORD}@127.0.0.1:1/db"
    cases = [
        ("?secure=maybe",
         r"bad secure='maybe' in store URL clickhouse://u:\*\*\*@127\.0\.0\.1:1/db\?secure=maybe: use 1 or 0"),
        ("?secure=1&verify=sometimes", r"bad verify='sometimes'"),
        (f"?secure=1&ca_certs={tmp_path / 'missing.pem'}", r"cannot read ca_certs=.*missing\.pem .*No such file"),
        (f"?secure=1&ca_certs={tmp_path}", r"is a directory: name a PEM file"),
        (f"?secure=1&ca_certs={tmp_path / 'not-pem'}", r"ca_certs=.*not-pem holds no usable PEM certificate"),
        (f"?ca_certs={tmp_path / 'not-pem'}", r"ca_certs= in store URL .* needs secure=1"),
        ("?verify=0", r"verify= in store URL .* needs secure=1"),
        (f"?secure=1&verify=0&ca_certs={tmp_path / 'not-pem'}", r"verify=0 checks nothing"),
        (f"?secure=1&keyfile={tmp_path / 'not-pem'}", r"keyfile= in store URL .* needs certfile="),
        (f"?secure=1&certfile={tmp_path / 'not-pem'}", r"not a usable client certificate"),
        ("?secure=1&secure=0", r"parameter 'secure' given twice"),
        ("?secure=1&ca_cert=/x", r"unknown parameter 'ca_cert'"),
        ("?secure=1&server_hostname=a%20b", r"bad server_hostname='a b'"),
        ("?secure=1&ca_certs=", r"empty ca_certs="),
        ("?connect_timeout=-3", r"bad connect_timeout='-3'"),
        ("?connect_timeout=soon", r"bad connect_timeout='soon'"),
    ]
    if key.exists():  # an encrypted key would make OpenSSL ask on the terminal: refused before that
        cases.append((f"?secure=1&certfile={tmp_path / 'enc.crt'}&keyfile={key}",
                      r"not a usable client certificate and unencrypted key"))
    for query, match in cases:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=match) as e:
            open_store(base + query)
        assert time.monotonic() - t0 < 2.0, query
        text = str(e.value)
        assert PASSWORD not in text and "\n" not in text, text
