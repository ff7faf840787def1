"""Kafka over TLS (server and mutual) and SASL, against the real Tansu broker (issue 18, deliverable 5).

Tansu 0.6 cannot serve TLS itself (``--cert`` and ``--key`` are refused
together, and its listener never wraps connections), so TLS is terminated by
``tests.tls.TLSTerminator`` (OpenSSL) in front of it, with the broker
advertising the terminator's address: every client connection, bootstrap and
partition leader alike, goes through TLS. With ``--authentication`` Tansu
0.6 offers SCRAM only, against credentials in its storage; RELIABILITY.md
says what that leaves untested.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from core import codec, topics
from core.kafka_admin import BrokerError, prepare_topics
from core.kafka_conn import KafkaConn, KafkaConnError
from core.layout import JobLayout
from services.broker import LocalBroker
from services.ports import free_port
from tests.tls import TLSTerminator, make_certs

pytestmark = pytest.mark.integration

GOLDEN_ST = Path(__file__).resolve().parent.parent / "golden" / "whatif" / "ST"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    try:
        return make_certs(tmp_path_factory.mktemp("certs"))
    except FileNotFoundError:
        pytest.skip("the openssl command is not installed")


@pytest.fixture(scope="module")
def mtls_broker(certs):
    """Tansu behind a terminator that requires client certificates signed by the test CA."""
    front = free_port()
    with LocalBroker(advertise=f"127.0.0.1:{front}") as b, \
            TLSTerminator(b.port, certs, client_ca=certs.ca, port=front) as tls:
        yield tls


@pytest.fixture(scope="module")
def tls_broker(certs):
    """Tansu behind a terminator with server authentication only."""
    front = free_port()
    with LocalBroker(advertise=f"127.0.0.1:{front}") as b, TLSTerminator(b.port, certs, port=front) as tls:
        yield tls


@pytest.fixture(scope="module")
def sasl_broker():
    with LocalBroker(authentication=True) as b:
        yield b


def _quick(conn: KafkaConn, seconds: float = 8.0) -> str:
    """The one-line error of preparing topics with ``conn``, checked to come within ``seconds``."""
    t0 = time.monotonic()
    with pytest.raises(BrokerError) as e:
        prepare_topics(conn, 2, timeout_s=4.0)
    took = time.monotonic() - t0
    assert took < seconds, f"the refusal took {took:.1f} s"
    assert "\n" not in str(e.value)
    return str(e.value)


def _quick_at_once(conns: list[KafkaConn], seconds: float) -> list[str]:
    """``_quick`` of each of ``conns``, on threads of their own: each refusal is a wait (the bootstrap timeout,
    then ``diagnose``'s probe), not work, so they are waited out together; each still checked to come in time."""
    with ThreadPoolExecutor(len(conns)) as pool:
        return list(pool.map(lambda c: _quick(c, seconds), conns))


def test_replay_through_mutual_tls_stores_the_published_slowdown(mtls_broker, certs, tmp_path):
    """The whole pipeline over mutual TLS, as users run it: producer, admin, Ray shards' consumers."""
    env = dict(os.environ, STRAGGLERSCOPE_STORE=f"chdb://{tmp_path / 'store'}",
               STRAGGLERSCOPE_PIPELINE_METRICS_PORT="-1",
               STRAGGLERSCOPE_KAFKA_BOOTSTRAP=f"127.0.0.1:{mtls_broker.port}",
               STRAGGLERSCOPE_KAFKA_PARTITIONS="2",
               STRAGGLERSCOPE_KAFKA_SECURITY_PROTOCOL="SSL", STRAGGLERSCOPE_KAFKA_SSL_CAFILE=str(certs.ca),
               STRAGGLERSCOPE_KAFKA_SSL_CERTFILE=str(certs.client_cert),
               STRAGGLERSCOPE_KAFKA_SSL_KEYFILE=str(certs.client_key))
    before = mtls_broker.connections
    r = subprocess.run([sys.executable, "-m", "stragglerscope", "replay", str(GOLDEN_ST), "--timeout", "180"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stored     1 windows" in r.stderr, r.stderr[-3000:]
    assert mtls_broker.connections > before  # it went through the terminator, not around it
    r = subprocess.run([sys.executable, "-m", "stragglerscope", "sql", "job_windows", "--param", "job_id=ST",
                        "--format", "json"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert abs(row["slowdown"] / 1.1787021836556841 - 1) < 0.005


def test_tls_producer_and_shard_source_round_trip(tls_broker, certs):
    """Producer and shard source over server-authenticated TLS: what goes in comes out."""
    from generators.fleetgen import JobSpec, generate_window
    from ingest.producer import TelemetryProducer
    from ray_jobs.kafka_source import KafkaSource

    conn = KafkaConn(f"127.0.0.1:{tls_broker.port}", security_protocol="SSL", ssl_cafile=str(certs.ca))
    prepare_topics(conn, 2, outputs=False)
    spec = JobSpec("tls-roundtrip", JobLayout(2, 2), 4)
    table = generate_window(spec, 0, 2, 0)
    with TelemetryProducer(conn) as p:
        p.send(table)
        assert p.flush(30)
    assert p.stats.records_sent == table.num_rows and p.stats.records_dropped == 0
    src = KafkaSource(conn, [topics.TOPIC_OPS], range(2))
    src.seek({})
    rows = 0
    for _ in range(40):
        for m in src.poll(500):
            rows += codec.decode(m.value)[1].num_rows
        if rows >= table.num_rows:
            break
    src.close()
    assert rows == table.num_rows


def test_tls_refusals_are_one_line_and_quick(tls_broker, mtls_broker, certs):
    where = f"127.0.0.1:{tls_broker.port}"
    # Each waits out its 4 s bootstrap timeout: the three at once (none is SASL, so no refusal watch hears
    # another's records; each client has its own connections through the terminators).
    bad_ca, plaintext, no_cert = _quick_at_once([
        # A CA that did not sign the broker's certificate.
        KafkaConn(where, security_protocol="SSL", ssl_cafile=str(certs.other_ca)),
        # Plaintext to a TLS port.
        KafkaConn(where),
        # Mutual TLS without a client certificate.
        KafkaConn(f"127.0.0.1:{mtls_broker.port}", security_protocol="SSL", ssl_cafile=str(certs.ca)),
    ], seconds=8.0)
    assert "certificate verify failed" in bad_ca, bad_ca
    assert f"{where} speaks TLS: set kafka.security_protocol = SSL" in plaintext, plaintext
    assert "does it require a client certificate (kafka.ssl_certfile)?" in no_cert, no_cert


def test_sasl_without_credentials_the_broker_knows_is_refused(sasl_broker):
    """Tansu --authentication: no SASL, an unknown SCRAM user and PLAIN (not offered) are all refused."""
    where = sasl_broker.bootstrap
    secret = "S3cret-not-in-any-message"

    def sasl(mech: str) -> KafkaConn:
        return KafkaConn(where, security_protocol="SASL_PLAINTEXT", sasl_mechanism=mech, sasl_username="nobody",
                         sasl_password=secret)

    # The four refusals were about 7 s of waiting each, one after another. They run two at a time, paired so
    # that no case's outcome can come from the other's: a SASL bootstrap watches every kafka.net record of the
    # process (core.kafka_admin._RefusalWatch) and takes dropped connections (Tansu's answer to PLAIN and to a
    # client without SASL) for a refusal. So the two that are dropped go together (the plaintext client has no
    # watch; PLAIN's, alone too, ends on its drops or its timeout, whichever comes first), then the two SCRAM
    # ones, which are never dropped (kafka-python fails on Tansu's answer: 'v') and never said refused by a
    # record. Two watches at once may leave kafka.net's level and propagation as the other found them: put back.
    net = logging.getLogger("kafka.net")
    saved = net.level, net.propagate
    try:
        plain, plain_mech = _quick_at_once([KafkaConn(where), sasl("PLAIN")], seconds=15)
        scram = _quick_at_once([sasl("SCRAM-SHA-256"), sasl("SCRAM-SHA-512")], seconds=15)
    finally:
        net.setLevel(saved[0])
        net.propagate = saved[1]
    assert "does it require SASL (kafka.security_protocol)?" in plain, plain
    for mech, msg in zip(("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"), [plain_mech, *scram]):
        assert f"({'SASL_PLAINTEXT'} {mech} as nobody)" in msg and "check kafka.sasl_username" in msg, msg
        assert secret not in msg


def test_bad_transport_settings_are_config_errors(tmp_path, certs):
    from core.config import ConfigError, load

    base = {"STRAGGLERSCOPE_KAFKA_BOOTSTRAP": "127.0.0.1:9"}
    cases = [
        ({"STRAGGLERSCOPE_KAFKA_SECURITY_PROTOCOL": "TLS"}, "must be one of PLAINTEXT, SSL"),
        ({"STRAGGLERSCOPE_KAFKA_SECURITY_PROTOCOL": "SSL", "STRAGGLERSCOPE_KAFKA_SSL_CAFILE": "/nonexistent/ca.pem"},
         "kafka.ssl_cafile: no such file"),
        ({"STRAGGLERSCOPE_KAFKA_SSL_CAFILE": str(certs.ca)}, "does not use TLS"),
        ({"STRAGGLERSCOPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "needs kafka.sasl_username"),
        ({"STRAGGLERSCOPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "STRAGGLERSCOPE_KAFKA_SASL_USERNAME": "u"},
         "needs a password"),
        ({"STRAGGLERSCOPE_KAFKA_SECURITY_PROTOCOL": "SSL", "STRAGGLERSCOPE_KAFKA_BOOTSTRAP": ""},
         "needs kafka.bootstrap"),
        ({"STRAGGLERSCOPE_KAFKA_SECURITY_PROTOCOL": "SSL", "STRAGGLERSCOPE_KAFKA_SSL_KEYFILE": str(certs.client_key)},
         "ssl_keyfile needs kafka.ssl_certfile"),
    ]
    for extra, expected in cases:
        with pytest.raises(ConfigError, match=expected):
            load(env=base | extra)
    toml = tmp_path / "c.toml"
    toml.write_text('[kafka]\nbootstrap = "h:1"\nsasl_password = "x"\n')
    with pytest.raises(ConfigError, match="does not belong in a file"):
        load(str(toml), env={})
    # A password file works and stays out of every representation.
    pw = tmp_path / "pw"
    pw.write_text("hunter2\n")
    cfg = load(env=base | {"STRAGGLERSCOPE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
                           "STRAGGLERSCOPE_KAFKA_SASL_USERNAME": "u",
                           "STRAGGLERSCOPE_KAFKA_SASL_PASSWORD_FILE": str(pw)})
    conn = cfg.kafka.conn()
    assert conn.client_options()["sasl_plain_password"] == "hunter2"
    assert "hunter2" not in repr(conn) + conn.to_json() + conn.describe() + repr(cfg)
    with pytest.raises(KafkaConnError, match="needs kafka.sasl_username"):
        KafkaConn.from_json("h:1", json.dumps({"security_protocol": "SASL_SSL"}))


def test_run_refused_by_sasl_is_one_line_exit_2_without_the_password(sasl_broker, tmp_path):
    secret = "Zebra-Secret-77"
    env = dict(os.environ, STRAGGLERSCOPE_STORE=f"chdb://{tmp_path / 'store'}", STRAGGLERSCOPE_PIPELINE_METRICS_PORT="-1",
               STRAGGLERSCOPE_KAFKA_BOOTSTRAP=sasl_broker.bootstrap, STRAGGLERSCOPE_KAFKA_SECURITY_PROTOCOL="SASL_PLAINTEXT",
               STRAGGLERSCOPE_KAFKA_SASL_MECHANISM="SCRAM-SHA-256", STRAGGLERSCOPE_KAFKA_SASL_USERNAME="trainer",
               STRAGGLERSCOPE_KAFKA_SASL_PASSWORD=secret)
    r = subprocess.run([sys.executable, "-m", "stragglerscope", "run"], env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    assert secret not in r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    (err,) = [line for line in r.stderr.splitlines() if "error:" in line]
    assert "(SASL_PLAINTEXT SCRAM-SHA-256 as trainer)" in err and "check kafka.sasl_username" in err, r.stderr
