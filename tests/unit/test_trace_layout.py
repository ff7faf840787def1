"""Where a traced rank sits (issue 37): rank orders, the groups a job uses, the claims check, the engine's
backward, pipeline transfers outside torch.distributed.pipelining, the layout-conflict verdict. No processes."""
from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest

from core.layout import JobLayout
from ingest.autotrace import layout as L
from ingest.autotrace.session import SettingsError, TraceSettings, coords_of, parse_layout
from ingest.exporter import Sampling


# -- --layout and rank orders --------------------------------------------------------------------------------
def test_layout_states_a_rank_order_outermost_first():
    assert parse_layout("dp=2,pp=2,order=dp,pp") == {"dp_size": 2, "pp_size": 2, "order": "dp,pp"}
    assert parse_layout("order=pp,dp,tp,tp=2") == {"order": "pp,dp,tp", "tp_size": 2}
    assert parse_layout("order=dp-pp") == {"order": "dp,pp"}
    for bad in ("order=dp,ep", "order=dp,dp", "order=", "dp=2,order=pp,x=3"):
        with pytest.raises(SettingsError):
            parse_layout(bad)
    st = TraceSettings(job_id="j", bootstrap="h:1", layout=parse_layout("tp=2,order=tp,pp"), peak_flops=312e12)
    assert TraceSettings.from_env(st.to_env()) == st
    # No peak named: none travels, so a STRAGGLERSCOPE_TRACE_PEAK_FLOPS of the user's shell reaches the ranks.
    assert "STRAGGLERSCOPE_TRACE_PEAK_FLOPS" not in TraceSettings(job_id="j", bootstrap="h:1").to_env()
    with pytest.raises(SettingsError):
        TraceSettings.from_env({**st.to_env(), "STRAGGLERSCOPE_TRACE_PEAK_FLOPS": "lots"})


def test_coordinates_in_a_rank_order():
    sizes = {"dp": 2, "pp": 2}
    # order=dp,pp: dp_rank, stage = divmod(rank, pp) (the issue's job)
    assert [(c["dp"], c["pp"]) for c in (L.coords_in_order(r, sizes, ("dp", "pp")) for r in range(4))] == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    # The default is Megatron's, as coords_of always was.
    lay = JobLayout(dp_size=2, pp_size=2, tp_size=2)
    got = [L.coords_in_order(r, {"dp": 2, "pp": 2, "tp": 2}) for r in range(8)]
    assert [(c["dp"], c["pp"]) for c in got] == [coords_of(r, lay) for r in range(8)]
    assert [c["tp"] for c in got] == [0, 1] * 4
    with pytest.raises(L.LayoutError, match="leaves out tp"):
        L.coords_in_order(0, {"dp": 2, "tp": 2}, ("dp",))


# -- the claims every rank sends -------------------------------------------------------------------------------
def claim(rank, dp, pp, pipeline, speaks=True, sizes=(2, 2, 1, 1, 1), problem=""):
    return L.Claim(rank=rank, dp=dp, pp=pp, speaks=speaks, pipeline=pipeline, sizes=sizes, problem=problem)


def test_a_claim_survives_its_bytes():
    c = L.Claim(rank=3, dp=1, pp=1, speaks=True, pipeline=2, sizes=(2, 2, 4, 1, 2), sources=L.SRC_STAGE | L.SRC_MESH,
                flops=1.5e15, tokens=4096.0, params=7e9, problem="something ünusual")
    data = c.encode()
    assert len(data) == L.Claim.SIZE and L.Claim.decode(data) == c
    # With its path probe's address (ingest/path_probe.py), and a problem long enough to fill its room.
    c = dataclasses.replace(c, probe="[fd00::12]:43121", problem="x" * 1000)
    back = L.Claim.decode(c.encode())
    assert back.probe == "[fd00::12]:43121" and back.problem == "x" * len(back.problem) and len(back.problem) > 300


def test_the_issues_layout_is_two_ranks_on_one_worker():
    # op_spans gave (rank, dp, pp) = (0,0,0), (1,0,1), (2,0,0), (3,0,1): pipelines {0,1} and {2,3}.
    got = L.check_claims([claim(0, 0, 0, 0), claim(1, 0, 1, 0), claim(2, 0, 0, 2), claim(3, 0, 1, 2)], 4)
    assert "ranks 0 and 2 all claim worker dp 0, pp 0" in got
    assert "ranks 1 and 3 all claim worker dp 0, pp 1" in got
    assert "no rank speaks for workers dp 1 pp 0, dp 1 pp 1" in got
    # Read from the groups, the same job holds together.
    assert L.check_claims([claim(0, 0, 0, 0), claim(1, 0, 1, 0), claim(2, 1, 0, 2), claim(3, 1, 1, 2)], 4) == []


def test_claims_that_cannot_be_one_layout():
    tp = (2, 1, 2, 1, 1)
    ok = [claim(0, 0, 0, -1, True, tp), claim(1, 0, 0, -1, False, tp), claim(2, 1, 0, -1, True, tp),
          claim(3, 1, 0, -1, False, tp)]
    assert L.check_claims(ok, 4) == []
    assert L.check_claims(ok[:3] + [claim(3, 1, 0, -1, False, (4, 1, 1, 1, 1))], 4)[0].startswith(
        "the ranks disagree on the layout: ranks 0, 1 and 2 see dp=2 pp=1 tp=2 cp=1; rank 3 sees")
    assert "dp=2 x pp=2 x tp=1 x cp=1 is 4 ranks, but the job has 6" in L.check_claims(
        [claim(r, 0, 0, -1, r == 0) for r in range(6)], 6)
    # A pipeline whose stages sit on two DP coordinates pairs the wrong ranks.
    got = L.check_claims([claim(0, 0, 0, 0), claim(1, 1, 1, 0), claim(2, 1, 0, 2), claim(3, 0, 1, 2)], 4)
    assert got == ["the pipeline of rank 0 has stages on dp 0, 1", "the pipeline of rank 2 has stages on dp 0, 1"]
    # What every rank found on its own is said once.
    same = [claim(r, r // 2, r % 2, r - r % 2, problem="pp=3 does not divide 4") for r in range(4)]
    assert L.check_claims(same, 4) == ["pp=3 does not divide 4"]
    same[3] = claim(3, 1, 1, 2)
    assert L.check_claims(same, 4) == ["ranks 0, 1 and 2: pp=3 does not divide 4"]


# -- a rank's own settling: a session and tracer with no torch.distributed --------------------------------------
def session(rank: int, world: int, layout: str = ""):
    from ingest.autotrace.session import TraceSession, layout_order
    from ingest.autotrace.tracer import Tracer
    from ingest.exporter import RankExporter

    sess = object.__new__(TraceSession)  # what the tracer reads; no process group, producer or hooks
    sess.settings = TraceSettings(job_id="j", bootstrap="", layout=parse_layout(layout))
    sess.rank, sess.world, sess.warnings, sess.problems = rank, world, [], []
    sess.order = layout_order(sess.settings.layout)
    sess.layout = JobLayout(world, 1)
    sess.relayout()
    dp, pp, speaks = sess.order_coords(rank, quiet=True)
    sent: list = []
    sess.exporter = RankExporter("j", rank, dp, pp, sent.append, sampling=Sampling(1, 1), heartbeat_s=3600,
                                 use_cuda=False, tcp_flows=False)
    sess.exporter.worker_spans = speaks
    sess.side_group = None
    sess.tracer = Tracer(sess)
    return sess


def p2p(peer: int, send: bool, via=None):
    from ingest.torch_ccl import Call

    return Call("isend" if send else "irecv", "p2p", [0, peer], 0, 4, [peer], 0, 0, None, is_p2p=True, is_send=send,
                is_async=True, via=via)


def settle(sess):
    sess.tracer._settle_layout()
    e = sess.exporter
    e.close(1)
    return e.dp_rank, e.pp_rank, e.worker_spans


def test_a_dp_major_pipeline_is_placed_by_its_groups():
    # dp_rank, stage = divmod(rank, 2): rank 2 is stage 0 of the second pipeline {2, 3}, replicas {0, 2}.
    sess = session(2, 4)
    tr = sess.tracer
    tr.stage_info, tr.pp_ranks, tr.pp_group = (2, 0, 1), [2, 3], {2, 3}
    sess.relayout(pp=2, vpp=1)
    tr.dp_seen = [(0, 2)]
    assert settle(sess) == (1, 0, True)
    assert tr.sources == L.SRC_STAGE | L.SRC_DP_GROUP and not sess.warnings and not sess.problems
    # With no gradient reduction to read, Megatron's order is guessed, and said to be.
    sess = session(2, 4)
    sess.tracer.stage_info, sess.tracer.pp_ranks = (2, 0, 1), [2, 3]
    sess.relayout(pp=2, vpp=1)
    assert settle(sess) == (0, 0, True)
    assert "taken from Megatron's rank order" in sess.warnings[0]


def test_a_stated_rank_order_loses_to_the_groups_with_a_warning():
    sess = session(1, 4, "order=pp,dp")
    tr = sess.tracer
    tr.stage_info, tr.pp_ranks = (2, 1, 1), [0, 1]
    sess.relayout(pp=2, vpp=1)
    tr.dp_seen = [(1, 3)]
    assert settle(sess) == (0, 1, True)
    assert sess.warnings == ["--layout order=pp,dp puts rank 1 at dp 1, pp 0; the groups it uses say dp 0, pp 1 "
                             "(used)"]
    assert tr.sources & L.SRC_OVERRULED and not sess.problems


def test_megatron_transfers_name_the_pipeline_and_their_direction():
    # Megatron's order, DP 2 x PP 2: rank 1 is dp 1 of stage 0, its pipeline group {1, 3}.
    sess = session(1, 4)
    tr = sess.tracer
    assert tr._transfer_optype(p2p(3, True, via=[1, 3])) == "forward-send"
    assert tr.p2p_pipe == [1, 3] and sess.layout.pp_size == 2
    # Two stages are each other's previous and next: a receive's direction waits for its buffer's use
    # (tests/unit/test_trace_transfers.py).
    assert tr._transfer_optype(p2p(3, False)) == "recv?"
    tr.dp_seen = [(0, 1), (0, 1, 2, 3)]
    tr.inside_groups = set()
    assert settle(sess) == (1, 0, True)
    # A middle stage: the previous and the next neighbour, each way.
    mid = session(1, 3).tracer
    mid._transfer_optype(p2p(2, True, via=[0, 1, 2]))
    assert [mid._transfer_optype(p2p(peer, send)) for peer, send in ((2, True), (0, True), (0, False), (2, False))] \
        == ["forward-send", "backward-send", "forward-recv", "backward-recv"]
    # A transfer over the default group with no group the job made to place it (a ring all-reduce): not one.
    ring = session(1, 4).tracer
    assert ring._transfer_optype(p2p(2, True)) is None and ring.p2p_pipe is None
    ring.made_groups = [(0, 1), (2, 3), (1, 3), (0, 2)]
    assert ring._transfer_optype(p2p(3, False)) == "recv?" and ring.p2p_pipe == [1, 3]


def test_a_group_reduced_inside_compute_is_not_the_dp_group():
    # Tensor parallelism nobody declared: the TP pair {0, 2} is reduced inside every forward and backward.
    sess = session(0, 4)
    tr = sess.tracer
    tr.stage_info, tr.pp_ranks = (2, 0, 1), [0, 1]
    sess.relayout(pp=2, vpp=1)
    tr.dp_seen, tr.inside_groups = [(0, 2)], {(0, 2)}
    settle(sess)
    assert not tr.sources & L.SRC_DP_GROUP and tr.sources & L.SRC_GUESS


def test_a_mesh_dimension_of_any_name_that_the_pipeline_runs_over_is_the_pipeline():
    # init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "stage")): rank 2 is replica 1, stage 0.
    sess = session(2, 4)
    tr = sess.tracer
    tr.mesh_info = dict(names=("replica", "stage"), shape=(2, 2), coords=(1, 0), groups=[(0, 2), (2, 3)],
                        grid=[0, 1, 2, 3])
    tr.stage_info, tr.pp_ranks, tr.pp_group = (2, 0, 1), [2, 3], {2, 3}
    sess.relayout(pp=2, vpp=1, mesh=tr._mesh_sizes_now())
    assert tr._mesh_roles() == ["dp", "pp"] and sess.layout == JobLayout(2, 2)
    assert settle(sess) == (1, 0, True)
    assert sess.warnings == ["DeviceMesh dimension(s) replica read as data parallel"]


def test_megatron_parallel_state_is_read_where_it_is_loaded(monkeypatch):
    import torch.distributed as dist

    groups = {"pp": [1, 5], "dp": [1, 3], "tp": [0, 1], "cp": [1]}
    ps = types.SimpleNamespace(
        model_parallel_is_initialized=lambda: True, get_pipeline_model_parallel_group=lambda: "pp",
        get_pipeline_model_parallel_rank=lambda: 0, get_virtual_pipeline_model_parallel_world_size=lambda: None,
        get_data_parallel_group=lambda: "dp", get_data_parallel_rank=lambda: 0,
        get_tensor_model_parallel_group=lambda: "tp", get_context_parallel_group=lambda: "cp")
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: groups[g])
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    sess = session(1, 8)
    assert settle(sess) == (0, 0, False)  # rank 1 is the second TP rank of worker (0, 0): it sends no spans
    assert sess.layout == JobLayout(2, 2, tp_size=2) and sess.tracer.sources & L.SRC_MEGATRON
    assert sess.tracer.non_dp_groups == [frozenset({0, 1})]


def test_a_pipeline_that_does_not_divide_the_world_is_a_problem():
    sess = session(0, 4)
    sess.relayout(pp=3)
    assert sess.problems == ["layout dp=1 pp=3 tp=1 cp=1 is 3 ranks, but the job has 4"]
    assert sess.layout == JobLayout(4, 1)  # something the registration check accepts; its windows are flagged


# -- backward, however it is launched -----------------------------------------------------------------------------
def test_every_backward_the_engine_runs_is_one_span_and_changes_nothing():
    torch = pytest.importorskip("torch")
    from torch.autograd.variable import Variable
    from torch.utils.checkpoint import checkpoint

    def grads(model, how):
        torch.manual_seed(0)
        x = torch.randn(4, 3, requires_grad=how == "checkpoint")
        if how == "checkpoint":  # reentrant: the recomputation's backward runs inside the outer one
            out = checkpoint(model, x, use_reentrant=True).sum()
        else:
            out = model(x).sum()
        if how in ("tensor", "checkpoint"):
            out.backward()
        elif how == "autograd":
            torch.autograd.backward([out])
        elif how == "engine":  # Megatron's custom_backward
            Variable._execution_engine.run_backward(tensors=(out,), grad_tensors=(torch.ones_like(out),),
                                                    keep_graph=False, create_graph=False, inputs=tuple(),
                                                    allow_unreachable=True, accumulate_grad=True)
        else:
            return [g.clone() for g in torch.autograd.grad(out, list(model.parameters()))]
        return [p.grad.clone() for p in model.parameters()]

    hows = ("tensor", "autograd", "engine", "grad", "checkpoint")
    bare = {}
    for how in hows:
        torch.manual_seed(1)
        bare[how] = grads(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()), how)
    sess = session(0, 1)
    tr = sess.tracer
    tr.install()
    try:
        for how in hows:
            torch.manual_seed(1)
            tr.bwd_in_step = 0
            got = grads(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()), how)
            assert all(torch.equal(a, b) for a, b in zip(got, bare[how])), how
            assert tr.bwd_in_step == 1, how  # one span: neither missed nor nested twice
            tr._close_step()
        assert Variable._execution_engine.queue_callback  # the rest of the engine is there
    finally:
        tr.close()
        sess.exporter.close(1)
    assert type(Variable.__dict__["_execution_engine"]).__name__ != "_EngineProxy"  # undone


def test_tokens_are_ids_or_rows():
    torch = pytest.importorskip("torch")
    from ingest.autotrace.tracer import _tokens

    assert _tokens((torch.zeros(4, 128, dtype=torch.long),)) == 512
    assert _tokens([{"x": torch.zeros(4, 128, 64)}]) == 512
    assert _tokens(torch.zeros(16, 64)) == 16 and _tokens("text") == 0


# -- the stored verdict -------------------------------------------------------------------------------------------
def ops_table(rows):
    from core import codec
    from core import schema as S

    base = dict(job_id="j", attempt=0, window_id=0, step=0, optype="forward-compute", start_ns=1, duration_ns=1,
                seq_id=0, mc=0, gmc=0, mb_id=0)
    return codec.from_rows(S.OP_SPAN, [dict(base, rank=r, dp_rank=d, pp_rank=p) for r, d, p in rows])


def test_a_conflicting_layout_is_a_verdict_not_a_dependency_cycle():
    from core.registration import Registration
    from analyzers.window import analyze_window, layout_conflict

    info = Registration("j", 0, JobLayout(2, 2), 1, n_gpus=4, registration={"layout_problem": ""})
    assert layout_conflict(info, ops_table([(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)])) == ""
    assert layout_conflict(info, ops_table([(-1, 0, 0), (-1, 0, 0)])) == ""  # replays name no rank
    ops = ops_table([(0, 0, 0), (1, 0, 1), (2, 0, 0), (3, 0, 1)])
    assert layout_conflict(info, ops) == "ranks 0, 2 all sent op spans as worker dp 0, pp 0 (and 1 more worker)"
    info.registration = {"layout_problem": "ranks 0 and 2 all claim worker dp 0, pp 0"}
    row = analyze_window(ops, info, ("j", 0, 0), True, "")["window"].to_pylist()[0]
    assert row["verdict"] == "layout_conflict" and not row["complete"] and math.isnan(row["slowdown"])
    assert row["note"].startswith("layout conflict: ranks 0 and 2 all claim worker dp 0, pp 0; window not analysed")


def test_peak_flops_by_device_name():
    from analyzers.mfu import peak_flops

    assert [peak_flops({"gpu_type": n}) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                                                  "NVIDIA B200", "NVIDIA L40S", "NVIDIA A10G", "cpu")] == \
        [989e12, 756e12, 989e12, 2.25e15, 362e12, 0.0, 0.0]
