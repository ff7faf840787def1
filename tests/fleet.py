"""A real `stragglerscope run` pipeline for tests and benchmarks: its configuration, start and stop.

The pipeline (Ray shard actors, chDB behind the store daemon) runs as its own
process on a broker the caller started; ``start_fleet`` returns once it says
it is running, with a client of its store.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fleet_config(directory: Path, bootstrap: str) -> Path:
    """A `stragglerscope run` configuration on ``bootstrap`` with its chDB store in ``directory``."""
    cfg = directory / "fleet.toml"
    cfg.write_text(f'[kafka]\nbootstrap = "{bootstrap}"\npartitions = 4\n'
                   f'[store]\nurl = "chdb://{directory / "store"}"\n[pipeline]\nmetrics_port = -1\n')
    return cfg


def start_fleet(config: Path, log_path: Path, timeout: float = 180):
    """Start `stragglerscope run` on ``config``; returns (process, store). Stop with ``stop_fleet``."""
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "stragglerscope", "run", "--config", str(config)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + timeout
    text = ""
    while "running; Ctrl-C stops" not in text:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"pipeline did not start:\n{text[-3000:]}")
        time.sleep(0.5)
        log.seek(0)
        text = log.read()
    # The daemon's URL names its token file (?token_file=...): the store refuses requests without the token.
    url = re.search(r"served to the pipeline and console at (http://127\.0\.0\.1:\d+\S*)\)", text).group(1)
    from storage import open_store

    return proc, open_store(url)


def stop_fleet(proc, store) -> None:
    store.close()
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def stop_process_group(proc: subprocess.Popen, term_wait_s: float = 60) -> None:
    """Whatever is left of a command started in its own session (``trace`` passes SIGTERM on to the job's
    process group; the netfaults launcher takes its namespaces down on the way out): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
