"""A standalone ZooKeeper on 127.0.0.1: what a ClickHouse cluster's replicated tables coordinate through.

Debian's ``zookeeper`` package (3.8) is started in the foreground with a
config of its own: the client port on 127.0.0.1 only, the admin web server
off (it listens on every interface at 8080 by default) and JMX off
(``JMXDISABLE``: the start script otherwise opens a JMX port on every
interface). ClickHouse 18.16 has no Keeper of its own.

    with LocalZooKeeper() as zk:
        zk.port   # 127.0.0.1:zk.port
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

START_SCRIPT = "/usr/share/zookeeper/bin/zkServer.sh"


def zookeeper_installed() -> bool:
    return os.access(START_SCRIPT, os.X_OK) and shutil.which("java") is not None


class LocalZooKeeper:
    """One ZooKeeper server process on 127.0.0.1 with its data in a temporary directory; a context manager."""

    def __init__(self, start_timeout: float = 60.0):
        self.start_timeout = start_timeout
        self.port = 0
        self._dir: Path | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> "LocalZooKeeper":
        from services.ports import free_fixed_port

        if not zookeeper_installed():
            raise RuntimeError("ZooKeeper is not installed (apt-get install zookeeper)")
        self._dir = Path(tempfile.mkdtemp(prefix="ss-zookeeper-"))
        (self._dir / "data").mkdir()
        self.port = free_fixed_port()
        cfg = self._dir / "zoo.cfg"
        cfg.write_text("\n".join([
            "tickTime=2000", "initLimit=10", "syncLimit=5", f"dataDir={self._dir / 'data'}",
            f"clientPort={self.port}", "clientPortAddress=127.0.0.1", "admin.enableServer=false",
            "maxClientCnxns=200", "4lw.commands.whitelist=ruok", ""]))
        env = dict(os.environ, JMXDISABLE="true", ZOO_LOG_DIR=str(self._dir))
        log = open(self._dir / "zookeeper.out", "ab")
        self._proc = subprocess.Popen([START_SCRIPT, "start-foreground", str(cfg)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self._dir,
                                      start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"zookeeper exited with {self._proc.returncode}: {self._tail()}")
            if self.ok():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"zookeeper did not answer within {self.start_timeout} s")

    def ok(self) -> bool:
        """ZooKeeper's ``ruok``: 'imok' once it serves."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"ruok")
                return s.recv(4) == b"imok"
        except OSError:
            return False

    def _tail(self) -> str:
        p = self._dir / "zookeeper.out" if self._dir else None
        return p.read_text(errors="replace")[-1500:] if p and p.exists() else "(no log)"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, 15)  # the script's java child is in its session
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(5)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "LocalZooKeeper":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
