"""A leader of a real three-broker Apache Kafka killed while a fleet is published: is every window stored once?

    STRAGGLERSCOPE_APACHE_KAFKA=../shared/kafka .venv/bin/python benchmarks/kafka_failover.py [--runs 3]

Per run: three KRaft brokers on 127.0.0.1 (``services/apache_kafka.py``), topics with replication factor 3
and min.insync.replicas 2 created by a real `stragglerscope run` (a chDB store of its own); 4 jobs x 3
windows published, then 6 more jobs whose registrations and 24 windows go through the exporters' producer
(acks=all, idempotence, the disk spool), the leader of the busiest partition killed with kill -9 after the
sixth window and started again after the producer's flush. Prints per run: what the producer delivered,
dropped and spooled, how many of the windows were stored within ``--wait-s``, and whether each once; then
the runs that lost nothing.

This was a test of the whole suite (issue 49) until it failed there in 2 of 4 runs on record, two ways
(windows never stored with every shard at lag 0; the two surviving brokers answering nothing for 120 s),
while it passed alone every time: a measurement to repeat on a machine of its own, not a verdict a loaded
2-core CI machine can give. What the suite keeps against the real broker: one node with SASL/SCRAM
(`tests/integration/test_apache_kafka.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def failover_once(work: Path, wait_s: float) -> dict:
    """One run in ``work``; what happened, as figures."""
    from kafka import KafkaAdminClient

    from core import topics
    from generators.fleetgen import fleet_windows, make_fleet
    from ingest.producer import TelemetryProducer
    from services.apache_kafka import ApacheKafka
    from tests.fleet import start_fleet, stop_fleet
    from tests.integration.test_pipeline_faults import _produce

    out: dict = {}
    with ApacheKafka(nodes=3) as kafka:
        cfg = work / "three.toml"
        cfg.write_text(f'[kafka]\nbootstrap = "{kafka.bootstrap}"\npartitions = 3\nreplication_factor = 3\n'
                       f'min_insync_replicas = 2\n[store]\nurl = "chdb://{work / "store"}"\n'
                       f'[pipeline]\nmetrics_port = -1\nidle_timeout_s = 20\n')
        t0 = time.monotonic()
        proc, store = start_fleet(cfg, work / "run.log")
        out["first_run_start_s"] = time.monotonic() - t0
        try:
            tag = f"three-{uuid.uuid4().hex[:6]}"
            keys = _produce(kafka.bootstrap, tag + "-a", n_jobs=4, windows=3)
            admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap, request_timeout_ms=10000)
            leaders = [p["leader_id"] for t in admin.describe_topics([topics.TOPIC_OPS]) for p in t["partitions"]]
            admin.close()
            victim = max(set(leaders), key=leaders.count) - 1  # node ids are 1-based
            jobs = [dataclasses.replace(j, job_id=f"{tag}-b-{i}") for i, j in enumerate(make_fleet(6, 9, 8, 64))]
            with TelemetryProducer(kafka.bootstrap, spool_dir=str(work / "spool")) as p:
                for j in jobs:
                    p.send(j.registration(0, 2))
                for n, (spec, wid, table) in enumerate(fleet_windows(jobs, 4, 2, 0)):
                    if n == 6:
                        kafka.kill(victim, signal.SIGKILL)  # mid-stream: kill -9 of the busiest leader
                    p.send(table)
                    keys.append((spec.job_id, 0, wid))
                t1 = time.monotonic()
                out["delivered"] = p.flush(120)
                out["flush_s"] = time.monotonic() - t1
                out["dropped"], out["spooled"] = p.stats.records_dropped, p.stats.batches_spooled
            kafka.start_node(victim)  # and back, with its data
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not all(store.window_stored(k) for k in keys):
                time.sleep(1.0)
            out["windows"] = len(keys)
            out["stored"] = sum(store.window_stored(k) for k in keys)
            rows = store.query(f"SELECT job_id, window_id, count() AS n FROM windows WHERE job_id LIKE '{tag}%' "
                               "GROUP BY job_id, window_id").to_pylist()
            out["twice"] = sum(r["n"] > 1 for r in rows)
            status = [x for x in (work / "run.log").read_text(errors="replace").splitlines() if x.startswith("status")]
            out["last_status"] = status[-1] if status else ""
        finally:
            stop_fleet(proc, store)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="failovers, each on fresh brokers and a fresh store")
    p.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for every window to be stored")
    a = p.parse_args(argv)
    from services.apache_kafka import KafkaNotInstalled

    clean = 0
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="ss-failover-") as d:
            try:
                r = failover_once(Path(d), a.wait_s)
            except KafkaNotInstalled as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        # Lost: a window never stored, or stored twice. Stalled: the producer's flush did not end within 120 s
        # (what it held was sent when it closed, from the spool): nothing lost, but a stalled delivery.
        lost = r["dropped"] or r["stored"] != r["windows"] or r["twice"]
        clean += not lost and r["delivered"]
        print(f"run {i + 1}: first run started in {r['first_run_start_s']:.1f} s; producer delivered "
              f"{'all' if r['delivered'] else 'NOT all (stalled)'} in {r['flush_s']:.1f} s ({r['spooled']} batch(es) "
              f"spooled, {r['dropped']} records dropped); {r['stored']} of {r['windows']} windows stored, "
              f"{r['twice']} twice{'; LOST, ' + r['last_status'] if lost else ''}", flush=True)
    print(f"\n{clean} of {a.runs} failovers delivered within 120 s and lost nothing")
    return 0 if clean == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
