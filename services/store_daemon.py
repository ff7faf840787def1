"""A store daemon in a child process: ``StoreDaemon`` starts ``python -m storage.daemon`` and stops it."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from storage.daemon.files import daemon_url, token_path
from storage.errors import StoreError
from storage.sandbox import SQLLimits

_ROOT = Path(__file__).resolve().parents[1]  # the repository: the child imports storage from here


class StoreDaemon:
    """Runs ``serve(url)`` in a child process; ``start()`` returns once it answers.

    The child also stops when this process dies (it watches its stdin pipe),
    so a crashed parent leaves no daemon holding the path.

        with StoreDaemon("chdb:///data/store") as d:
            store = open_store(d.url)        # or open_store("chdb:///data/store") anywhere
    """

    def __init__(self, url: str, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0,
                 stop_timeout: float = 20.0, sql_limits=None) -> None:
        if not isinstance(url, str) or not url.startswith("chdb://"):
            raise StoreError(f"the store daemon serves chdb://PATH stores, got {url!r}")
        self.store_url = url
        self.sql_limits = SQLLimits.of(sql_limits)
        self.host = host
        self.port = port
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT?token_file=PATH/daemon.token``: the file is the daemon's token, 0600."""
        if not self._proc:
            raise StoreError("store daemon not started")
        return daemon_url(self.host, self.port, self.store_url[len("chdb://"):])

    @property
    def token_file(self) -> Path:
        return token_path(self.store_url[len("chdb://"):])

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> "StoreDaemon":
        if self._proc is not None:
            return self
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                            if p])
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "storage.daemon", self.store_url, "--host", self.host, "--port", str(self.port),
             "--watch-stdin", "--max-execution-time-s", repr(float(self.sql_limits.max_execution_time_s)),
             "--max-memory-mb", str(int(self.sql_limits.max_memory_mb)),
             "--max-result-rows", str(int(self.sql_limits.max_result_rows))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=os.getcwd(),
            start_new_session=True)
        try:
            if self._wait_ready():
                return self
        except BaseException:  # a SIGTERM or Ctrl-C while it starts: a caller's ``with`` never stops it
            self.stop()
            raise
        tail = self._stderr_tail()
        self.stop()
        raise StoreError(f"store daemon for {self.store_url} did not start: {tail}")

    def _wait_ready(self) -> bool:
        """Until the child prints ``READY PORT`` (True) or exits or ``start_timeout`` passes (False)."""
        deadline = time.monotonic() + self.start_timeout
        # poll(), not select(): a long-lived caller (a test run, the console) may hold more than 1,024 fds.
        waiting = select.poll()
        waiting.register(self._proc.stdout, select.POLLIN)
        while time.monotonic() < deadline:
            ready = waiting.poll(100)
            if ready:
                line = self._proc.stdout.readline()
                if line.startswith(b"READY "):
                    self.port = int(line.split()[1])
                    return True
                if not line:
                    return False
            elif self._proc.poll() is not None:
                return False
        return False

    def _stderr_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        text = self._log.read().decode(errors="replace").strip().splitlines()
        lines = [t for t in text if t.strip()]
        # The daemon's own one-line refusal, not what chDB's teardown may print after it (a crash at exit
        # once left "<no Python frame>" as the only reason a user saw).
        ours = [t for t in lines if t.startswith("store daemon: error:")]
        return (ours or lines or ["(no output)"])[-1][:500]

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # the child's stdin watcher stops the server
        except OSError:
            pass
        try:
            proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "StoreDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
