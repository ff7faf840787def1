"""Our NCCL profiler plugin (``plugin.c``): where its shared library is, building it, arming it for a job.

NCCL loads the library ``NCCL_PROFILER_PLUGIN`` names when a communicator is made; the plugin then writes
each proxy operation's peer, channel, bytes and times to ``STRAGGLERSCOPE_NCCL_PEERS_DIR`` in the layout
``ingest.nccl_peers`` reads. The library is built with the C compiler at set-up (``make setup``, or
``python -m ingest.nccl_profiler``) beside this file, or, where the package folder is not writable (an
installed wheel), in the user's cache; ``stragglerscope trace`` builds it on demand when it is missing or
older than its source. A training rank only looks for it: 512 ranks must not start 512 compilers.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("plugin.c")
LIB_NAME = "libnccl-profiler-stragglerscope.so"  # NCCL's naming for a plugin picked by name
ENV_PLUGIN = "NCCL_PROFILER_PLUGIN"
ENV_DIR = "STRAGGLERSCOPE_NCCL_PEERS_DIR"
CFLAGS = ["-O2", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden", "-std=c11", "-Wall", "-Wextra"]


class BuildError(RuntimeError):
    """The library could not be built (no C compiler, or it failed); the message says which."""


def _candidates() -> list[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stragglerscope" / "nccl-profiler"
    return [SOURCE.parent / "_build" / LIB_NAME, cache / LIB_NAME]


def _fresh(path: Path) -> bool:
    try:
        return path.stat().st_mtime >= SOURCE.stat().st_mtime
    except OSError:
        return False


def library_path() -> Path | None:
    """The built library, if one as new as its source exists; None otherwise. Never builds."""
    return next((p for p in _candidates() if _fresh(p)), None)


def compiler() -> str | None:
    cc = os.environ.get("CC") or "gcc"
    return shutil.which(cc) or shutil.which("cc")


def build(force: bool = False) -> Path:
    """Build the library (unless a fresh one exists) and return its path; BuildError if it cannot be."""
    if not force:
        found = library_path()
        if found is not None:
            return found
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (gcc) found: install it (Debian: apt-get install gcc)")
    errors = []
    for target in _candidates():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # Compiled under a temporary name and renamed: ranks or a second `trace` never load half a file.
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
            os.close(fd)
        except OSError as e:
            errors.append(f"{target.parent}: {e}")
            continue
        try:
            done = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                                  timeout=120)
            if done.returncode != 0:
                raise BuildError(f"{cc} failed building {SOURCE.name}:\n{done.stderr.strip()}")
            os.replace(tmp, target)
            return target
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise BuildError("no writable place for the library: " + "; ".join(errors))


def ensure_built() -> Path | None:
    """``build()``, or None where it cannot be built (the caller carries on without per-peer times)."""
    try:
        return build()
    except (BuildError, OSError, subprocess.SubprocessError):
        return None


def arm(env: dict[str, str] | os._Environ, peers_dir: str) -> str | None:
    """Set ``env`` so that NCCL, once it makes a communicator in this process, loads the plugin and the
    plugin writes to ``peers_dir`` (made here). Returns why it was not armed, or None when it was. A
    profiler plugin the user chose (``NCCL_PROFILER_PLUGIN`` set) is kept: NCCL loads only one."""
    lib = library_path()
    if lib is None:
        return ("the NCCL profiler plugin is not built (make setup, or python -m ingest.nccl_profiler): "
                "per-peer link times of NCCL collectives are off")
    theirs = env.get(ENV_PLUGIN)
    if theirs and theirs != str(lib):
        return f"{ENV_PLUGIN} is set to {theirs!r}: kept, so per-peer link times of NCCL collectives are off"
    try:
        os.makedirs(peers_dir, exist_ok=True)
    except OSError as e:
        return f"cannot make {peers_dir} for the NCCL profiler plugin ({e}): per-peer link times are off"
    env[ENV_PLUGIN] = str(lib)
    env[ENV_DIR] = peers_dir
    return None
