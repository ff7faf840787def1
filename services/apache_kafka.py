"""A real Apache Kafka (KRaft) on 127.0.0.1, for the tests that must meet the real broker.

Tansu is the embedded default and most tests' broker; what only Apache Kafka shows (SASL/SCRAM as it
implements it, replication, leader changes, metadata that reaches brokers one after the other) is tested
against this. ``STRAGGLERSCOPE_APACHE_KAFKA`` names a folder holding Kafka's jars in ``lib/`` (the
project's CI points it at ``../shared/kafka``: Apache Kafka 3.8.0); Java 17 runs it. ``ApacheKafka`` writes
its own properties (free ports, a temporary log folder per node), formats the storage (with SCRAM users when
asked), starts one or three nodes (each broker and controller) and stops them, also on failure.

    with ApacheKafka(nodes=3) as kafka:          # kafka.bootstrap: '127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3'
        kafka.kill(1)                             # kill -9 of node 1 (its data stays)
        kafka.start_node(1)                       # and back
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from services.ports import free_fixed_port

ENV = "STRAGGLERSCOPE_APACHE_KAFKA"
START_TIMEOUT_S = 90.0


class KafkaNotInstalled(RuntimeError):
    """No Apache Kafka to start here (the variable is unset, or its folder holds no jars), or no Java."""


def kafka_home() -> Path:
    """The folder ``STRAGGLERSCOPE_APACHE_KAFKA`` names; KafkaNotInstalled, with the reason, where it cannot run."""
    home = os.environ.get(ENV, "")
    if not home:
        raise KafkaNotInstalled(f"{ENV} is not set (a folder with Apache Kafka's jars in lib/)")
    if not any(Path(home, "lib").glob("kafka_*.jar")):
        raise KafkaNotInstalled(f"{ENV}={home} holds no Kafka jars in lib/")
    if shutil.which("java") is None:
        raise KafkaNotInstalled("no java on PATH (Apache Kafka runs on Java 17)")
    return Path(home)


class ApacheKafka:
    """One or three KRaft nodes on 127.0.0.1; a context manager. ``scram``: {user: password} made at format,
    served on a SASL_PLAINTEXT listener with SCRAM-SHA-512 (one node only)."""

    def __init__(self, nodes: int = 1, scram: dict[str, str] | None = None, heap_mb: int = 256):
        if nodes not in (1, 3):
            raise ValueError("1 or 3 nodes")
        if scram and nodes != 1:
            raise ValueError("SCRAM users on the one-node cluster only")
        self.home = kafka_home()
        self.n = nodes
        self.scram = dict(scram or {})
        self.heap_mb = heap_mb
        self.dir = Path(tempfile.mkdtemp(prefix="apache-kafka-"))
        self.ports = [free_fixed_port() for _ in range(nodes)]
        self.controller_ports = [free_fixed_port() for _ in range(nodes)]
        self.sasl_port = free_fixed_port() if self.scram else 0
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @property
    def sasl_bootstrap(self) -> str:
        return f"127.0.0.1:{self.sasl_port}"

    def _properties(self, i: int) -> str:
        voters = ",".join(f"{k + 1}@127.0.0.1:{p}" for k, p in enumerate(self.controller_ports))
        listeners = [f"PLAINTEXT://127.0.0.1:{self.ports[i]}", f"CONTROLLER://127.0.0.1:{self.controller_ports[i]}"]
        advertised = [f"PLAINTEXT://127.0.0.1:{self.ports[i]}"]
        protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
        extra = []
        if self.scram:
            listeners.append(f"SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}")
            advertised.append(f"SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}")
            protocols.append("SASL_PLAINTEXT:SASL_PLAINTEXT")
            extra = ["sasl.enabled.mechanisms=SCRAM-SHA-512",
                     "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config="
                     "org.apache.kafka.common.security.scram.ScramLoginModule required;"]
        rf = self.n
        lines = [
            "process.roles=broker,controller", f"node.id={i + 1}", f"controller.quorum.voters={voters}",
            f"listeners={','.join(listeners)}", f"advertised.listeners={','.join(advertised)}",
            f"listener.security.protocol.map={','.join(protocols)}", "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT", f"log.dirs={self.dir / f'node{i + 1}'}", "num.partitions=1",
            f"default.replication.factor={rf}", f"min.insync.replicas={2 if rf == 3 else 1}",
            "auto.create.topics.enable=false", f"offsets.topic.replication.factor={rf}",
            f"transaction.state.log.replication.factor={rf}", f"transaction.state.log.min.isr={2 if rf == 3 else 1}",
            "group.initial.rebalance.delay.ms=0", "unclean.leader.election.enable=false",
            "log.cleaner.dedupe.buffer.size=16777216",  # its 128 MB default does not fit a small test heap
            *extra]
        return "\n".join(lines) + "\n"

    def _java(self, *args: str) -> list[str]:
        return ["java", f"-Xmx{self.heap_mb}m", "-Xms64m", f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
                "-cp", str(self.home / "lib" / "*"), *args]

    def start(self) -> "ApacheKafka":
        (self.dir / "log4j2.properties").write_text(
            "rootLogger.level=WARN\nrootLogger.appenderRef.f.ref=F\nappender.f.type=File\nappender.f.name=F\n"
            f"appender.f.fileName={self.dir / 'kafka.log'}\nappender.f.layout.type=PatternLayout\n"
            "appender.f.layout.pattern=%d %p %c: %m%n\n")
        cluster = subprocess.run(self._java("kafka.tools.StorageTool", "random-uuid"), capture_output=True,
                                 text=True, timeout=60, check=True).stdout.strip().splitlines()[-1]
        for i in range(self.n):
            props = self.dir / f"node{i + 1}.properties"
            props.write_text(self._properties(i))
            fmt = ["kafka.tools.StorageTool", "format", "-t", cluster, "-c", str(props)]
            for user, password in self.scram.items():
                fmt += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
            subprocess.run(self._java(*fmt), capture_output=True, text=True, timeout=60, check=True)
        for i in range(self.n):
            self.start_node(i, wait=False)
        self.wait_ready()
        return self

    def start_node(self, i: int, wait: bool = True) -> None:
        """Start node ``i`` (0-based): again after ``kill``, with the data it had."""
        log = open(self.dir / f"node{i + 1}.out", "a")
        self.procs[i] = subprocess.Popen(self._java("kafka.Kafka", str(self.dir / f"node{i + 1}.properties")),
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_ready([i])

    def wait_ready(self, nodes: list[int] | None = None, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every node (or those given) answers metadata naming all the cluster's brokers."""
        from kafka import KafkaAdminClient

        deadline = time.monotonic() + timeout_s
        for i in nodes if nodes is not None else range(self.n):
            while True:
                proc = self.procs[i]
                if proc.poll() is not None:
                    raise RuntimeError(f"Kafka node {i + 1} exited with {proc.returncode}: {self.tail(i)}")
                try:
                    admin = KafkaAdminClient(bootstrap_servers=f"127.0.0.1:{self.ports[i]}",
                                             request_timeout_ms=3000, client_id="ss-kafka-ready")
                    try:
                        if len(admin.describe_cluster()["brokers"]) >= self.n - len(self.down()):
                            break
                    finally:
                        admin.close()
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Kafka node {i + 1} not ready after {timeout_s:.0f} s: {self.tail(i)}")
                time.sleep(0.5)

    def down(self) -> list[int]:
        return [i for i, p in self.procs.items() if p.poll() is not None]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Signal node ``i`` (kill -9 by default) and wait for it to go."""
        proc = self.procs[i]
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(60)

    def tail(self, i: int, n: int = 2000) -> str:
        out = self.dir / f"node{i + 1}.out"
        return out.read_text(errors="replace")[-n:] if out.exists() else ""

    def stop(self) -> None:
        for i, proc in self.procs.items():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "ApacheKafka":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
