"""Importers on real files made by real PyTorch: a Kineto trace and Flight Recorder dumps."""
import os
import subprocess
import sys
import textwrap

import pytest

from analyzers.hang import HangParams, HangTracker
from core import codec
from core import schema as S
from core.layout import JobLayout
from ingest.importers import ImportFormatError, flight_recorder_to_ccl, import_paths, kineto_to_ops, worker_of

pytestmark = pytest.mark.integration


def test_kineto_trace_of_a_real_profiler_run(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    model = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    path = tmp_path / "trace.json"
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=3),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(4):
            for mb in range(2):
                with record_function("forward-compute"):
                    y = model(x)
                with record_function("backward-compute"):
                    y.sum().backward()
            with record_function("optimizer"):
                pass
            prof.step()
    lay = JobLayout(dp_size=2, pp_size=2)
    ops = kineto_to_ops(path, "kin", lay, rank=3)
    assert set(ops["optype"].to_pylist()) == {"forward-compute", "backward-compute", "optimizer"}
    assert sorted(set(ops["step"].to_pylist())) == [1, 2, 3]
    assert ops.filter(__import__("pyarrow").compute.equal(ops["optype"], "forward-compute")).num_rows == 6
    assert set(ops["dp_rank"].to_pylist()) == {1} and set(ops["pp_rank"].to_pylist()) == {1}
    assert min(ops["duration_ns"].to_pylist()) >= 0
    assert codec.conform(ops, S.OP_SPAN).num_rows == ops.num_rows


def test_flight_recorder_dumps_of_a_stuck_gloo_job_name_the_missing_rank(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "fr.py"
    script.write_text(textwrap.dedent(f"""
        import os, time, torch, torch.distributed as dist, torch.multiprocessing as mp, datetime
        def w(rank):
            dist.init_process_group("gloo", rank=rank, world_size=3, init_method="tcp://127.0.0.1:{_port()}",
                                    timeout=datetime.timedelta(seconds=30))
            t = torch.ones(256)
            for _ in range(4):
                dist.all_reduce(t)
            if rank != 2:  # rank 2 never enters the fifth all_reduce
                work = dist.all_reduce(t, async_op=True)
            time.sleep(1.0)  # let Flight Recorder retire the finished entries before the dump
            import torch._C._distributed_c10d as c
            open(os.path.join({str(tmp_path)!r}, f"fr_rank_{{rank}}.json"), "wb").write(c._dump_fr_trace_json(True, True))
            os._exit(0)
        if __name__ == "__main__":
            mp.spawn(w, nprocs=3)
    """))
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="1000")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    dumps = sorted(tmp_path.glob("fr_rank_*.json"))
    assert len(dumps) == 3, r.stderr[-2000:]
    tracker = HangTracker("fr", params=HangParams(floor_s=0.0, k_steps=0.0))
    for path, table in import_paths("flight-recorder", [str(p) for p in dumps], job_id="fr"):
        assert table.num_rows >= 4
        tracker.add_ccl(table)
    ent = tracker.entered["pg:default_pg"]
    assert ent == {0: 5, 1: 5, 2: 4}
    assert tracker.completed["pg:default_pg"][2] == 4
    assert tracker.group_ranks["pg:default_pg"] == {0, 1, 2}


def _port():
    from services.ports import free_port

    return free_port()


def test_worker_of_follows_megatron_order():
    lay = JobLayout(dp_size=2, pp_size=2, tp_size=4)
    assert [worker_of(r, lay) for r in (0, 3, 4, 8, 15)] == [(0, 0), (0, 0), (1, 0), (0, 1), (1, 1)]


def test_bad_inputs_are_one_line_errors(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ImportFormatError, match="not readable JSON"):
        kineto_to_ops(bad, "j", JobLayout(1, 1), rank=0)
    bad.write_text('{"a": 1}')
    with pytest.raises(ImportFormatError, match="no traceEvents"):
        kineto_to_ops(bad, "j", JobLayout(1, 1), rank=0)
    evil = tmp_path / "evil_0.pkl"
    import pickle
    evil.write_bytes(pickle.dumps(ImportFormatError("x")))
    with pytest.raises(ImportFormatError, match="refusing to unpickle"):
        flight_recorder_to_ccl(evil, "j")
    with pytest.raises(ImportFormatError, match="unknown format"):
        import_paths("csv", [str(bad)])
    with pytest.raises(FileNotFoundError):
        import_paths("kineto", [str(tmp_path / "nope.json")], layout=JobLayout(1, 1))
