"""The base install is what a training image needs, and all it needs (issue 49).

A fresh virtual environment gets `pip install <this repository>` (the base: no `server` extra) beside
PyTorch, as a training image would. Checked there, from a folder outside the repository (so the installed
copy is what runs): none of the server side's packages came with it; a real two-rank DDP job under
`stragglerscope trace` sends its records to a real broker (the fleet mode: kafka.bootstrap set), where they
arrive; a server command says in one line what to install.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def pip(venv: Path, *args: str, timeout: float = 600) -> None:
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args], capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> Path:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (make setup-test installs it)")
    venv = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # The training stack first, as an image has it, then the project as a user installs it (not editable).
    pip(venv, f"torch=={__import__('torch').__version__.split('+')[0]}")
    from tests.packaging import project_copy

    pip(venv, str(project_copy(venv.parent / "src")))
    return venv


def test_the_base_install_has_nothing_of_the_server_side(base_venv):
    from stragglerscope.cli import SERVER_MODULES

    code = ("import importlib.util, json; "
            f"print(json.dumps(sorted(m for m in {sorted(SERVER_MODULES)!r} if importlib.util.find_spec(m))))")
    out = subprocess.run([str(base_venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [], out.stdout


def test_a_job_traced_with_the_base_install_sends_its_records(base_venv, broker, tmp_path):
    from kafka import KafkaConsumer

    from core import codec, topics
    from core.kafka_admin import ensure_topics
    from services.ports import free_fixed_port

    ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 2)
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(f'[kafka]\nbootstrap = "{broker.bootstrap}"\npartitions = 2\n')
    job = f"base-{uuid.uuid4().hex[:6]}"
    bin_ = base_venv / "bin"
    r = subprocess.run([str(bin_ / "stragglerscope"), "trace", "--config", str(cfg), "--job-id", job, "--sample",
                        "4/4", "--", str(bin_ / "python"), "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(free_fixed_port()),
                        str(ROOT / "tests" / "training" / "zoo.py"), "--framework", "ddp", "--steps", "8",
                        "--gpu-ms", "5"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 rank(s) instrumented" in r.stderr and "instrumentation disabled" not in r.stderr, r.stderr[-3000:]
    kinds: dict[str, int] = {}
    consumer = KafkaConsumer(*topics.INPUT_TOPICS, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=5000, group_id=None)
    try:
        for m in consumer:
            if m.key == job.encode():
                kind, table = codec.decode(m.value)
                kinds[kind] = kinds.get(kind, 0) + table.num_rows
    finally:
        consumer.close()
    assert kinds.get("job") == 1, kinds           # the registration, from rank 0
    assert kinds.get("op_span", 0) > 0 and kinds.get("heartbeat", 0) >= 2, kinds  # spans; a last beat per rank
    assert kinds.get("tcp_flow", 0) > 0, kinds   # gloo's connections, read off the training thread


def test_a_server_command_on_the_base_install_says_what_to_install(base_venv, tmp_path):
    r = subprocess.run([str(base_venv / "bin" / "stragglerscope"), "run"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr  # one line
    assert "pip install 'stragglerscope[server]'" in r.stderr and "Traceback" not in r.stderr
