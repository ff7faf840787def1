"""Run the unchanged training zoo (tests/training/zoo.py) with torchrun, bare or armed as `stragglerscope trace` arms it.

Shared by ``trace_overhead.py`` and ``trace_accuracy.py``. Armed runs export to
a local Tansu broker through the real producer; ``read_ops`` reads a job's op
spans back, so the analysis runs in-process (the pipeline's own path is tested
in tests/autotrace).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ZOO = ROOT / "tests" / "training" / "zoo.py"


def run(framework: str, ranks: int, args: list[str], *, bootstrap: str | None = None, job_id: str = "",
        sample: str = "10/100", timeout: float = 600, probe_kb: int = 256) -> dict:
    """One torchrun of the zoo; returns rank 0's {'losses', 'step_times'}. Armed when ``bootstrap`` is given
    (``probe_kb``: the path probe's size, as ``trace --probe-kb``)."""
    from ingest.autotrace.session import TraceSettings, parse_sample
    from services.ports import free_fixed_port
    from stragglerscope.trace import child_env

    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as run_dir:
        env = None
        if bootstrap:
            env = child_env(TraceSettings(job_id=job_id, bootstrap=bootstrap, sampling=parse_sample(sample),
                                          run_dir=run_dir, probe_kb=probe_kb).to_env())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(free_fixed_port()), str(ZOO), "--framework", framework, "--out", out,
               *args]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{framework} run failed:\n{r.stderr[-3000:]}")
        return json.loads((Path(out) / "rank0.json").read_text())


def read_ops(bootstrap: str, job_id: str, partitions: int = 4):
    """Every op span of ``job_id`` on the broker."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from core import codec, topics
    from ray_jobs.kafka_source import KafkaSource

    src = KafkaSource(bootstrap, [topics.TOPIC_OPS], range(partitions))
    src.seek({})
    tables, empty = [], 0
    while empty < 3:
        msgs = src.poll(500)
        empty = 0 if msgs else empty + 1
        tables += [t for _, t in (codec.decode(m.value) for m in msgs)]
    src.close()
    ops = pa.concat_tables(tables)
    return ops.filter(pc.equal(ops["job_id"], job_id))
