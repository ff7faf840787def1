"""The Prometheus endpoint (ray_jobs/metrics.py): every shard counter is exported, scraped over HTTP."""
import dataclasses
import urllib.request

import pytest

from ray_jobs.metrics import _METRICS, MetricsServer
from ray_jobs.shard import ShardStats

pytest.importorskip("prometheus_client")

# Fields of ShardStats that are not numbers to scrape: the shard is the label, the rest are states.
NOT_METRICS = {"shard", "idle", "error"}


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_every_shard_counter_has_one_metric_and_counters_end_in_total():
    fields = {f.name for f in dataclasses.fields(ShardStats)} - NOT_METRICS
    keys = [key for key, *_ in _METRICS]
    assert sorted(keys) == sorted(set(keys)), "a status key is exported twice"
    assert fields - set(keys) == set(), "ShardStats counters missing from the endpoint"
    assert set(keys) - fields == set(), "metrics for status keys the shard no longer has"
    for key, name, kind, doc in _METRICS:
        assert name.startswith("ss_") and doc
        assert (kind == "counter") == name.endswith("_total"), name


def _scrape(port: int) -> dict[tuple[str, str], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("ss_"):
            name_labels, value = line.rsplit(" ", 1)
            name, labels = name_labels.split("{", 1)
            out[(name, labels.rstrip("}"))] = float(value)
    return out


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_scrape_reads_the_shards_status_at_scrape_time_on_loopback():
    calls = []
    live = dataclasses.asdict(ShardStats(shard=0, messages=7, lag=3, loop_seconds_max=0.25))

    def status():
        calls.append(1)
        return [live, {"shard": 1, "error": "RayActorError: restarting", "unavailable": True}]

    server = MetricsServer(status).start()
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        assert calls == [], "nothing is read before a scrape"
        m = _scrape(server.port)
        assert m[("ss_messages_total", 'shard="0"')] == 7
        assert m[("ss_consumer_lag", 'shard="0"')] == 3
        assert m[("ss_loop_seconds_max", 'shard="0"')] == 0.25
        assert m[("ss_shard_up", 'shard="0"')] == 1 and m[("ss_shard_up", 'shard="1"')] == 0
        assert ("ss_messages_total", 'shard="1"') not in m, "an unavailable shard reports no stale counters"
        live["messages"] = 9
        assert _scrape(server.port)[("ss_messages_total", 'shard="0"')] == 9, "read again on each scrape"
        assert len(calls) == 2, "one status round trip per scrape"
    finally:
        server.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
