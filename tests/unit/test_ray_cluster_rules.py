"""The pipeline's rules for a Ray cluster, without Ray: reachability, store reach, sizing, shard ownership."""
import socket
import threading
import time

import pytest

from core.config import Config
from ray_jobs.errors import PipelineError
from ray_jobs.ownership import Owner, claim_verdict, shard_fingerprint
from ray_jobs.pipeline import inflight_per_shard
from ray_jobs.placement import check_store_reach, store_only_here
from ray_jobs.ray_connect import check_ray_reachable


def _listener(answer: bytes | None):
    """A loopback server that accepts one connection and sends ``answer`` (None: stays silent)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    done = threading.Event()

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.recv(64)
            if answer is not None:
                conn.sendall(answer)
            done.wait(5)
    threading.Thread(target=serve, daemon=True).start()
    return srv, done


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_a_port_that_is_not_ray_fails_in_one_line_within_the_timeout():
    """ray.init to a listener that is not a GCS retries for ever (measured: killed after 100 s)."""
    srv, done = _listener(None)  # a Kafka broker, say: it waits for a Kafka request
    port = srv.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=f"127.0.0.1:{port} accepts connections but is not a Ray head"):
        check_ray_reachable(f"127.0.0.1:{port}", timeout_s=0.5)
    assert time.monotonic() - t0 < 3
    done.set()
    srv.close()


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_a_grpc_server_passes_the_check():
    settings = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # an HTTP/2 SETTINGS frame, as gRPC sends first
    srv, done = _listener(settings)
    check_ray_reachable(f"127.0.0.1:{srv.getsockname()[1]}", timeout_s=2)
    done.set()
    srv.close()
    srv, done = _listener(b"HTTP/1.1 400 Bad Request\r\n\r\n")  # a web server is not Ray either
    with pytest.raises(PipelineError, match="not a Ray head"):
        check_ray_reachable(f"127.0.0.1:{srv.getsockname()[1]}", timeout_s=2)
    done.set()
    srv.close()


@pytest.mark.parametrize("max_inflight,shards,cpus,shard_cpus,want", [
    (3, 4, 100, 1, 3),      # set by hand: kept
    (0, 2, 2, 0, 2),        # the local default: 2 CPUs for analyses, 2 shards -> 2 each (as before)
    (0, 16, 144, 1, 16),    # 128 analysis CPUs over 16 shards -> 16 each
    (0, 4, 4, 1, 1),        # the shards take every CPU: still one each, never zero (a shard would never poll)
    (0, 3, 8, 0.5, 5),      # 6.5 analysis CPUs -> 13 slots over 3 shards, rounded up
])
def test_analyses_in_flight_are_sized_by_the_cluster_cpus(max_inflight, shards, cpus, shard_cpus, want):
    assert inflight_per_shard(max_inflight, shards, cpus, shard_cpus) == want


def test_a_store_only_this_machine_reaches_is_refused_when_ray_has_nodes_elsewhere():
    here = {"127.0.0.1", "::1", "localhost", "10.0.0.5"}
    assert store_only_here("chdb://./store") and store_only_here("http://127.0.0.1:8123")
    assert store_only_here("clickhouse://u@localhost:9000/db")
    assert not store_only_here("clickhouse://u@ch.prod:9000/db") and not store_only_here("clickhouse://10.0.0.9/db")
    with pytest.raises(PipelineError, match="reachable only on this machine.*nodes at 10.0.0.6"):
        check_store_reach("http://127.0.0.1:8123", ["10.0.0.5", "10.0.0.6"], here)
    check_store_reach("http://127.0.0.1:8123", ["127.0.0.1", "10.0.0.5"], here)  # every node is this machine
    check_store_reach("clickhouse://u@ch.prod:9000/db", ["10.0.0.6"], here)
    with pytest.raises(PipelineError) as e:
        check_store_reach("clickhouse://writer:s3cret@127.0.0.1:9000/db", ["10.0.0.7"], here)
    assert "s3cret" not in str(e.value)


def test_the_driver_started_last_owns_the_shards():
    old, new = Owner(1_000, "pod-a:7"), Owner(2_000, "pod-b:7")
    assert claim_verdict(None, "f1", old, "f1") == "adopted"
    assert claim_verdict(old, "f1", old, "f1") == "ours"
    assert claim_verdict(old, "f1", new, "f1") == "adopted"     # rolling update: the new driver takes over
    assert claim_verdict(new, "f1", old, "f1") == "newer"       # ... and the old one steps back
    assert claim_verdict(old, "f1", new, "f2") == "replace"     # another configuration: a new shard
    assert claim_verdict(new, "f1", old, "f2") == "newer"       # an older driver replaces nothing
    assert claim_verdict(old, "f1", new, None) == "replace"     # retiring one beyond pipeline.shards


def test_a_shard_is_adopted_only_by_its_own_configuration():
    cfg = Config()
    assert shard_fingerprint(cfg, [0, 2]) == shard_fingerprint(Config(), [0, 2])
    assert shard_fingerprint(cfg, [0, 2]) != shard_fingerprint(cfg, [0, 2, 4])
    assert shard_fingerprint(cfg, [0]) != shard_fingerprint(cfg.replace(pipeline={"idle_timeout_s": 5.0}), [0])
