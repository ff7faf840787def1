"""SIGTERM stops every long-running command as Ctrl-C does (issue: SIGTERM left the console's Streamlit behind).

Kubernetes, systemd and ``timeout`` send SIGTERM to the command's pid only. Each test starts the CLI as a
user would, waits for its ready line, sends SIGTERM to that pid alone and then checks, within bounded
times, the exit code README "Stopping" documents, that no process the command started (children and
grandchildren, recorded while it ran) is left, and that its ports and the chDB path are free again.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXIT_S = 60.0       # from SIGTERM to the command's exit
GONE_S = 30.0       # from its exit until every process it started is gone
TINY_DEMO = ["--jobs", "1", "--windows", "1", "--steps", "2", "--min-gpus", "8", "--max-gpus", "8"]


def _processes() -> dict[int, tuple[str, int, str, str]]:
    """pid -> (state, parent pid, start time, name) of every process, from /proc (psutil is not a dependency)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
        out[int(name)] = (fields[0], int(fields[1]), fields[19], stat[stat.index("(") + 1:stat.rindex(")")])
    return out


def _alive(procs: set[tuple[int, str]]) -> list[tuple[int, str]]:
    """Those of ``procs`` (pid, start time) still running; a reused pid has another start time."""
    now = _processes()
    return [p for p in procs if p[0] in now and now[p[0]][2] == p[1] and now[p[0]][0] != "Z"]


def _refused(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


def _path_held(store: Path) -> bool:
    """Whether a process holds the chDB path: the lock that makes `sql` fail with "in use by process N"."""
    lock = store / ".lock"
    if not lock.exists():
        return False
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops our lock, if we took it
    return False


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRAGGLERSCOPE_")}
    # A Ray started with `ray start` on this machine (another test run's) would be joined otherwise.
    env.update({"RAY_ADDRESS": "local", "STRAGGLERSCOPE_STORE": f"chdb://{tmp_path / 'store'}",
                "STRAGGLERSCOPE_PIPELINE_METRICS_PORT": "-1"})
    env.update(extra)
    return env


def _free_port() -> int:
    from services.ports import free_port

    return free_port()


class Command:
    """``argv`` in its own session, its output read line by line; records its descendants while it runs."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.started: set[tuple[int, str]] = set()
        self.names: set[str] = set()
        self._eof = False
        self._new_line = threading.Condition()
        self._scans = 0
        self._scanned = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line.rstrip("\n"))
                self._new_line.notify_all()
        with self._new_line:
            self._eof = True
            self._new_line.notify_all()

    def _watch(self) -> None:
        """Every process below the command, until it exits: once it has, its orphans have other parents."""
        while self.proc.poll() is None:
            procs = _processes()
            below, names, todo = set(), set(), [self.proc.pid]
            while todo:
                parent = todo.pop()
                for pid, (_, ppid, start, name) in procs.items():
                    if ppid == parent and (pid, start) not in below:
                        below.add((pid, start))
                        names.add(name)
                        todo.append(pid)
            with self._scanned:
                self.started |= below
                self.names |= names
                self._scans += 1
                self._scanned.notify_all()
            time.sleep(0.1)

    def _seen_now(self) -> None:
        """Until the watcher has looked at the processes once more from start to end."""
        with self._scanned:
            target = self._scans + 2
            assert self._scanned.wait_for(lambda: self._scans >= target or self.proc.poll() is not None, 30)

    def wait_for_process(self, name: str, timeout: float = 180.0) -> None:
        """Until a process named ``name`` runs below the command."""
        with self._scanned:
            if not self._scanned.wait_for(lambda: name in self.names or self.proc.poll() is not None, timeout):
                pytest.fail(f"no process {name!r} within {timeout:.0f} s:\n{self.output[-4000:]}")
            if name not in self.names:
                pytest.fail(f"exited with {self.proc.wait()} before {name!r} ran:\n{self.output[-4000:]}")

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 180.0) -> re.Match:
        """The first output line matching ``pattern``; fails the test if none comes or the command exits."""
        deadline = time.monotonic() + timeout
        with self._new_line:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                if self._eof:
                    pytest.fail(f"exited with {self.proc.wait()} before {pattern!r}:\n{self.output[-4000:]}")
                if time.monotonic() > deadline:
                    pytest.fail(f"no {pattern!r} within {timeout:.0f} s:\n{self.output[-4000:]}")
                self._new_line.wait(0.5)

    def sigterm(self, again_every_s: float = 0.0) -> int:
        """SIGTERM to the command's pid only (with ``again_every_s``, again at that pace until it exits); its code."""
        self._seen_now()
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            while again_every_s:
                try:
                    self.proc.wait(again_every_s)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - t > EXIT_S:
                        raise
                    self.proc.send_signal(signal.SIGTERM)
            code = self.proc.wait(max(0.0, EXIT_S - (time.monotonic() - t)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"still running {EXIT_S:.0f} s after SIGTERM:\n{self.output[-4000:]}")
        print(f"ready after {t - self.t0:.1f} s, stopped {time.monotonic() - t:.1f} s after SIGTERM")
        return code

    def assert_nothing_left(self) -> None:
        """No process the command started survives it (those that do are killed, then reported)."""
        assert self.started, "the command started no process: the test checks nothing"
        deadline = time.monotonic() + GONE_S
        while (left := _alive(self.started)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid, _ in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"left running: {left}\n{self.output[-4000:]}"


@pytest.fixture
def commands():
    """Starts ``stragglerscope ARGS`` (or, with ``argv=``, any command); kills what a failed test left."""
    started: list[Command] = []

    def start(args: list[str], env: dict[str, str], argv: list[str] | None = None) -> Command:
        started.append(Command(argv or [sys.executable, "-m", "stragglerscope", *args], env))
        return started[-1]

    yield start
    for c in started:  # a failed test leaves nothing behind either
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()
        for pid, _ in _alive(c.started):
            os.kill(pid, signal.SIGKILL)


def _show_page(port: int, store: Path, timeout: float = 60.0) -> None:
    """Open the console's front page as a browser does, until its Streamlit process holds the chDB path.

    Streamlit runs the app (which opens the store) only for a connected session: without one the
    console would hold nothing and the test would not show what the issue saw.
    """
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from websockets.sync.client import connect

    msg = BackMsg()
    msg.rerun_script.SetInParent()  # the front page, as a browser's first message asks for it
    with connect(f"ws://127.0.0.1:{port}/_stcore/stream", open_timeout=10) as ws:
        ws.send(msg.SerializeToString())
        deadline = time.monotonic() + timeout
        while not _path_held(store):
            assert time.monotonic() < deadline, f"the console did not open {store} within {timeout:.0f} s"
            try:
                ws.recv(timeout=0.2)
            except TimeoutError:
                pass


def _sql_fleet_summary(env: dict[str, str]) -> dict:
    r = subprocess.run([sys.executable, "-m", "stragglerscope", "sql", "fleet_summary", "--format", "json"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]


def test_console_stops_its_streamlit_and_frees_the_chdb_path(tmp_path, commands):
    """The issue: SIGTERM ended `console` alone; its Streamlit kept the path and `sql` failed ("in use")."""
    port = _free_port()
    env = _env(tmp_path, STRAGGLERSCOPE_UI_PORT=str(port))
    console = commands(["console"], env)
    console.wait_for(r"^console on http://127\.0\.0\.1:\d+")
    console.wait_for(r"URL: http://127\.0\.0\.1")  # Streamlit's own: it serves
    _show_page(port, tmp_path / "store")
    assert console.sigterm() == 0, console.output[-4000:]
    console.assert_nothing_left()
    assert _refused(port)
    assert not _path_held(tmp_path / "store")
    assert _sql_fleet_summary(env)["jobs"] == 0


def test_store_stops_and_frees_its_port_and_path(tmp_path, commands):
    store = commands(["store"], _env(tmp_path))
    port = int(store.wait_for(r"^store chdb://\S+ at http://127\.0\.0\.1:(\d+)").group(1))
    assert _path_held(tmp_path / "store")
    assert store.sigterm(again_every_s=0.1) == 0, store.output[-4000:]
    assert _refused(port)
    assert not _path_held(tmp_path / "store")
    assert not (tmp_path / "store" / "daemon.json").exists()


def _ports(cmd: Command) -> list[int]:
    """The ports the command's progress lines name: broker, store daemon, metrics, console."""
    return [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", "\n".join(
        line for line in cmd.lines if re.match(r"(broker|store|metrics|console) ", line)))]


def test_run_stops_broker_store_daemon_and_ray(tmp_path, commands):
    run = commands(["run"], _env(tmp_path, STRAGGLERSCOPE_PIPELINE_METRICS_PORT="0"))
    run.wait_for(r"^running")
    ports = _ports(run)
    assert len(ports) == 3, run.output  # broker, store daemon, metrics
    assert run.sigterm() == 0, run.output[-4000:]
    run.assert_nothing_left()
    assert all(_refused(p) for p in ports)
    assert not _path_held(tmp_path / "store")


def test_run_stopped_while_ray_starts(tmp_path, commands):
    """SIGTERM inside ray.init: it finishes first (cut short, it orphans processes), then all stop."""
    run = commands(["run"], _env(tmp_path))
    run.wait_for_process("gcs_server")  # Ray's first process: ray.init has begun
    assert not any(line.startswith("ray ") for line in run.lines), "ray.init had returned: too late"
    ports = _ports(run)
    assert run.sigterm() == 0, run.output[-4000:]
    assert "SIGTERM received" not in run.output  # Ray's fatal-signal handler, with its stack dump
    run.assert_nothing_left()
    assert all(_refused(p) for p in ports)
    assert not _path_held(tmp_path / "store")


def test_demo_stops_everything_though_sigterm_comes_again_and_again(tmp_path, commands):
    """More SIGTERMs come while the first stop is under way, at every step of it: none may cut it short."""
    env = _env(tmp_path, STRAGGLERSCOPE_UI_PORT=str(_free_port()))
    demo = commands(["demo", *TINY_DEMO], env)
    demo.wait_for(r"^console    http://")
    ports = _ports(demo)
    assert len(ports) == 3, demo.output  # broker, store daemon, console
    assert demo.sigterm(again_every_s=0.2) == 0, demo.output[-4000:]
    demo.assert_nothing_left()
    assert all(_refused(p) for p in ports)
    assert _sql_fleet_summary(env)["jobs"] == 1  # what the demo stored is there, and the path is free


TRAINING = "import time; print('training', flush=True); time.sleep(300)"


def test_trace_passes_sigterm_to_its_command_then_stops_its_services(tmp_path, commands):
    trace = commands(["trace", "--job-id", "sigterm", "--", sys.executable, "-c", TRAINING], _env(tmp_path))
    trace.wait_for(r"^training$")
    ports = _ports(trace)
    assert trace.sigterm() == 128 + signal.SIGTERM, trace.output[-4000:]  # the command's code: SIGTERM ended it
    assert "trace      stopped by SIGTERM: not waiting for the analysis" in trace.output
    trace.assert_nothing_left()
    assert all(_refused(p) for p in ports)
    assert not _path_held(tmp_path / "store")


# One write of the whole line: unbuffered (PYTHONUNBUFFERED=1, as CI runs), print() writes the text and its
# newline apart, and the two ranks' lines came out as "rank 0 readyrank 1 ready" once in a whole-suite run.
SLEEPER = """
import sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
sys.stdout.write(f"rank {dist.get_rank()} ready\\n")
sys.stdout.flush()
time.sleep(300)
"""


def test_trace_passes_sigterm_to_torchrun_which_stops_its_workers(tmp_path, commands):
    """torchrun passes SIGTERM on to its workers (in sessions of their own) and exits; its code is trace's."""
    pytest.importorskip("torch")
    from tests.autotrace.test_trace_frameworks import torchrun

    (tmp_path / "sleeper.py").write_text(SLEEPER)
    trace = commands(["trace", "--", *torchrun(2), str(tmp_path / "sleeper.py")], _env(tmp_path))
    trace.wait_for(r"^rank 0 ready$")
    trace.wait_for(r"^rank 1 ready$")
    code = trace.sigterm()
    assert code != 0 and f"trace      command exited with {code} after" in trace.output, trace.output[-4000:]
    trace.assert_nothing_left()  # torchrun's workers among them
    assert not _path_held(tmp_path / "store")


def test_trace_stopped_while_its_services_start(tmp_path, commands):
    """Before the command runs there is no code of its own: 143, as a shell reports a command SIGTERM ended."""
    trace = commands(["trace", "--", sys.executable, "-c", TRAINING], _env(tmp_path))
    trace.wait_for(r"^broker ")  # the store daemon starts next
    assert trace.sigterm() == 128 + signal.SIGTERM, trace.output[-4000:]
    assert "training" not in trace.lines
    trace.assert_nothing_left()
    assert all(_refused(p) for p in _ports(trace))
    assert not _path_held(tmp_path / "store")


STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('grandchild', flush=True); time.sleep(300)"])
print("stubborn", flush=True)
time.sleep(300)
"""


def test_trace_kills_a_command_group_that_ignores_sigterm(commands):
    """The command and what it started ignore SIGTERM: their group is killed after the grace period."""
    driver = ("import os, sys\nfrom stragglerscope import trace\ntrace.TERM_GRACE_S = 1.0\n"
              f"sys.exit(trace._run_child([sys.executable, '-c', {STUBBORN!r}], dict(os.environ))[0])")
    # _run_child alone, without the services trace starts around it: the same code, in seconds.
    cmd = commands([], dict(os.environ), argv=[sys.executable, "-c", driver])
    cmd.wait_for(r"^grandchild$", timeout=60)
    cmd.wait_for(r"^stubborn$", timeout=60)
    assert cmd.sigterm() == 128 + signal.SIGKILL, cmd.output
    assert "did not stop within 1 s of SIGTERM: killed its process group" in cmd.output
    cmd.assert_nothing_left()


def test_stop_process_group_kills_what_ignores_sigterm_after_the_grace():
    from stragglerscope.demo import stop_process_group

    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert {proc.stdout.readline().strip(), proc.stdout.readline().strip()} == {"stubborn", "grandchild"}
        t0 = time.monotonic()
        stop_process_group(proc, grace_s=1.0)
        assert 1.0 <= time.monotonic() - t0 < 10
        assert proc.returncode == -signal.SIGKILL
        deadline = time.monotonic() + GONE_S
        while True:  # the grandchild, killed too, is reaped by whoever adopted it
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the grandchild survived its group's SIGKILL"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
