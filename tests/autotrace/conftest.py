"""What the traced-job tests share: a real `stragglerscope run` to trace into."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def fleet(broker, tmp_path_factory):
    """A real `stragglerscope run` on the module's broker, its chDB store behind the daemon; one per test module."""
    from tests.fleet import fleet_config, start_fleet, stop_fleet

    d = tmp_path_factory.mktemp("trace-fleet")
    cfg = fleet_config(d, broker.bootstrap)
    proc, store = start_fleet(cfg, d / "run.log")
    yield cfg, store
    stop_fleet(proc, store)
