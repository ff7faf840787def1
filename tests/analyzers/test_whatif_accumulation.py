"""Data-parallel jobs that accumulate gradients over microbatches, as the automatic tracer records them.

A forward or backward that blocked in a DP collective is recorded with that wait split off as its own
op, carrying the compute's microbatch: a ``params-all-gather`` before it (FSDP's all-gathers, in the
forward and, with ``reshard_after_forward``, in the backward too), a ``grads-reduce-scatter`` after it
(where gradients are synced: the last microbatch under ``set_requires_gradient_sync(False)`` or
``no_sync``). The windows here are built from an event schedule that obeys the job's rules (a collective
ends once every DP rank is in, plus its transfer), so the slowdown the model must find is known: the
same schedule with every rank at the mean durations is the ideal.

The FSDP2 job of issue 55 failed on a dependency cycle (every wait after a backward was put after the
whole backward pass, and the all-gather before the next forward after it on the DP stream), and a DDP
backward's reduction placed before the step's gc gave a negative launch delay on every rank that waited.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from analyzers.whatif import analyze
from core.layout import JobLayout
from core.schema import OP_SPAN

MS = 1_000_000


def accumulation_window(dp: int = 4, m: int = 4, steps: int = 3, *, fwd_ms=(40.0,), bwd_ms=(80.0,),
                        gather_fwd: bool = True, gather_bwd: bool = True, sync_every: bool = False,
                        xfer_ms: float = 2.0, clip: bool = True, drop_idle_waits: bool = False,
                        t0: int = 10**12) -> tuple[pa.Table, JobLayout, float]:
    """(op spans, layout, mean actual step time in ns) of a DP job with ``m`` microbatches per step.

    ``fwd_ms`` / ``bwd_ms``: each rank's compute durations (cycled over the ranks). ``gather_fwd`` /
    ``gather_bwd``: an all-gather wait before every forward / backward; ``sync_every``: a reduce-scatter
    after every backward, else after the last one only. ``clip``: a gradient-norm all-reduce outside
    compute before the optimizer (recorded without a microbatch). ``drop_idle_waits``: the last rank into
    a collective records no wait where it did not wait at all (a tracer records only waits it saw)."""
    lay = JobLayout(dp_size=dp, pp_size=1)
    fwd = [fwd_ms[d % len(fwd_ms)] * MS for d in range(dp)]
    bwd = [bwd_ms[d % len(bwd_ms)] * MS for d in range(dp)]
    xfer = int(xfer_ms * MS)
    rows: list[dict] = []
    seqs: dict = {}

    def add(d, step, optype, st, en, mb=-1):
        k = (d, step, optype)
        rows.append({"dp_rank": d, "pp_rank": 0, "step": step, "optype": optype, "start_ns": int(st),
                     "duration_ns": int(en - st), "seq_id": seqs.get(k, 0), "mc": 0, "gmc": 0, "mb_id": mb})
        seqs[k] = seqs.get(k, 0) + 1

    def collective(optype, at, step, mb):
        """Every rank enters at ``at[d]``; all leave at the last entry plus the transfer."""
        end = max(at) + xfer
        for d in range(dp):
            if not (drop_idle_waits and at[d] == max(at) and mb >= 0):
                add(d, step, optype, at[d], end, mb)
        return [end] * dp

    t = t0
    times = []
    for step in range(steps):
        now = [t] * dp
        for k in range(m):
            if gather_fwd:
                now = collective("params-all-gather", now, step, k)
            for d in range(dp):
                add(d, step, "forward-compute", now[d], now[d] + fwd[d], k)
                now[d] += fwd[d]
            if gather_bwd:
                now = collective("params-all-gather", now, step, k)
            for d in range(dp):
                add(d, step, "backward-compute", now[d], now[d] + bwd[d], k)
                now[d] += bwd[d]
            if sync_every or k == m - 1:
                now = collective("grads-reduce-scatter", now, step, k)
        for d in range(dp):
            add(d, step, "gc", now[d], now[d])
        if clip:
            now = collective("grads-reduce-scatter", now, step, -1)
        for d in range(dp):
            add(d, step, "optimizer", now[d], now[d] + 5 * MS)
        end = max(now) + 5 * MS
        times.append(end - t)
        t = end + 3 * MS
    df = pd.DataFrame(rows)
    df["job_id"], df["attempt"], df["window_id"], df["rank"] = "accum", 0, 0, df["dp_rank"].astype(np.int32)
    table = pa.Table.from_pandas(df[[f.name for f in OP_SPAN]], schema=OP_SPAN, preserve_index=False)
    return table, lay, float(np.mean(times))


CASES = {
    # FSDP2, reshard_after_forward=True: all-gathers before every forward and backward, sync on the last
    "fsdp-reshard": dict(gather_fwd=True, gather_bwd=True),
    # reshard_after_forward=False: the backward finds its parameters gathered
    "fsdp-keep": dict(gather_fwd=True, gather_bwd=False),
    # FSDP2 without set_requires_gradient_sync: a reduce-scatter after every backward
    "fsdp-sync-every": dict(gather_fwd=True, gather_bwd=True, sync_every=True),
    # DDP with no_sync on all but the last microbatch: its backward's reduction only
    "ddp-no-sync": dict(gather_fwd=False, gather_bwd=False, clip=False),
    "ddp-one-microbatch": dict(gather_fwd=False, gather_bwd=False, clip=False, m=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_accumulating_dp_job_is_analysed_and_its_slow_rank_found(case):
    kw = dict(CASES[case])
    slow = dict(fwd_ms=(72.0, 40.0, 40.0, 40.0), bwd_ms=(112.0, 80.0, 80.0, 80.0))
    table, lay, actual = accumulation_window(**kw, **slow)
    _, _, ideal = accumulation_window(**kw, fwd_ms=(48.0,), bwd_ms=(88.0,))  # every rank at the mean
    res = analyze(table, lay)
    assert res.warnings == [], res.warnings  # no launch delay clamped, no unpaired or no-op transfer
    assert res.replay_error < 1e-6
    assert res.launch_slowdown == pytest.approx(1.0, abs=1e-9)
    assert res.slowdown == pytest.approx(actual / ideal, rel=1e-6)
    assert res.by_dp_rank[0] == max(res.by_dp_rank.values()) > 1.1


def test_a_wait_only_one_rank_recorded_leaves_the_other_groups_in_line():
    """Rank 2 recorded a wait before one backward where its peers recorded none (a gather of its own that
    found its data there): a group of its own. The all-gathers after it still group with their peers' (by
    their place among the compute ops, not by their count): the window is analysed as without it, but for
    the nil transfers its lone waits add to the all-gathers' median."""
    slow = dict(fwd_ms=(72.0, 40.0, 40.0, 40.0), bwd_ms=(112.0, 80.0, 80.0, 80.0))
    table, lay, actual = accumulation_window(gather_bwd=False, **slow)
    base = analyze(table, lay)
    df = table.to_pandas()
    extra = []
    for step in sorted(df.step.unique()):
        b1 = df[(df.step == step) & (df.dp_rank == 2) & (df.optype == "backward-compute") & (df.mb_id == 1)].iloc[0]
        extra.append(dict(b1, optype="params-all-gather", duration_ns=0, seq_id=99))
    more = pa.Table.from_pandas(pd.concat([df, pd.DataFrame(extra)], ignore_index=True), schema=OP_SPAN,
                                preserve_index=False)
    res = analyze(more, lay)
    assert res.replay_error < 1e-6
    assert res.slowdown == pytest.approx(base.slowdown, rel=0.005)
    assert res.by_dp_rank == pytest.approx(base.by_dp_rank, rel=0.005)


def test_steps_whose_waits_follow_other_compute_ops_get_a_graph_each():
    """The template graph of a regular window serves every step only where each wait follows the same compute
    op in every step: a step whose reduce-scatter moved is simulated with a graph of its own."""
    from analyzers.whatif.load import prepare_ops
    from analyzers.whatif.scenarios import _regular

    table, lay, _ = accumulation_window(steps=2, sync_every=True)
    assert _regular(prepare_ops(table, lay))
    df = table.to_pandas()
    # In step 1 of rank 0, the first microbatch's reduce-scatter becomes a wait before its forward's
    # all-gather instead (same op types and count per stream, another place among the compute ops).
    rs = df.index[(df.step == 1) & (df.dp_rank == 0) & (df.optype == "grads-reduce-scatter") & (df.mb_id == 0)][0]
    f0 = df[(df.step == 1) & (df.dp_rank == 0) & (df.optype == "forward-compute") & (df.mb_id == 0)].iloc[0]
    df.loc[rs, "start_ns"] = f0.start_ns - 10
    df.loc[rs, "duration_ns"] = 5
    moved = pa.Table.from_pandas(df, schema=OP_SPAN, preserve_index=False)
    assert not _regular(prepare_ops(moved, lay))
    analyze(moved, lay)  # and it is analysed, without a cycle
