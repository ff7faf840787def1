"""Connecting the driver to Ray: a local Ray on 127.0.0.1, or a cluster checked before ``ray.init``.

``ray.init`` to a wrong address does not fail, it retries for minutes; so the
address is checked first with a TCP connect and an HTTP/2 preface (Ray's
servers speak gRPC), and a refusal for a token names the way to give one.
"""
from __future__ import annotations

import logging
import socket

from core.config import Config
from ray_jobs.errors import PipelineError

RAY_CONNECT_CHECK_S = 5.0
"""How long the TCP check of ``ray.address`` waits: ray.init() itself retries a dead address for minutes."""

def ray_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) that ``ray.init(address=...)`` will connect to; None for 'auto' and the like."""
    addr = address.strip()
    default = 6379
    if addr.startswith("ray://"):
        addr, default = addr[len("ray://"):], 10001
    elif "://" in addr or addr in ("auto", "local"):
        return None
    host, sep, port = addr.rstrip("/").rpartition(":")
    if not sep:
        host, port = addr.rstrip("/"), str(default)
    try:
        return host.strip("[]") or "127.0.0.1", int(port)
    except ValueError:
        raise PipelineError(f"bad ray.address {address!r}: write host:port (the head's GCS, e.g. "
                            "ray-head:6379) or ray://host:10001") from None


def check_ray_reachable(address: str, timeout_s: float = RAY_CONNECT_CHECK_S) -> None:
    """PipelineError with one line when nothing accepts connections at ``address``.

    ``ray.init`` to a closed port does not fail: it retries for minutes and
    prints its C++ warnings on the terminal (measured with Ray 2.60: no
    answer after 5 minutes). A plain TCP connect says in milliseconds.
    """
    import socket

    endpoint = ray_endpoint(address)
    if endpoint is None:
        return
    try:
        with socket.create_connection(endpoint, timeout=timeout_s) as sock:
            if speaks_grpc(sock, timeout_s):
                return
            reason = None
    except OSError as e:
        reason = e.strerror or type(e).__name__
    if reason is None:
        raise PipelineError(f"{address} accepts connections but is not a Ray head (no gRPC answer in "
                            f"{timeout_s:.0f} s): use the head's GCS port (host:6379) or its Ray Client port "
                            "(ray://host:10001)")
    raise PipelineError(f"no Ray cluster reachable at {address} ({reason}); set ray.address to the head's "
                        "address (host:6379, or ray://host:10001), or leave it empty for a local Ray")


def speaks_grpc(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server on ``sock`` answers HTTP/2's connection preface with its SETTINGS frame.

    Ray's GCS and Ray Client servers are gRPC, which is HTTP/2: they send
    SETTINGS at once. Anything else (a Kafka broker, a web server on that port)
    stays silent or answers otherwise, where ``ray.init`` would retry for ever.
    """
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # + empty SETTINGS
    sock.settimeout(timeout_s)
    head = b""
    try:
        while len(head) < 9:  # a frame header: length (3 bytes), type, flags, stream id
            chunk = sock.recv(9 - len(head))
            if not chunk:
                break
            head += chunk
    except OSError:
        return False
    return len(head) == 9 and head[3] == 0x04


def init_ray(cfg: Config) -> None:
    """Connect to ``cfg.ray.address`` or start a local Ray that listens on 127.0.0.1 only."""
    import ray

    if ray.is_initialized():
        return
    if cfg.ray.address:
        check_ray_reachable(cfg.ray.address)
        try:
            ray.init(address=cfg.ray.address, log_to_driver=False, configure_logging=True,
                     logging_level=logging.WARNING)  # no "Connecting to ..." lines among run's own
        except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:  # ray[client] missing, refused ...
            raise PipelineError(f"cannot connect to Ray at {cfg.ray.address}: {first_line(e)}{_token_hint()}"
                                ) from None
        _route_ray_logs()
        return
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set by ray_jobs/__init__.py, before Ray is imported.
    # address="local": a Ray of our own, whatever else this host has seen. Without it ray.init joins the
    # cluster RAY_ADDRESS or Ray's marker of the last `ray start` names, even one long stopped (and then
    # refuses num_cpus: "When connecting to an existing cluster, num_cpus and num_gpus must not be provided").
    ray.init(
        address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
        log_to_driver=False, configure_logging=True, logging_level=logging.WARNING,
    )
    _route_ray_logs()


def _route_ray_logs() -> None:
    """Ray's Python log lines go where its native ones go (``run``'s driver log), not to the terminal."""
    from core.logs import NativeStderr

    native = NativeStderr.current()
    if native is not None:
        native.route(("ray",))


TOKEN_HELP = ("set RAY_AUTH_MODE=token and the cluster's token on this driver (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, "
              "or the file ~/.ray/auth_token; `ray get-auth-token` on a node prints it): README, On a Ray cluster")


def _token_hint() -> str:
    """Why Ray refused the connection, where its native log says it was the token (``ray.init`` only says that it
    could not connect, after 20 s of retries)."""
    import os

    from core.logs import NativeStderr

    native = NativeStderr.current()
    said = native.tail() if native is not None else ""
    if "InvalidAuthToken" in said or "Unauthenticated" in said:
        got = "a token" if os.environ.get("RAY_AUTH_MODE") == "token" else "no token (RAY_AUTH_MODE is not token)"
        return f"; the cluster requires token authentication and this driver sent {got} or the wrong one: {TOKEN_HELP}"
    if os.environ.get("RAY_AUTH_MODE") != "token":
        return f"; if the cluster uses token authentication (Ray's default for every cluster from 2.61), {TOKEN_HELP}"
    return ""


def first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:300]
    return type(e).__name__
