"""Start and stop a loopback-only ClickHouse server (tests, demo, benchmarks).

``ClickHouseServer`` writes a config and a users file rendered from the
templates in ``infra/clickhouse/`` into a data directory, starts
``clickhouse-server --config-file=...`` as a child process, waits until its
HTTP ``/ping`` answers and stops it again. It listens on 127.0.0.1 only, on
free ports picked at start. Debian's ``clickhouse-server`` package (18.16)
installs the binary into ``/usr/sbin``; newer packages use ``/usr/bin``.

    with ClickHouseServer() as srv:
        store = open_store(srv.url)      # clickhouse://default:@127.0.0.1:PORT/default

With ``tls_cert`` and ``tls_key`` (PEM files) it also opens the secure
native port (``tcp_port_secure``, a ``config.d/tls.xml`` rendered from
``infra/clickhouse/tls.xml.tmpl``); with ``tls_client_ca`` as well, that
port asks every client for a certificate signed by that CA::

    with ClickHouseServer(user="writer", password=pw, tls_cert=crt, tls_key=key) as srv:
        store = open_store(srv.store_url("db", secure=True, ca_certs=ca))
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import string
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from xml.sax.saxutils import escape

from services.ports import free_port

_INFRA = Path(__file__).resolve().parent.parent / "infra" / "clickhouse"
_CANDIDATES = ("/usr/bin/clickhouse-server", "/usr/sbin/clickhouse-server")

# Used when infra/ is not shipped next to the package (an installed wheel).
_FALLBACK_CONFIG = """<?xml version="1.0"?>
<yandex>
    <logger><level>warning</level><log>$data_dir/log/server.log</log>
        <errorlog>$data_dir/log/server.err.log</errorlog><size>100M</size><count>2</count></logger>
    <listen_host>127.0.0.1</listen_host>
    <tcp_port>$tcp_port</tcp_port>
    <http_port>$http_port</http_port>
    <mark_cache_size>268435456</mark_cache_size>
    <path>$data_dir/data/</path>
    <tmp_path>$data_dir/tmp/</tmp_path>
    <user_files_path>$data_dir/user_files/</user_files_path>
    <format_schema_path>$data_dir/format_schemas/</format_schema_path>
    <users_config>$users_path</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <timezone>UTC</timezone>
</yandex>
"""
_FALLBACK_TLS = """<?xml version="1.0"?>
<yandex>
    <tcp_port_secure>$tcp_port_secure</tcp_port_secure>
    <openSSL><server><certificateFile>$cert_file</certificateFile><privateKeyFile>$key_file</privateKeyFile>
        $client_verification
        <loadDefaultCAFile>false</loadDefaultCAFile><cacheSessions>true</cacheSessions>
        <disableProtocols>sslv2,sslv3,tlsv1,tlsv1_1</disableProtocols><preferServerCiphers>true</preferServerCiphers>
    </server></openSSL>
</yandex>
"""
_FALLBACK_USERS = """<?xml version="1.0"?>
<yandex>
    <profiles><default><max_memory_usage>8000000000</max_memory_usage></default></profiles>
    <users><$user><password>$password</password><networks><ip>127.0.0.1</ip></networks>
        <profile>default</profile><quota>default</quota></$user></users>
    <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors>
        <result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time>
    </interval></default></quotas>
</yandex>
"""


def find_server_binary() -> str | None:
    """Path of ``clickhouse-server``, or None when it is not installed."""
    found = shutil.which("clickhouse-server")
    if found:
        return found
    for cand in _CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    return None


def _template(name: str, fallback: str) -> string.Template:
    path = _INFRA / name
    return string.Template(path.read_text() if path.exists() else fallback)


class ClickHouseServer:
    """One ClickHouse server process on 127.0.0.1 with its data in ``data_dir``.

    ``start()`` returns once the server answers ``/ping`` or raises
    RuntimeError with the tail of its error log. ``stop()`` terminates it
    (SIGTERM, then SIGKILL after ``stop_timeout``) and, when the data
    directory was a temporary one made here, removes it.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        tcp_port: int | None = None,
        http_port: int | None = None,
        user: str = "default",
        password: str = "",
        binary: str | None = None,
        start_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        tls_cert: str | os.PathLike | None = None,
        tls_key: str | os.PathLike | None = None,
        tls_client_ca: str | os.PathLike | None = None,
        tcp_port_secure: int | None = None,
    ) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", user):
            raise ValueError(f"user name must be an identifier, got {user!r}")
        self.user = user
        self.password = password
        self._data_dir = Path(data_dir) if data_dir else None
        self._own_dir = data_dir is None
        self.tcp_port = tcp_port
        self.http_port = http_port
        self.binary = binary
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        if (tls_cert is None) != (tls_key is None) or (tls_client_ca is not None and tls_cert is None):
            raise ValueError("TLS needs tls_cert and tls_key (and tls_client_ca only with them)")
        self.tls_cert = Path(tls_cert).resolve() if tls_cert else None
        self.tls_key = Path(tls_key).resolve() if tls_key else None
        self.tls_client_ca = Path(tls_client_ca).resolve() if tls_client_ca else None
        self.tcp_port_secure = tcp_port_secure
        self._proc: subprocess.Popen | None = None

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise RuntimeError("server not started")
        return self._data_dir

    @property
    def url(self) -> str:
        """Store URL for ``open_store``, database ``default``."""
        return self.store_url("default")

    def store_url(self, database: str, secure: bool = False, with_password: bool = True, **params: str) -> str:
        """Store URL of ``database``: the plain native port, or with ``secure`` the TLS one (``secure=1``).

        ``params`` become query parameters (``ca_certs=...``, ``password_file=...``);
        ``with_password=False`` leaves the password out of the URL.
        """
        from urllib.parse import quote, urlencode

        if secure and not self.tcp_port_secure:
            raise RuntimeError("this server has no secure port (start it with tls_cert and tls_key)")
        userinfo = quote(self.user, safe="") + (f":{quote(self.password, safe='')}" if with_password else "")
        port = self.tcp_port_secure if secure else self.tcp_port
        query = urlencode(([("secure", "1")] if secure else []) + [(k, str(v)) for k, v in params.items()])
        return f"clickhouse://{userinfo}@127.0.0.1:{port}/{database}" + (f"?{query}" if query else "")

    def write_config(self) -> Path:
        """Render config and users files into the data dir; returns the config path."""
        d = self.data_dir
        for sub in ("data", "tmp", "user_files", "format_schemas", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        users_path = d / "users.xml"
        users_path.write_text(
            _template("users.xml.tmpl", _FALLBACK_USERS).substitute(user=self.user, password=escape(self.password))
        )
        config_path = d / "config.xml"
        config_path.write_text(
            _template("config.xml.tmpl", _FALLBACK_CONFIG).substitute(
                data_dir=escape(str(d)),
                tcp_port=self.tcp_port,
                http_port=self.http_port,
                users_path=escape(str(users_path)),
            )
        )
        tls_path = d / "config.d" / "tls.xml"  # read and merged by the server beside config.xml
        if self.tls_cert:
            tls_path.parent.mkdir(exist_ok=True)
            verification = "<verificationMode>none</verificationMode>"
            if self.tls_client_ca:
                verification = (f"<verificationMode>strict</verificationMode>"
                                f"<caConfig>{escape(str(self.tls_client_ca))}</caConfig>")
            tls_path.write_text(_template("tls.xml.tmpl", _FALLBACK_TLS).substitute(
                tcp_port_secure=self.tcp_port_secure, cert_file=escape(str(self.tls_cert)),
                key_file=escape(str(self.tls_key)), client_verification=verification))
        elif tls_path.exists():
            tls_path.unlink()
        return config_path

    def start(self) -> "ClickHouseServer":
        if self._proc is not None:
            return self
        binary = self.binary or find_server_binary()
        if not binary:
            raise RuntimeError("clickhouse-server is not installed (apt-get install clickhouse-server)")
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="ss-clickhouse-"))
        self.tcp_port = self.tcp_port or free_port()
        self.http_port = self.http_port or free_port()
        if self.tls_cert:
            self.tcp_port_secure = self.tcp_port_secure or free_port()
        config = self.write_config()
        log = open(self.data_dir / "log" / "stdout.log", "ab")
        self._proc = subprocess.Popen(
            [binary, f"--config-file={config}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.data_dir,
            start_new_session=True,  # a Ctrl-C in the test runner does not reach it first
        )
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"clickhouse-server exited with {self._proc.returncode}: {self._log_tail()}")
            if self.ping() and self._secure_port_listens():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"clickhouse-server did not answer within {self.start_timeout} s: {self._log_tail()}")

    def ping(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/ping", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def _secure_port_listens(self) -> bool:
        if not self.tls_cert:
            return True
        try:
            with socket.create_connection(("127.0.0.1", self.tcp_port_secure), timeout=1):
                return True
        except OSError:
            return False

    def signal_stop(self) -> None:
        """Ask the server to shut down (SIGTERM) without waiting: ``stop`` waits."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._own_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def _log_tail(self, n: int = 2000) -> str:
        texts = []
        for name in ("server.err.log", "stdout.log"):
            p = self.data_dir / "log" / name
            if p.exists():
                texts.append(p.read_text(errors="replace")[-n:])
        return " | ".join(t.strip() for t in texts if t.strip()) or "(no log)"

    def __enter__(self) -> "ClickHouseServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ClickHouseCluster:
    """``shards`` x ``replicas`` ClickHouse servers on 127.0.0.1 that know each other as cluster ``name``.

    Each gets a ``config.d/cluster.xml`` with the cluster's ``remote_servers``
    and, with more than one replica per shard, the ZooKeeper at
    ``zookeeper_port`` (``services.zookeeper``), its ``shard`` and ``replica``
    macros and an interserver port on 127.0.0.1 for fetching parts from its
    replicas. ``url`` is a store URL on the first server with ``cluster=NAME``,
    which spreads the store over all of them.
    """

    def __init__(self, shards: int = 2, replicas: int = 1, name: str = "stragglerscope", user: str = "default",
                 password: str = "", zookeeper_port: int | None = None):
        from services.ports import free_fixed_port

        if replicas > 1 and not zookeeper_port:
            raise ValueError("replicated shards need a ZooKeeper (zookeeper_port)")
        self.name = name
        self._root = Path(tempfile.mkdtemp(prefix="ss-chcluster-"))
        layout = [(s, r) for s in range(1, shards + 1) for r in range(1, replicas + 1)]
        ports = [free_fixed_port() for _ in layout]  # every server must know every port before it starts
        self.servers = [ClickHouseServer(data_dir=self._root / f"s{s}r{r}", tcp_port=p, user=user, password=password)
                        for (s, r), p in zip(layout, ports)]
        auth = f"<user>{escape(user)}</user><password>{escape(password)}</password>"
        # internal_replication: a Distributed insert writes one replica and replication copies it on.
        remote = "".join(
            "<shard>" + ("<internal_replication>true</internal_replication>" if replicas > 1 else "")
            + "".join(f"<replica><host>127.0.0.1</host><port>{p}</port>{auth}</replica>"
                      for (s, _r), p in zip(layout, ports) if s == shard) + "</shard>"
            for shard in range(1, shards + 1))
        for (s, r), srv in zip(layout, self.servers):
            extra = ""
            if replicas > 1:
                extra = (f"<zookeeper><node><host>127.0.0.1</host><port>{zookeeper_port}</port></node></zookeeper>"
                         f"<macros><shard>{s}</shard><replica>r{r}</replica></macros>"
                         f"<interserver_http_host>127.0.0.1</interserver_http_host>"
                         f"<interserver_http_port>{free_fixed_port()}</interserver_http_port>")
            d = srv.data_dir / "config.d"
            d.mkdir(parents=True)
            (d / "cluster.xml").write_text(
                f"<yandex>{extra}<remote_servers><{name}>{remote}</{name}></remote_servers></yandex>")

    @property
    def url(self) -> str:
        return self.store_url("default")

    def store_url(self, database: str) -> str:
        return self.servers[0].store_url(database, cluster=self.name)

    def start(self) -> "ClickHouseCluster":
        try:
            for srv in self.servers:
                srv.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # All asked at once: each takes seconds to shut down, and one after the other four cost a test 20 s.
        for srv in self.servers:
            srv.signal_stop()
        for srv in self.servers:
            srv.stop()
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> "ClickHouseCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # pragma: no cover - manual helper
    import sys

    srv = ClickHouseServer(data_dir=sys.argv[1] if len(sys.argv) > 1 else None).start()
    print(srv.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.stop()
