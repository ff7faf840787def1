"""The Kafka side against a real Apache Kafka 3.8 (KRaft), not only the Tansu imitation (issue 49).

``STRAGGLERSCOPE_APACHE_KAFKA`` names Kafka's folder (CI: ``../shared/kafka``); without it these are skipped
with that reason. Brokers on 127.0.0.1, their own ports and temporary log folders (``services/apache_kafka.py``).
- one node with SASL_PLAINTEXT and SCRAM-SHA-512: a wrong password fails within seconds with the broker's own
  reason (it took 21-30 s and gave a guess); the right one carries a fleet through `run` into the store;
The three-broker failover (replication factor 3, min.insync.replicas 2, the busiest partition's leader killed
with kill -9 while a fleet is published) is ``test_apache_kafka_cluster.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD = "trainer", "s3cret-Pa55"


def _kafka(**kw):
    from services.apache_kafka import ApacheKafka, KafkaNotInstalled

    try:
        return ApacheKafka(**kw)
    except KafkaNotInstalled as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def sasl_kafka():
    with _kafka(nodes=1, scram={USER: PASSWORD}) as k:
        yield k


def sasl_conn(kafka, password: str):
    from core.kafka_conn import KafkaConn

    return KafkaConn(kafka.sasl_bootstrap, security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
                     sasl_username=USER, sasl_password=password)


def test_a_wrong_password_fails_within_seconds_with_the_broker_s_reason(sasl_kafka, tmp_path):
    from core.kafka_admin import BrokerError, prepare_topics

    t0 = time.monotonic()
    with pytest.raises(BrokerError) as e:
        prepare_topics(sasl_conn(sasl_kafka, "wrong"), 2)
    took = time.monotonic() - t0
    msg = str(e.value)
    # The broker's own words; or, where it closed the connection before its answer could be read (it does
    # now and then), that it did so during the authentication.
    assert ("Authentication failed" in msg and "invalid credentials" in msg) or \
        "closed the connection during SASL authentication" in msg, msg
    assert took < 5, f"{took:.1f} s: {msg}"
    # The same through the command an operator runs: one line, exit 2.
    cfg = tmp_path / "sasl.toml"
    cfg.write_text(f'[kafka]\nbootstrap = "{sasl_kafka.sasl_bootstrap}"\nsecurity_protocol = "SASL_PLAINTEXT"\n'
                   f'sasl_mechanism = "SCRAM-SHA-512"\nsasl_username = "{USER}"\n'
                   f'[store]\nurl = "chdb://{tmp_path / "store"}"\n[pipeline]\nmetrics_port = -1\n')
    env = dict(os.environ, STRAGGLERSCOPE_KAFKA_SASL_PASSWORD="wrong")
    r = subprocess.run([sys.executable, "-m", "stragglerscope", "run", "--config", str(cfg)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("stragglerscope run: error: ") and ("invalid credentials" in last or "during SASL "
                                                               "authentication" in last), r.stderr[-2000:]
    assert "wrong" not in r.stderr and "Traceback" not in r.stderr


def test_the_right_password_carries_a_fleet_through_run_into_the_store(sasl_kafka, tmp_path):
    from tests.fleet import start_fleet, stop_fleet
    from tests.integration.test_pipeline_faults import _produce

    cfg = tmp_path / "sasl.toml"
    cfg.write_text(f'[kafka]\nbootstrap = "{sasl_kafka.sasl_bootstrap}"\npartitions = 2\n'
                   f'security_protocol = "SASL_PLAINTEXT"\nsasl_mechanism = "SCRAM-SHA-512"\n'
                   f'sasl_username = "{USER}"\n[store]\nurl = "chdb://{tmp_path / "store"}"\n'
                   f'[pipeline]\nmetrics_port = -1\nidle_timeout_s = 20\n')
    os.environ["STRAGGLERSCOPE_KAFKA_SASL_PASSWORD"] = PASSWORD
    try:
        proc, store = start_fleet(cfg, tmp_path / "run.log")
        try:
            tag = f"sasl-{uuid.uuid4().hex[:6]}"
            keys = _produce(sasl_conn(sasl_kafka, PASSWORD), tag, n_jobs=4, windows=3)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not all(store.window_stored(k) for k in keys):
                time.sleep(1.0)
            assert all(store.window_stored(k) for k in keys), (tmp_path / "run.log").read_text()[-3000:]
        finally:
            stop_fleet(proc, store)
    finally:
        os.environ.pop("STRAGGLERSCOPE_KAFKA_SASL_PASSWORD", None)


def test_the_control_topic_is_made_compacted_and_an_older_one_is_said_once(sasl_kafka, caplog):
    """The control topic is created with cleanup.policy=compact (as the broker describes it); a topic that exists
    without it (an older deployment's) is left working and said once in the log with the command that fixes it.
    The log cleaner is not waited for: what a reader rebuilds from a compacted log is tests/unit/test_control.py's."""
    import logging

    from kafka.admin import KafkaAdminClient, NewTopic

    from core.kafka_admin import _admin, ensure_topics, prepare_topics, topic_policy
    from core.topics import CONTROL_TOPIC_CONFIGS, TOPIC_CONTROL

    prepare_topics(sasl_kafka.bootstrap, 2)
    admin = _admin(sasl_kafka.bootstrap, 20)
    try:
        assert topic_policy(admin, TOPIC_CONTROL) == "compact"
    finally:
        admin.close()
    old = f"old-control-{uuid.uuid4().hex[:6]}"
    plain = KafkaAdminClient(bootstrap_servers=sasl_kafka.bootstrap)
    try:
        plain.create_topics([NewTopic(old, 1, 1)])
    finally:
        plain.close()
    with caplog.at_level(logging.WARNING, logger="core.kafka_admin"):
        for _ in range(2):
            assert ensure_topics(sasl_kafka.bootstrap, [old], 1, topic_configs=CONTROL_TOPIC_CONFIGS) == {old: 1}
    said = [r.getMessage() for r in caplog.records if old in r.getMessage()]
    assert len(said) == 1, said
    assert "cleanup.policy=delete, not compact" in said[0] and "--add-config cleanup.policy=compact" in said[0]
