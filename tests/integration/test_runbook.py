"""The runbook's one-machine commands, run as written (issue 50): docs/operations.md, blocks marked ``sh runbook``.

The blocks are read from the document, in order, so the runbook cannot drift from what works: the broker, the
store daemon, the driver, the console, the smoke test (a synthetic fleet written to files, published, every
window stored), an upgrade (the driver stopped with SIGTERM and started again), stopping. Only the variables
the runbook itself defaults are set here: free ports, a temporary folder, the command of this checkout.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.ports import free_fixed_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "docs" / "operations.md"


def runbook_blocks() -> list[str]:
    return re.findall(r"```sh runbook\n(.*?)```", RUNBOOK.read_text(), flags=re.S)


def test_the_runbook_has_its_one_machine_blocks():
    blocks = runbook_blocks()
    assert len(blocks) >= 8, blocks
    text = "\n".join(blocks)
    for words in ("$SS broker", "$SS store", "$SS run", "$SS console", "$SS demo --write", "--publish-only --wait",
                  "kill -TERM"):
        assert words in text, words


def test_the_runbook_s_one_machine_commands_work_as_written(tmp_path):
    env = dict(os.environ, SS=str(Path(sys.executable).parent / "stragglerscope"), SS_DIR=str(tmp_path / "ss"),
               SS_KAFKA_PORT=str(free_fixed_port()), SS_STORE_PORT=str(free_fixed_port()),
               SS_METRICS_PORT=str(free_fixed_port()), SS_CONSOLE_PORT=str(free_fixed_port()))
    for k in [k for k in env if k.startswith("STRAGGLERSCOPE_") and k != "STRAGGLERSCOPE_APACHE_KAFKA"]:
        env.pop(k)
    script = "set -euo pipefail\n" + "\n".join(f"echo '== runbook block {i + 1}' >&2\n{b}"
                                                for i, b in enumerate(runbook_blocks()))
    proc = subprocess.Popen(["bash", "-c", script], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever a failed block left running
        except ProcessLookupError:
            pass
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((tmp_path / "ss").glob("*.log")))
    assert proc.returncode == 0, out[-4000:] + logs
    assert "stored     8 windows" in out, out[-3000:]
    assert re.search(r"ss_store_up\{shard=\"0\"\} 1\.0", out), out[-3000:]
    run2 = (tmp_path / "ss" / "run2.log").read_text()
    assert "running; Ctrl-C stops" in run2 and "Traceback" not in run2, run2
    # Stopped as the runbook says, nothing it started is left (the console's Streamlit runs in a session of
    # its own: a console killed before it stopped it would leave it running).
    left = subprocess.run(["pgrep", "-f", f"--server.port {env['SS_CONSOLE_PORT']}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
