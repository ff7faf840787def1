"""How to reach a Kafka cluster: its bootstrap servers and the transport's security.

Every Kafka client stragglerscope builds (the exporters' producer, the
shards' consumer and dead-letter producer, the admin calls) takes its
connection options from one ``KafkaConn``, so TLS and SASL are configured in
one place (``[kafka]`` in the config) and cannot be forgotten at one call site.
Functions that connect accept either a ``KafkaConn`` or a bare bootstrap
string (plaintext, as the embedded broker and most tests use).

Secrets: the SASL password comes from ``STRAGGLERSCOPE_KAFKA_SASL_PASSWORD``
or from ``sasl_password_file`` (read when a client is built, so the path can
travel to other processes and the secret does not). It is never printed:
``repr`` leaves it out and it is registered with the redactor.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import ssl
from typing import Any

log = logging.getLogger(__name__)

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")
PASSWORD_ENV = "STRAGGLERSCOPE_KAFKA_SASL_PASSWORD"


class KafkaConnError(ValueError):
    """A Kafka connection setting that cannot work; the message names the key."""


@dataclasses.dataclass(frozen=True)
class KafkaConn:
    bootstrap: str
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "SCRAM-SHA-512"
    sasl_username: str = ""
    sasl_password_file: str = ""
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_check_hostname: bool = True
    topic_generation_s: float = 0.0  # > 0: input topics come in generations (core.topics); travels to `trace`'s ranks
    sasl_password: str = dataclasses.field(default="", repr=False, compare=False)

    def __str__(self) -> str:  # where messages name the cluster
        return self.bootstrap

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def check(self) -> "KafkaConn":
        """Raise KafkaConnError for settings that cannot work; returns self."""
        if self.security_protocol not in PROTOCOLS:
            raise KafkaConnError(f"kafka.security_protocol must be one of {', '.join(PROTOCOLS)}, "
                                 f"not {self.security_protocol!r}")
        if self.uses_sasl:
            if self.sasl_mechanism not in MECHANISMS:
                raise KafkaConnError(f"kafka.sasl_mechanism must be one of {', '.join(MECHANISMS)}, "
                                     f"not {self.sasl_mechanism!r}")
            if not self.sasl_username:
                raise KafkaConnError(f"kafka.security_protocol = {self.security_protocol} needs kafka.sasl_username")
            if self.sasl_password and self.sasl_password_file:
                raise KafkaConnError(f"the Kafka password comes from {PASSWORD_ENV} and kafka.sasl_password_file: "
                                     "keep one")
            if not (self.sasl_password or self.sasl_password_file or os.environ.get(PASSWORD_ENV)):
                raise KafkaConnError(f"kafka.security_protocol = {self.security_protocol} needs a password: "
                                     f"set {PASSWORD_ENV} or kafka.sasl_password_file")
            if self.sasl_mechanism == "PLAIN" and not self.uses_tls:
                # Allowed (a trusted network may carry it), but the password crosses the wire in clear.
                log.warning(
                    "kafka: SASL PLAIN without TLS sends the password in clear; use SASL_SSL or SCRAM")
        tls_files = {"ssl_cafile": self.ssl_cafile, "ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile}
        given = {k: v for k, v in tls_files.items() if v}
        if given and not self.uses_tls:
            raise KafkaConnError(f"kafka.{next(iter(given))} is set but kafka.security_protocol = "
                                 f"{self.security_protocol} does not use TLS (SSL or SASL_SSL)")
        if self.ssl_keyfile and not self.ssl_certfile:  # a certfile may hold its key; a key alone is a mistake
            raise KafkaConnError("kafka.ssl_keyfile needs kafka.ssl_certfile (the client certificate)")
        for key, path in list(given.items()) + ([("sasl_password_file", self.sasl_password_file)]
                                                 if self.sasl_password_file else []):
            if not os.path.isfile(path):
                raise KafkaConnError(f"kafka.{key}: no such file: {path}")
            if not os.access(path, os.R_OK):
                raise KafkaConnError(f"kafka.{key}: not readable: {path}")
        return self

    def _password(self) -> str:
        if self.sasl_password:
            return self.sasl_password
        if self.sasl_password_file:
            try:
                with open(self.sasl_password_file, encoding="utf-8") as f:
                    pw = f.read().strip("\r\n")
            except OSError as e:
                raise KafkaConnError(f"kafka.sasl_password_file: cannot read {self.sasl_password_file}: "
                                     f"{e.strerror or e}") from None
        else:
            pw = os.environ.get(PASSWORD_ENV, "")
        if not pw:
            raise KafkaConnError("the Kafka SASL password is empty")
        return pw

    def client_options(self) -> dict[str, Any]:
        """kafka-python keyword arguments (besides ``bootstrap_servers``) for this transport."""
        opts: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.uses_tls:
            opts["ssl_check_hostname"] = self.ssl_check_hostname
            # No CA file: the system's trust store verifies the brokers.
            for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                if getattr(self, key):
                    opts[key] = getattr(self, key)
        if self.uses_sasl:
            from core.redact import add_secret

            pw = self._password()
            add_secret(pw)
            opts.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                        sasl_plain_password=pw)
        return opts

    def describe(self) -> str:
        """One line for the terminal: where, and how it is protected (no secret)."""
        if self.security_protocol == "PLAINTEXT":
            return self.bootstrap
        how = self.security_protocol
        if self.uses_sasl:
            how += f" {self.sasl_mechanism} as {self.sasl_username}"
        return f"{self.bootstrap} ({how})"

    # Children of `stragglerscope trace` find the transport in one environment variable (no secret in it:
    # the password travels as STRAGGLERSCOPE_KAFKA_SASL_PASSWORD, which they inherit, or as a file path).
    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                           if f.name not in ("bootstrap", "sasl_password")}, sort_keys=True)

    @classmethod
    def from_json(cls, bootstrap: str, text: str) -> "KafkaConn":
        try:
            data = json.loads(text) if text else {}
            known = {f.name for f in dataclasses.fields(cls)} - {"bootstrap", "sasl_password"}
            return cls(bootstrap=bootstrap, **{k: v for k, v in data.items() if k in known}).check()
        except (ValueError, TypeError) as e:
            raise KafkaConnError(f"bad Kafka transport settings in the environment: {e}") from None


def as_conn(target: "KafkaConn | str") -> KafkaConn:
    """A ``KafkaConn`` for a bare bootstrap string (plaintext) or the one given."""
    return target if isinstance(target, KafkaConn) else KafkaConn(bootstrap=str(target))


def diagnose(conn: KafkaConn, timeout_s: float = 3.0) -> str:
    """Why this transport cannot talk to the first bootstrap server that accepts TCP, or "".

    kafka-python reports a failed TLS handshake as "Unable to bootstrap" after
    its timeout; one direct handshake tells the operator the cause (an
    untrusted certificate, a refused client certificate, a broker that speaks
    TLS to a plaintext client). Cheap, and only run after a failure.
    """
    for hp in conn.bootstrap.split(","):
        where = hp.strip()
        host, _, port = where.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except (OSError, ValueError):
            continue
        with sock:
            sock.settimeout(timeout_s)
            if conn.uses_tls:
                return _tls_problem(conn, sock, host, where)
            try:  # a TLS server answers a ClientHello; a Kafka broker waits for a request
                probe = ssl.create_default_context()
                probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
                with probe.wrap_socket(sock, server_hostname=host):
                    return f"{where} speaks TLS: set kafka.security_protocol = SSL (or SASL_SSL) and kafka.ssl_cafile"
            except (OSError, ssl.SSLError):
                return _after_connect(conn, where)
    return ""


def _tls_problem(conn: KafkaConn, sock: socket.socket, host: str, where: str) -> str:
    """What goes wrong with TLS on the connected ``sock``, or the hint for a transport that works."""
    try:
        ctx = ssl.create_default_context(cafile=conn.ssl_cafile or None)
        ctx.check_hostname = conn.ssl_check_hostname
        if conn.ssl_certfile:
            ctx.load_cert_chain(conn.ssl_certfile, conn.ssl_keyfile or None)
    except (OSError, ssl.SSLError) as e:
        return f"the TLS files cannot be used: {e}"
    try:
        tls = ctx.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as e:
        return (f"TLS with {where}: {e.verify_message or 'certificate verify failed'} (certificate verify failed; "
                "is kafka.ssl_cafile the CA that signed the broker's certificate?)")
    except ssl.SSLError as e:
        return f"TLS handshake with {where} failed: {_ssl_reason(e)}"
    except OSError as e:
        return f"TLS handshake with {where} failed: {e}"
    with tls:
        # TLS 1.3: a server that refuses our client certificate says so after the handshake.
        tls.settimeout(1.0)
        try:
            data = tls.recv(1)
        except (socket.timeout, TimeoutError):
            return _after_connect(conn, where)
        except ssl.SSLError as e:
            return f"TLS with {where} failed after the handshake: {_ssl_reason(e)}"
        except OSError:
            data = b""
    if not data and not conn.ssl_certfile:  # a broker waits for our request; this one hung up
        return (f"{where} closed the TLS connection after the handshake: does it require "
                "a client certificate (kafka.ssl_certfile)?")
    return _after_connect(conn, where)


def _after_connect(conn: KafkaConn, where: str) -> str:
    """The hint when the transport itself works but the client still could not bootstrap."""
    if conn.uses_sasl:
        return (f"{where} accepts connections: check kafka.sasl_username, the password and kafka.sasl_mechanism "
                "(a SCRAM user must exist on the broker)")
    return f"{where} accepts connections but did not answer: does it require SASL (kafka.security_protocol)?"


def _ssl_reason(e: Exception) -> str:
    reason = getattr(e, "reason", None)
    return str(reason).replace("_", " ").lower() if reason else str(e)
