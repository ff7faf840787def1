"""The network-fault harness on real namespaces, veths, htb and gloo jobs (needs root; skipped where refused).

Checks that faults are real (a shaped transfer between two rank namespaces runs at the tc rate,
a 64 KB message included, while an unshaped pair keeps its speed), that a loopback service of the
root namespace is reachable from inside (the broker's path), that the launcher runs 4-rank gloo
jobs to completion and passes a rank's failure on, and that nothing is left behind: not after an
exception, not after SIGTERM, and after SIGKILL not once ``remove_stale`` ran.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.netfaults.fabric import Fabric, FabricError, netns_names, netns_unavailable, remove_stale

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BULK = str(ROOT / "tests" / "netfaults" / "bulk.py")
ZOO = str(ROOT / "tests" / "training" / "zoo.py")
TORCH_ABORT = "terminate called without an active exception"
RATE, RATE_MBS = "20mbit", 2.5
BULK_BYTES, MSG_BYTES, SERVE_PORT = 2_000_000, 65536, 7000


@pytest.fixture(scope="module", autouse=True)
def needs_netns():
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)


def env_with_root() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


# -- lifecycle ----------------------------------------------------------------------------------

def test_teardown_removes_everything_even_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with Fabric(2) as fab:
            ours = {fab.hub, *fab.namespaces}
            assert ours <= set(netns_names())
            fab.slow_link(0, 1, RATE)
            fab.slow_ingress(1, RATE)
            fab.expose(SERVE_PORT)
            sleeper = fab.run(0, [sys.executable, "-c", "import time; time.sleep(120)"])
            raise RuntimeError("boom")
    assert not ours & set(netns_names())
    assert sleeper.returncode is not None


SELF_HOSTED = """
import sys, time
from tests.netfaults.fabric import Fabric
with Fabric(2) as fab:
    fab.slow_egress(0, "20mbit")
    print(" ".join([fab.hub, *fab.namespaces]), flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_killed_owner_leaves_nothing_once_stale_ones_are_removed(sig):
    owner = subprocess.Popen([sys.executable, "-c", SELF_HOSTED], stdout=subprocess.PIPE, text=True,
                             env=env_with_root(), cwd=ROOT)
    try:
        ours = set(owner.stdout.readline().split())
        assert len(ours) == 3 and ours <= set(netns_names())
        assert not ours & set(remove_stale())  # the owner lives: none of its namespaces is stale
        owner.send_signal(sig)
        owner.wait(30)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    if sig == signal.SIGTERM:
        assert not ours & set(netns_names())  # the owner tore its fabric down itself
    else:
        assert ours <= set(netns_names())
        assert ours <= set(remove_stale())
        assert not ours & set(netns_names())


# -- running inside, and reaching the root namespace's loopback -----------------------------------

@pytest.fixture
def echo_port():
    """An echo server on 127.0.0.1 of the root namespace (a stand-in for the broker); yields its port."""
    srv = socket.create_server(("127.0.0.1", 0))

    def echo(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.shutdown(socket.SHUT_RDWR)
    srv.close()


ECHO_CLIENTS = """
import os, socket, sys
from concurrent.futures import ThreadPoolExecutor
port = int(sys.argv[1])
def round_trip(i):
    data = os.urandom(200_000)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        back = b"".join(iter(lambda: s.recv(1 << 16), b""))
    return back == data
with ThreadPoolExecutor(16) as pool:
    ok = list(pool.map(round_trip, range(16)))
print(os.environ["NETFAULTS_MARK"], sum(ok))
"""


def test_root_loopback_port_is_reachable_inside_every_rank_and_the_environment_passes(echo_port):
    with Fabric(2) as fab:
        fab.expose(echo_port)
        clients = [fab.run(r, [sys.executable, "-c", ECHO_CLIENTS, str(echo_port)], stdout=subprocess.PIPE,
                           text=True, env={**os.environ, "NETFAULTS_MARK": f"rank{r}"}) for r in range(2)]
        outs = [c.communicate(timeout=30)[0].split() for c in clients]
    assert outs == [["rank0", "16"], ["rank1", "16"]]  # 16 concurrent connections, every byte back


# -- shaping --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fabric3():
    """Three ranks, each with a bulk.py server on its address (they outlive every test's faults)."""
    with Fabric(3) as fab:
        for r in range(3):
            srv = fab.run(r, [sys.executable, BULK, "serve", fab.addr(r), str(SERVE_PORT)],
                          stdout=subprocess.PIPE, text=True)
            assert srv.stdout.readline().strip() == "ready"
        yield fab


def message_seconds(fab: Fabric, src: int, dst: int, size: int, count: int) -> list[float]:
    client = fab.run(src, [sys.executable, BULK, "send", fab.addr(dst), str(SERVE_PORT), str(size), str(count)],
                     stdout=subprocess.PIPE, text=True)
    out, _ = client.communicate(timeout=30)
    assert client.returncode == 0
    return json.loads(out)["seconds"]


def throughput_mbs(fab: Fabric, src: int, dst: int) -> float:
    return BULK_BYTES / 1e6 / message_seconds(fab, src, dst, BULK_BYTES, 1)[0]


# name -> (fault, the shaped pair, a pair the fault must not touch)
FAULTS = {
    "egress": (lambda fab: fab.slow_egress(0, RATE), (0, 1), (2, 1)),   # slow sender; others reach 1 fine
    "ingress": (lambda fab: fab.slow_ingress(1, RATE), (0, 1), (0, 2)),  # slow receiver; 0 reaches 2 fine
    "link": (lambda fab: fab.slow_link(0, 1, RATE), (0, 1), (0, 2)),     # only 0 -> 1
}


@pytest.mark.parametrize("name", FAULTS)
def test_fault_runs_the_shaped_pair_at_the_rate_and_leaves_the_other_alone(fabric3, name):
    fault, shaped, other = FAULTS[name]
    healthy = throughput_mbs(fabric3, *shaped)
    fault(fabric3)
    try:
        slow = throughput_mbs(fabric3, *shaped)
        spared = throughput_mbs(fabric3, *other)
        messages = sorted(message_seconds(fabric3, *shaped, MSG_BYTES, 5))
    finally:
        fabric3.clear()
    restored = throughput_mbs(fabric3, *shaped)
    print(f"{name}: healthy {healthy:.1f} MB/s, shaped {slow:.2f}, spared {spared:.1f}, restored {restored:.1f}, "
          f"64 KB messages {[round(s * 1e3, 1) for s in messages]} ms")
    # htb counts Ethernet frames: payload runs at 1448/1514 of the rate (2.39 MB/s at 20mbit).
    # A sender starved of CPU runs below the rate (a whole-suite run: 1.99 MB/s, restored 19 of 32 MB/s): the
    # lower bound is the shaper's, less what a loaded 2-core machine takes.
    assert 0.7 * RATE_MBS <= slow <= 1.05 * RATE_MBS
    assert min(healthy, spared, restored) > 5 * slow
    # A single 64 KB message is shaped too, not let through in a bucket of tokens.
    assert messages[len(messages) // 2] >= 0.8 * MSG_BYTES / (RATE_MBS * 1e6)


def test_faults_compose_and_a_refused_rate_changes_nothing(fabric3):
    fabric3.slow_egress(0, RATE)
    fabric3.slow_link(0, 1, "10mbit")
    try:
        with pytest.raises(FabricError, match="fast"):
            fabric3.slow_egress(0, "fast")
        to_1, to_2 = throughput_mbs(fabric3, 0, 1), throughput_mbs(fabric3, 0, 2)
    finally:
        fabric3.clear()
    print(f"compose: 0->1 {to_1:.2f} MB/s (10mbit link), 0->2 {to_2:.2f} MB/s (20mbit egress)")
    assert 0.8 * RATE_MBS / 2 <= to_1 <= 1.05 * RATE_MBS / 2  # the link's own limit, under the egress one
    assert 0.8 * RATE_MBS <= to_2 <= 1.05 * RATE_MBS          # the egress limit still holds


# -- the launcher -----------------------------------------------------------------------------------

def launch(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.netfaults.launch", *args], capture_output=True, text=True,
                          env=env or env_with_root(), cwd=ROOT, timeout=timeout)


@pytest.mark.parametrize("zoo_args, launch_args", [
    (["--framework", "plain"], []),
    (["--framework", "pipelining", "--dp", "2"], ["--fault", "link:0:2:50mbit", "--fault-after-s", "1"]),
], ids=["plain", "pipelining-slow-link"])
def test_launcher_runs_a_4_rank_gloo_job_to_completion(zoo_args, launch_args):
    before = set(netns_names())
    run = lambda: launch("--ranks", "4", "--timeout", "80", *launch_args, "--", ZOO, *zoo_args, "--steps", "4",
                         "--gpu-ms", "2")
    r = run()
    if r.returncode != 0 and TORCH_ABORT in r.stderr:
        # A whole-suite run (2026-11-30): one rank of the plain job aborted inside torch (SIGABRT, exit 134), as an
        # untraced DDP job outside any fabric did in another (tests/autotrace/test_trace_frameworks.py). The job is
        # run again once; a launcher that cannot run it twice fails the test.
        r = run()
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("fault-start" in r.stdout) == bool(launch_args)
    assert set(netns_names()) <= before


def test_launcher_stops_the_job_when_a_rank_fails():
    r = launch("--ranks", "4", "--timeout", "80", "--", ZOO, "--framework", "plain", "--steps", "4",
               "--gpu-ms", "2", "--crash-at-step", "1")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "crash requested" in r.stderr


RANK_HELLO = """
import os, socket
host, port = os.environ["STRAGGLERSCOPE_TRACE_BOOTSTRAP"].split(":")
with socket.create_connection((host, int(port)), timeout=20) as s:
    s.sendall(" ".join(os.environ[k] for k in ("RANK", "WORLD_SIZE", "GLOO_SOCKET_IFNAME", "NETFAULTS_MARK")).encode())
    s.shutdown(socket.SHUT_WR)
    reply = b"".join(iter(lambda: s.recv(100), b""))
# One write per line: print() under PYTHONUNBUFFERED writes the text and the newline apart, and the three
# ranks share the launcher's stdout, so their lines interleaved (CI, stop 33). A pipe write this short is atomic.
os.write(1, reply + b"\\n")
"""


def test_launcher_exposes_the_trace_bootstrap_and_passes_the_environment(echo_port):
    env = {**env_with_root(), "STRAGGLERSCOPE_TRACE_BOOTSTRAP": f"127.0.0.1:{echo_port}", "NETFAULTS_MARK": "m"}
    r = launch("--ranks", "3", "--timeout", "30", "--", "-c", RANK_HELLO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == [f"{rank} 3 eth0 m" for rank in range(3)]


def test_launcher_sigterm_stops_the_ranks_and_removes_the_fabric():
    launcher = subprocess.Popen([sys.executable, "-m", "tests.netfaults.launch", "--ranks", "2", "--timeout", "60",
                                 "--", "-c", "import time; time.sleep(60)"], env=env_with_root(), cwd=ROOT)
    prefix = f"ssnf{launcher.pid}-"
    try:
        deadline = time.monotonic() + 20
        ranks: list[str] = []
        while len(ranks) < 2 and time.monotonic() < deadline:  # both ranks started in their namespaces
            ranks = [pid for ns in netns_names() if ns.startswith(prefix) and not ns.endswith("hub")
                     for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                               text=True).stdout.split()]
            time.sleep(0.1)
        assert len(ranks) == 2
        launcher.terminate()
        assert launcher.wait(30) == 128 + signal.SIGTERM
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert not [ns for ns in netns_names() if ns.startswith(prefix)]
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
