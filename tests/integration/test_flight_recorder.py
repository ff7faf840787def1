"""PyTorch's Flight Recorder goes with a stuck rank's stacks into the hang's evidence.

A real 2-rank gloo job (``flight_recorder_worker.py``) in the environment ``stragglerscope trace`` gives a
job: rank 0 waits inside all-reduce #2 while rank 1 is 4 s late to it. Rank 0's heartbeat, once the
all-reduce has been in flight past ``hang_dump_s``, carries the library's own account (the default group's
collective 3 enqueued, 2 completed, the all-reduce pending), and the hang detector keeps it as evidence.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from analyzers.hang import HangParams, HangTracker
from ingest import flight_recorder
from stragglerscope.trace import child_env

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("flight_recorder_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def test_the_flight_recorder_of_a_stuck_rank_is_in_the_hang_evidence(tmp_path):
    pytest.importorskip("torch")
    from services.ports import free_fixed_port

    env = child_env({}, base={k: v for k, v in __import__("os").environ.items() if k not in flight_recorder.ENV})
    # trace turns it on for the job, with the one variable this torch reads (issue 52: both made it warn)
    assert [k for k in flight_recorder.ENV if k in env] == ["TORCH_FR_BUFFER_SIZE"], env
    port = free_fixed_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(port), str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_o, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    hb = pa.concat_tables([pa.ipc.open_file(tmp_path / f"rank{r}.hb.arrow").read_all() for r in range(2)])
    dumped = [r for r in hb.to_pylist() if r["rank"] == 0 and r["flight_recorder"]]
    assert dumped and dumped[0]["stack"] and dumped[0]["inflight_op"] == "all_reduce", hb.to_pylist()
    fr = json.loads(dumped[0]["flight_recorder"])
    (status,) = fr["groups"].values()
    assert status["enqueued"] == 3 and status["completed"] == 2, fr
    assert [p["op"] for p in fr["pending"]] == ["gloo:all_reduce"], fr

    # The hang as the detector sees it mid-wait: rank 0 inside world #2, rank 1 missing; the evidence has it.
    upto = dumped[0]["ts_ns"]
    tracker = HangTracker("fr-job", params=HangParams(floor_s=1.0, k_steps=1.0))  # steps of ms, heartbeats 0.3 s apart
    tracker.add_heartbeats(hb.filter(pa.compute.less_equal(hb["ts_ns"], upto)).sort_by("ts_ns"))
    hang = tracker.evaluate(upto)
    assert hang is not None and (hang.kind, hang.group, hang.missing_ranks) == ("comm_hang", "world", [1]), hang
    assert hang.evidence["flight_recorder"]["0"] == fr


def test_no_flight_recorder_is_an_empty_summary_not_an_error():
    assert flight_recorder.summary({}) == ""
    assert flight_recorder.summary({"pg_status": {}, "entries": []}) == ""
