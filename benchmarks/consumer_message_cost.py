"""How long one Kafka message holds a shard's loop inside kafka-python's poll (issue 49, item 3).

    .venv/bin/python benchmarks/consumer_message_cost.py [--sizes 1,8.8] [--runs 3]

Messages of the given sizes (MB) are produced to a real Tansu broker; a ``KafkaSource`` (the shard's
consumer, with its fetch caps) polls each from its offset, timed, median of ``--runs``: with the C CRC-32C
(the `crc32c` package, in the server extra) and without it (kafka-python's pure-Python check, as before),
each in a fresh interpreter. Target: no single message holds the loop more than 0.2 s. (Tansu returns what
follows the offset too, whatever the fetch caps: the 1 MB message's poll holds the 8.8 MB one after it.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, statistics, sys, time
if sys.argv[1] == "pure":
    sys.modules["crc32c"] = None  # kafka-python then checks CRCs in Python
from ray_jobs.kafka_source import KafkaSource
bootstrap, topic, offsets = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
src = KafkaSource(bootstrap, [topic], [0])
src.seek({(topic, 0): offsets.pop("warm")})
while not list(src.poll(5000)):  # connected, metadata known: what follows is the messages alone
    pass
out = {}
for size, offset in offsets.items():
    times = []
    for _ in range(int(sys.argv[5])):
        src.seek({(topic, 0): offset})
        t0 = time.perf_counter()
        got = []
        while not got:
            got = [m for m in src.poll(5000) if m.offset == offset]
        times.append(time.perf_counter() - t0)
    out[size] = statistics.median(times)
src.close()
print(json.dumps(out))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,8.8", help="message sizes in MB, comma-separated")
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    from kafka import KafkaProducer

    from core.kafka_admin import ensure_topics
    from services.broker import LocalBroker

    topic = "bench.big"
    with LocalBroker() as broker:
        ensure_topics(broker.bootstrap, [topic], 1)
        prod = KafkaProducer(bootstrap_servers=broker.bootstrap, max_request_size=16 << 20, acks=1)
        offsets = {"warm": prod.send(topic, b"x", partition=0).get(30).offset}
        for size in a.sizes.split(","):
            meta = prod.send(topic, os.urandom(int(float(size) * 1e6)), partition=0).get(30)
            offsets[size] = meta.offset
        prod.close()
        for mode in ("c", "pure"):
            r = subprocess.run([sys.executable, "-c", CHILD, mode, broker.bootstrap, topic, json.dumps(offsets),
                                str(a.runs)], capture_output=True, text=True, cwd=ROOT, check=True)
            res = json.loads(r.stdout.strip().splitlines()[-1])
            what = "C CRC-32C (crc32c)" if mode == "c" else "pure-Python CRC (kafka-python's fallback)"
            print(f"{what}: " + ", ".join(f"a {s} MB message held the poll {t:.3f} s" for s, t in res.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
