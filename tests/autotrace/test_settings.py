"""`stragglerscope trace` settings and bad input: parsed or refused with one clear line (no services)."""
import os
import subprocess
import sys
import types

import pytest

from core.layout import JobLayout
from ingest.autotrace.layout import mesh_axis
from ingest.autotrace.session import (SettingsError, TraceSettings, coords_of, parse_layout, parse_sample,
                                      resolve_layout)
from ingest.exporter import Sampling
from stragglerscope.trace import BOOT_DIR, child_env, default_job_id, tidy_spool


def test_layout_and_sampling_parse_and_refuse():
    assert parse_layout("dp=2, pp=4,tp=8") == {"dp_size": 2, "pp_size": 4, "tp_size": 8}
    assert parse_layout("") == {}
    for bad in ("dp=0", "ep=2", "dp=two", "dp"):
        with pytest.raises(SettingsError):
            parse_layout(bad)
    assert parse_sample("10/100") == Sampling(10, 100)
    for bad in ("10", "0/5", "6/4", "a/b"):
        with pytest.raises(SettingsError):
            parse_sample(bad)


def test_layout_from_what_the_user_named_and_the_pipeline_reports():
    assert resolve_layout({}, 8) == JobLayout(8, 1)
    assert resolve_layout({"tp_size": 2}, 8, pp=2) == JobLayout(2, 2, tp_size=2)
    assert resolve_layout({}, 4, pp=2, vpp=2) == JobLayout(2, 2, vpp_size=2)
    with pytest.raises(SettingsError, match="pp=4 but the pipeline stages report pp=2"):
        resolve_layout({"pp_size": 4}, 8, pp=2)
    with pytest.raises(SettingsError, match="is 6 ranks, but the job has 8"):
        resolve_layout({"dp_size": 3, "pp_size": 2}, 8)
    assert resolve_layout({}, 8, reported={"dp_size": 2, "tp_size": 4}) == JobLayout(2, 1, tp_size=4)
    with pytest.raises(SettingsError, match="tp=2 but the DeviceMesh says tp=4"):
        resolve_layout({"tp_size": 2}, 8, reported={"tp_size": 4}, source="the DeviceMesh")
    # Megatron's order: TP fastest, then CP, DP, PP slowest.
    lay = JobLayout(dp_size=2, pp_size=2, tp_size=2)
    assert [coords_of(r, lay) for r in range(8)] == [(0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)]


def test_settings_travel_to_children_through_the_environment():
    st = TraceSettings(job_id="j-1", bootstrap="127.0.0.1:9", layout={"tp_size": 2}, sampling=Sampling(3, 7),
                       attempt=2, run_dir="/tmp/x", probe_kb=64)
    env = child_env(st.to_env(), base={"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(BOOT_DIR)
    assert env["PYTHONPATH"].endswith("/elsewhere")
    assert TraceSettings.from_env(env) == st
    with pytest.raises(SettingsError):
        TraceSettings.from_env({})
    with pytest.raises(SettingsError, match="PROBE_KB"):
        TraceSettings.from_env({**env, "STRAGGLERSCOPE_TRACE_PROBE_KB": "lots"})


def test_kafka_transport_travels_to_children_without_the_password(tmp_path):
    from core.kafka_conn import KafkaConn

    pw = tmp_path / "pw"
    pw.write_text("hunter2")
    conn = KafkaConn("10.0.0.1:9093", security_protocol="SASL_SSL", sasl_username="trainer",
                     sasl_password_file=str(pw), ssl_check_hostname=False)
    st = TraceSettings(job_id="j-1", bootstrap=conn.bootstrap, kafka_transport=conn.to_json())
    env = child_env(st.to_env(), base={})
    assert "hunter2" not in repr(env)
    back = TraceSettings.from_env(env).conn()
    assert back == conn and back.client_options()["sasl_plain_password"] == "hunter2"
    assert back.client_options()["ssl_check_hostname"] is False
    # No transport given: plaintext, as before.
    assert TraceSettings(job_id="j", bootstrap="h:1").conn().client_options() == {"security_protocol": "PLAINTEXT"}


def test_default_job_id_names_the_script():
    assert default_job_id(["torchrun", "--nproc-per-node", "4", "my train.py"], now=0) == "my-train-19700101-000000"
    assert default_job_id(["./run.sh"], now=0) == "run.sh-19700101-000000"


@pytest.mark.parametrize("argv, message", [
    (["trace"], "give the command to run after --"),
    (["trace", "--layout", "dp=x", "--", "true"], "bad layout item"),
    (["trace", "--sample", "5", "--", "true"], "bad sampling"),
    (["trace", "--job-id", "a b", "--", "true"], "--job-id"),
    (["trace", "--probe-kb", "-1", "--", "true"], "--probe-kb"),
])
@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_trace_bad_input_is_one_line_and_exit_2(argv, message, tmp_path):
    # A configured (unreachable is fine: checked later) broker keeps this from starting any service.
    env = dict(os.environ, STRAGGLERSCOPE_KAFKA_BOOTSTRAP="127.0.0.1:1")
    r = subprocess.run([sys.executable, "-m", "stragglerscope", *argv], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_an_unreachable_configured_broker_is_a_clear_error():
    env = dict(os.environ, STRAGGLERSCOPE_KAFKA_BOOTSTRAP="127.0.0.1:1")
    r = subprocess.run([sys.executable, "-m", "stragglerscope", "trace", "--", "true"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


class _BrokenExporter:
    """Every call raises: the tracer's hooks must swallow it."""

    class stats:
        errors = 0

    profiling = True

    def __getattr__(self, name):
        def boom(*a, **k):
            raise RuntimeError("exporter bug")
        return boom


def test_tracer_hooks_never_raise_into_training():
    torch = pytest.importorskip("torch")
    from ingest.autotrace.tracer import Tracer

    exp = _BrokenExporter()
    session = types.SimpleNamespace(exporter=exp, rank=0, world=1, layout=JobLayout(1, 1), settings=None)
    tr = Tracer(session)
    model = torch.nn.Linear(2, 2)
    tr._fwd_pre(model, ())
    tr._fwd_post(model, (), None)
    span = tr._bwd_begin()
    tr._bwd_end(span)
    tr.open = True
    tr._opt_pre(None, (), {})
    tr._opt_post(None, (), {})
    tr._gc("start", {})
    tr._gc("stop", {})
    assert exp.stats.errors >= 2  # counted (each kind logged once); nothing reached the caller


def test_module_hooks_narrow_to_the_outermost_module_after_the_first_step():
    """Global forward hooks take every module call off PyTorch's fast path (the always-on cost of
    unsampled steps, issue 17's overhead): after step 0 only the learned outermost module is hooked,
    and its forward spans are still recorded."""
    torch = pytest.importorskip("torch")
    from torch.nn.modules import module as nn_module

    from ingest.autotrace.tracer import Tracer
    from ingest.exporter import RankExporter

    sent = []
    exp = RankExporter("j", 0, 0, 0, sent.append, sampling=Sampling(1, 1), heartbeat_s=3600)
    session = types.SimpleNamespace(exporter=exp, rank=1, world=1, layout=JobLayout(1, 1), settings=None)
    tr = Tracer(session)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)
    tr.install()
    try:
        assert len(nn_module._global_forward_pre_hooks) == before[0] + 1
        for _ in range(3):
            model(torch.ones(4, 2)).sum().backward()
            opt.step()
            opt.zero_grad()
            # from the end of step 0 on: no global hook of ours, one pair on the model alone
            assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == before
            assert len(model._forward_pre_hooks) == 1 and len(model[0]._forward_pre_hooks) == 0
    finally:
        tr.close()
        exp.close()
    ops = [r for t in sent if t.schema.names[:1] == ["job_id"] and "optype" in t.schema.names
           for r in t.to_pylist()]
    fwd = [(r["step"], r["mb_id"]) for r in ops if r["optype"] == "forward-compute"]
    assert fwd == [(0, 0), (1, 0), (2, 0)]  # one forward per step: the outermost module, before and after
    assert exp.stats.errors == 0
    assert len(model._forward_pre_hooks) == 0  # close() undoes the narrowed hooks too


def test_a_device_mesh_gives_sizes_and_this_ranks_worker():
    from ingest.autotrace.tracer import _mesh_facts

    # torchtitan's mesh: pp x dp_replicate x dp_shard x cp x tp; HSDP's two DP dimensions multiply.
    names, shape = ("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 3, 1, 2)
    roles = [mesh_axis(n)[:2] for n in names]
    groups = [(0, 24), (0, 12), (0, 4, 8), (0,), (0, 1)]
    sizes, inner, dp, pp = _mesh_facts({"shape": shape, "coords": (1, 1, 2, 0, 1), "groups": groups}, roles)
    assert sizes == {"pp_size": 2, "dp_size": 6, "cp_size": 1, "tp_size": 2}
    assert (dp, pp) == (1 * 3 + 2, 1) and inner == [(0, 1)]  # a size-1 CP dimension folds nothing in
    assert mesh_axis("EP") == "dp_size" and mesh_axis("Pipeline") == "pp_size"  # unknown names count as DP


def test_relayout_keeps_what_the_processes_report_and_warns_on_a_contradiction():
    from ingest.autotrace.session import TraceSession

    sess = object.__new__(TraceSession)  # only what relayout reads: no torch.distributed here
    sess.settings, sess.world, sess.rank, sess.warnings = TraceSettings(job_id="j", bootstrap="", layout={"dp_size": 4}), 8, 0, []
    sess.relayout(mesh={"dp_size": 2, "tp_size": 4})
    assert sess.layout == JobLayout(2, 1, tp_size=4) and "the DeviceMesh says dp=2" in sess.warnings[0]
    # A mesh learned after the pipeline: the pipeline's pp stands and the sizes still make the world.
    sess.warnings = []
    sess.relayout(pp=2, vpp=1, mesh={"pp_size": 4, "dp_size": 2, "tp_size": 2})
    assert sess.layout == JobLayout(2, 2, tp_size=2)
    # The mesh and the pipeline disagree: the pipeline wins, the mesh's sizes are not used.
    sess.settings = TraceSettings(job_id="j", bootstrap="")
    sess.relayout(pp=2, vpp=1, mesh={"dp_size": 2, "tp_size": 4})
    assert sess.layout == JobLayout(4, 2) and "the DeviceMesh's sizes are not used" in sess.warnings[-1]


def test_a_spool_that_delivered_everything_is_removed_and_one_that_did_not_is_kept(tmp_path):
    spool = tmp_path / "stragglerscope-spool-job"
    for r in range(3):
        (spool / f"rank{r}").mkdir(parents=True)
    assert tidy_spool(str(spool)) == 0 and not spool.exists()
    (spool / "rank0").mkdir(parents=True)
    (spool / "rank1").mkdir()
    (spool / "rank1" / "00000000000000000001.msg").write_bytes(b"x")
    (spool / "rank1" / "00000000000000000002.msg").write_bytes(b"x")
    assert tidy_spool(str(spool)) == 2
    assert sorted(p.name for p in spool.iterdir()) == ["rank1"]  # the undelivered wait for a rerun
    assert tidy_spool(str(tmp_path / "never-made")) == 0
