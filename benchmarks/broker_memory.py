#!/usr/bin/env python3
"""What frees the embedded broker's memory? (issue 23, item 3)

usage: .venv/bin/python benchmarks/broker_memory.py [--mb 200] [--rounds 2]

The embedded Tansu (``services.broker.LocalBroker``, memory engine) keeps every
record in memory, so a long embedded run grows until it is killed. This script
measures, on a real Tansu, the broker's resident memory (VmRSS) after writing
``--mb`` MB to a topic and after each way a consumer could hand the memory back:

- DeleteRecords up to the end of the partition (what a pipeline would send
  once its offsets are stored);
- DeleteTopics of a topic that is fully consumed (what a topic rotation would
  do: producers move to the next generation, the old one is dropped).

It prints one line per step and a verdict per method, with the broker's own
error line where a request broke its connection. Nothing is asserted: the
answer depends on the Tansu build (``tansu_binary()``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def fill(producer, topic: str, mb: int) -> None:
    payload = b"x" * 10_000
    for _ in range(mb * 100):
        producer.send(topic, payload)
    producer.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=200, help="MB written per round (10 kB records)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per method")
    args = p.parse_args()

    import tempfile

    from kafka import KafkaAdminClient, KafkaProducer, TopicPartition
    from kafka.admin import NewTopic, OffsetSpec

    from services.broker import LocalBroker, tansu_binary

    log = Path(tempfile.mkdtemp()) / "tansu.log"
    print(f"broker     {tansu_binary()}  (log {log})")
    verdicts = {}
    with LocalBroker(log_path=str(log)) as broker:
        pid = broker._proc.pid
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, request_timeout_ms=10_000)
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=5, batch_size=1 << 20)
        print(f"start      rss {rss_mb(pid):7.1f} MB")

        def measured(topic: str, drop) -> tuple[float, float]:
            """Write --mb to a fresh topic, then ``drop(topic)``: RSS before and after."""
            admin.create_topics([NewTopic(topic, 1, 1)])
            fill(producer, topic, args.mb)
            time.sleep(1)
            before = rss_mb(pid)
            drop(topic)
            time.sleep(2)
            return before, rss_mb(pid)

        def delete_records(topic: str) -> None:
            nonlocal admin, outcome
            tp = TopicPartition(topic, 0)
            end = admin.list_partition_offsets({tp: OffsetSpec.LATEST})[tp].offset
            try:
                admin.delete_records({tp: end})
                outcome = "accepted"
            except Exception as e:  # Tansu's memory engine panics on it and drops the connection
                outcome = f"failed: {e!r}"
                admin.close()
                admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, request_timeout_ms=10_000)

        for name, drop in (("DeleteRecords", delete_records), ("DeleteTopics", lambda t: admin.delete_topics([t]))):
            freed = []
            for r in range(args.rounds):
                outcome = ""
                before, after = measured(f"{name.lower()}-{r}", drop)
                freed.append(before - after)
                print(f"{name:13} round {r}: rss {before:7.1f} -> {after:7.1f} MB  {outcome}")
            verdicts[name] = sum(freed) / len(freed)
        producer.close()
        admin.close()
    panics = [line.strip() for line in log.read_text(errors="replace").splitlines()
              if "panicked" in line or "not yet implemented" in line]
    for name, mb in verdicts.items():
        print(f"verdict    {name}: frees {mb:.0f} MB of {args.mb} MB written per round")
    for line in dict.fromkeys(panics):
        print(f"broker log {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
