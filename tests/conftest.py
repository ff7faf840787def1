"""Session fixtures for the real services: the Tansu broker, a local Ray on 127.0.0.1.

Integration tests start real components (ARCHITECTURE.md): a mock of a
service we integrate with is not a test of that integration. Each fixture is
session-scoped, listens on 127.0.0.1 only and is stopped at the end.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Ray binds the machine's external address unless this is set (loopback only).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def broker():
    from ingest.broker import LocalBroker

    with LocalBroker() as b:
        yield b


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray on 127.0.0.1 shared by the integration tests (about 3 s to start)."""
    import ray

    from ray_jobs.pipeline import init_ray
    from stragglerscope.config import Config

    init_ray(Config())
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    d = ROOT / "tests" / "artifacts"
    d.mkdir(parents=True, exist_ok=True)
    return d
