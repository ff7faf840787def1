"""The two files a daemon keeps in its store's directory: ``daemon.json`` names it, ``daemon.token`` holds its token.

Discovery file ``PATH/daemon.json``: ``{"url": ..., "pid": ..., "store": ...}``,
written once the server listens and removed when it stops; a file whose pid
is gone is stale and removed by the next ``open_store``.

Token file ``PATH/daemon.token``: a random token (``secrets.token_urlsafe``)
and the daemon's own address, created with mode 0600 (only its owner may
read it) before anything names the daemon. The daemon's URL names the file,
not the token: ``http://127.0.0.1:PORT?token_file=PATH/daemon.token``, so
it can travel to Ray actors, the console and logs. A reader refuses a token
file that other users may read or write (the token would not be a secret;
``chmod 600`` mends it) and one written by a daemon at another address (the
URL is stale: sending that token to whatever now listens on the old port
would give it away).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from pathlib import Path
from urllib.parse import quote

from storage.errors import StoreError

DISCOVERY_FILE = "daemon.json"
TOKEN_FILE = "daemon.token"


# --------------------------------------------------------------------------
# discovery
# --------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an unreaped child of ours is a zombie: dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def discover(path: str | os.PathLike) -> str | None:
    """URL of the live daemon serving ``path``, or None; removes a stale discovery file."""
    file = Path(path) / DISCOVERY_FILE
    try:
        info = json.loads(file.read_text())
        pid, url = int(info["pid"]), str(info["url"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # half-written or foreign: ignore, the chDB lock still protects the path
    if pid == os.getpid():
        return None  # we are the daemon: use the path directly
    if _pid_alive(pid):
        return url
    try:
        file.unlink()
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------
# token
# --------------------------------------------------------------------------
def token_path(store_path: str | os.PathLike) -> Path:
    """Where the daemon serving ``store_path`` keeps its token (absolute)."""
    return Path(os.path.abspath(os.fspath(store_path))) / TOKEN_FILE


def daemon_url(host: str, port: int, store_path: str | os.PathLike) -> str:
    """The URL of the daemon serving ``store_path`` on ``host:port``: it names the token file, not the token."""
    return f"http://{host}:{port}?token_file={quote(str(token_path(store_path)), safe='/')}"


def write_token(file: Path, address: str) -> str:
    """A new random token for the daemon at ``address``, written to ``file`` (mode 0600) atomically."""
    token = secrets.token_urlsafe(32)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    # O_EXCL | O_NOFOLLOW: never write through a file or link someone else put there; 0600 from the start.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, json.dumps({"url": address, "pid": os.getpid(), "token": token}).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, file)
    from core.redact import add_secret

    add_secret(token)
    return token


def read_token(path: str, address: str) -> str:
    """The token in ``path`` for the daemon at ``address``; StoreError when it cannot be trusted or read."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise StoreError(f"cannot read the store daemon's token file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"the store daemon's token file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise StoreError(f"the store daemon's token file {path} is open to other users (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}): anyone who reads it may write to the store; "
                         f"chmod 600 {path}, or restart the daemon, which writes a new one with mode 0600")
    try:
        with open(path, encoding="utf-8") as f:
            info = json.loads(f.read(65536))
        token, written_for = str(info["token"]), str(info["url"])
    except OSError as e:
        raise StoreError(f"cannot read the store daemon's token file {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError):
        raise StoreError(f"the store daemon's token file {path} is not one a daemon wrote") from None
    if written_for != address:
        raise StoreError(f"the token file {path} is for the store daemon at {written_for}, not {address}: the "
                         "daemon moved; open the store by its chdb:// path (that finds the daemon and its token)")
    from core.redact import add_secret

    add_secret(token)
    return token
