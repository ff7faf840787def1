"""`stragglerscope demo`: the whole product on embedded defaults, on this machine.

Starts what the configuration does not point elsewhere (the Tansu broker on a
free loopback port, the chDB store behind its daemon, a local Ray), produces a
synthetic fleet through the real producer code path, lets the shard actors
analyse it, and starts the console. Every process it starts listens on
127.0.0.1 and is stopped again on exit, Ctrl-C or SIGTERM, in reverse order.
The store lives on disk (``store.url``), so a second run adds to the history.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from core.config import Config

if TYPE_CHECKING:
    from core.kafka_conn import KafkaConn

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    jobs: int = 20
    windows: int = 2
    steps: int = 4
    min_gpus: int = 8
    max_gpus: int = 512
    seed: int = 0
    headless: bool = False
    once: bool = False
    timeout_s: float = 600.0


def run_tag(now: float | None = None) -> str:
    """Prefix of this run's job ids: runs add to the history instead of overwriting it."""
    return time.strftime("demo%Y%m%d-%H%M%S", time.gmtime(now))


def produce_fleet(bootstrap: KafkaConn | str, opts: DemoOptions, tag: str,
                  progress: Callable[[int, int], None] | None = None) -> tuple[list[tuple[str, int, int]], int]:
    """Registrations and op spans of a synthetic fleet; returns (window keys, op records)."""
    from generators.fleetgen import fleet_windows, make_fleet
    from ingest.producer import TelemetryProducer

    jobs = [dataclasses.replace(j, job_id=f"{tag}-{i:03d}")
            for i, j in enumerate(make_fleet(opts.jobs, opts.seed, opts.min_gpus, opts.max_gpus))]
    t0 = time.time_ns()
    keys: list[tuple[str, int, int]] = []
    n_ops = 0
    total = len(jobs) * opts.windows
    with TelemetryProducer(bootstrap, client_id="stragglerscope-demo") as prod:
        for spec in jobs:
            prod.send(spec.registration(t0, opts.steps))
        for spec, window_id, table in fleet_windows(jobs, opts.windows, opts.steps, t0):
            prod.send(table)
            keys.append((spec.job_id, spec.attempt, window_id))
            n_ops += table.num_rows
            if progress:
                progress(len(keys), total)
        if not prod.flush(120):
            raise RuntimeError("the broker did not acknowledge the fleet within 120 s")
        if prod.stats.records_dropped:
            raise RuntimeError(f"{prod.stats.records_dropped} records were dropped by the producer")
    return keys, n_ops


def write_fleet(directory: str, opts: DemoOptions, tag: str) -> tuple[int, int, int]:
    """The synthetic fleet as files: one op-span parquet per job in ``directory``, which `replay` reads (a smoke
    test of a deployed pipeline: `replay --publish-only --wait DIR/*.parquet`). Returns (jobs, windows, ops)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from generators.fleetgen import fleet_windows, make_fleet

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [dataclasses.replace(j, job_id=f"{tag}-{i:03d}")
            for i, j in enumerate(make_fleet(opts.jobs, opts.seed, opts.min_gpus, opts.max_gpus))]
    tables: dict[str, list] = {}
    windows = n_ops = 0
    for spec, _window_id, table in fleet_windows(jobs, opts.windows, opts.steps, time.time_ns()):
        tables.setdefault(spec.job_id, []).append(table)
        windows += 1
        n_ops += table.num_rows
    for job_id, parts in tables.items():
        pq.write_table(pa.concat_tables(parts), out / f"{job_id}.parquet")
    return len(tables), windows, n_ops


def console_env(cfg: Config) -> dict[str, str]:
    """The [kafka] and [ui] keys of ``cfg`` as the STRAGGLERSCOPE_* variables the console's ``load()`` reads.

    Streamlit runs the console as a script that cannot be handed ``--config``: without these, its run-time control
    would see the defaults (no Kafka, read-only) whatever the file said. Secrets (the SASL password) are left out:
    they come from the environment only, which the console inherits anyway."""
    from core.config import _ENV_ONLY

    env = {}
    for section in ("kafka", "ui"):
        for f in dataclasses.fields(getattr(cfg, section)):
            if (section, f.name) not in _ENV_ONLY:
                env[f"STRAGGLERSCOPE_{section}_{f.name}".upper()] = str(getattr(getattr(cfg, section), f.name))
    return env


def start_console(store_url: str, cfg: Config, output=None) -> subprocess.Popen:
    """The Streamlit console on ``ui.address``:``ui.port``, reading ``store_url``.

    ``output``: where its stdout and stderr go (default: this process's; tests pass a pipe).
    """
    from pathlib import Path

    app = Path(__file__).resolve().parent.parent / "ui" / "app.py"
    env = dict(os.environ, STRAGGLERSCOPE_STORE=store_url, **console_env(cfg))
    cmd = [sys.executable, "-m", "streamlit", "run", str(app),
           "--server.address", cfg.ui.address, "--server.port", str(cfg.ui.port),
           "--server.headless", "true", "--browser.gatherUsageStats", "false"]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=output,
                            stderr=None if output is None else subprocess.STDOUT, start_new_session=True)


def wait_console(url: str, timeout_s: float = 60.0) -> None:
    """Until the console at ``url`` answers its health check; TimeoutError after ``timeout_s``."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the console at {url} did not answer within {timeout_s:.0f} s")
        time.sleep(0.3)


def run_demo(cfg: Config, opts: DemoOptions) -> int:
    from tqdm import tqdm

    from stragglerscope.service import say, sigterm_as_interrupt, start_services, wait_stored

    sigterm_as_interrupt()
    try:
        with contextlib.ExitStack() as stack:
            svc = start_services(cfg, stack)
            tag = run_tag()
            bar = tqdm(total=opts.jobs * opts.windows, desc="produce", unit="window", file=sys.stderr, disable=None)
            keys, n_ops = produce_fleet(svc.cfg.kafka.conn(), opts, tag,
                                        progress=lambda n, total: bar.update(n - bar.n))
            bar.close()
            say(f"produced   {opts.jobs} jobs, {len(keys)} windows, {n_ops:,} op records (run {tag})")

            pending = wait_stored(svc, keys, opts.timeout_s)
            if pending:
                say(f"error: {len(pending)} of {len(keys)} windows were not stored within "
                    f"{opts.timeout_s:.0f} s; shard status: {svc.pipeline.status()}")
                return 1
            summary = svc.store.run_named("fleet_summary", {}).to_pylist()[0]
            say("stored     " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
            if opts.once:
                return 0
            if opts.headless:
                say("running headless; Ctrl-C stops")
            else:
                console = start_console(svc.cfg.store.url, cfg)
                stack.callback(stop_process_group, console)
                say(f"console    http://{cfg.ui.address}:{cfg.ui.port}  (Ctrl-C stops everything)")
            while True:
                time.sleep(1)
    except KeyboardInterrupt:
        say("stopped")
        return 0


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


STOP_GRACE_S = 10.0
"""How long a child process group has to exit after SIGTERM before it is killed."""


def stop_process_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop ``proc``, started with ``start_new_session``, and what it started: SIGTERM, then SIGKILL.

    The group, not only the process: a process it started that outlived it would hold the port or the
    chDB path. What has not exited ``grace_s`` after SIGTERM (it ignores it, or hangs on its way out) is
    killed. Returns once ``proc`` is reaped and its group is empty or killed.
    """
    deadline = time.monotonic() + grace_s
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    while _signal_group(proc.pid, 0) and time.monotonic() < deadline:
        time.sleep(0.1)  # what the process started, on its way out
    if _signal_group(proc.pid, 0):
        log.warning("process group %d did not stop within %.3g s of SIGTERM: killing it", proc.pid, grace_s)
        _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group (0: only check it); False when the group has no process left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True
