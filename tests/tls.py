"""Test certificates made with the openssl CLI, and a TLS terminator for plaintext services.

``make_certs(dir)`` writes a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate (mutual TLS) and a second, unrelated CA (to
prove that a wrong CA is refused). Everything is short-lived and stays in
``dir``.

``TLSTerminator`` accepts TLS on 127.0.0.1 and forwards the plaintext to a
service on 127.0.0.1, like a TLS-terminating sidecar in front of a broker.
The TLS is OpenSSL's (Python's ``ssl``): real handshakes, real certificate
checks on both sides. It exists because the embedded Tansu 0.6 broker cannot
serve TLS itself (RELIABILITY.md, "Transport security").
"""
from __future__ import annotations

import asyncio
import dataclasses
import shutil
import ssl
import subprocess
import threading
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> Certs:
    """A CA, server and client certificates signed by it, and an unrelated CA; raises if openssl is absent."""
    if shutil.which("openssl") is None:
        raise FileNotFoundError("openssl")
    d.mkdir(parents=True, exist_ok=True)
    days = "2"
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                 "-days", days, "-subj", f"/CN=stragglerscope test {ca}", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, cn in (("server", "127.0.0.1"), ("client", "stragglerscope-client")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={cn}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", days, "-extfile", f"{name}.ext", cwd=d)
    return Certs(ca=d / "ca.pem", server_cert=d / "server.pem", server_key=d / "server.key",
                 client_cert=d / "client.pem", client_key=d / "client.key", other_ca=d / "other-ca.pem")


class TLSTerminator:
    """TLS on 127.0.0.1:``port`` in front of plaintext 127.0.0.1:``upstream_port``; a context manager.

    ``client_ca``: require client certificates signed by it (mutual TLS).
    ``connections`` counts accepted TCP connections.
    """

    def __init__(self, upstream_port: int, certs: Certs, *, client_ca: Path | None = None, port: int = 0):
        self.upstream_port = upstream_port
        self.port = port
        self.connections = 0
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(certs.server_cert, certs.server_key)
        if client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(client_ca)
        self._ctx = ctx
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tls-terminator", daemon=True)
        self._server = None

    def __enter__(self) -> "TLSTerminator":
        self._thread.start()
        if not self._ready.wait(10) or self._server is None:
            raise RuntimeError("TLS terminator did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(
            self._serve, "127.0.0.1", self.port, ssl=self._ctx, ssl_handshake_timeout=10))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError, ssl.SSLError):
                pass
            finally:
                try:
                    dst.close()
                except Exception:  # noqa: BLE001 - already closed by the other side
                    pass

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
