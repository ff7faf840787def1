"""Small synthetic traces for the what-if tests: what ``generators.fleetgen`` does not make.

``vpp_window`` builds an interleaved (VPP) pipeline job with a GPipe-style
order per stage (all forwards chunk by chunk, then all backwards in reverse
chunk order), so chunk boundaries wrap from the last stage to stage 0. Start
times come from an event schedule obeying the same rules as a real job (a
recv ends when both peers are in and the bytes moved, streams are
sequential). ``with_noop_sends`` adds the no-op sends Megatron records for the
last chunk. ``overlap_dp`` turns a fleetgen trace into an overlapped-DP job
(reduce-scatter right after the backward pass, ``separate-grads-all-reduce``
in the post-compute chain).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from core.layout import JobLayout
from core.schema import OP_SPAN

MS = 1_000_000
GAP = 20_000


def _table(rows: list[dict], job_id: str, window_id: int, layout: JobLayout) -> pa.Table:
    df = pd.DataFrame(rows)
    n = len(df)
    df["job_id"] = job_id
    df["attempt"] = 0
    df["window_id"] = window_id
    df["rank"] = (df["pp_rank"] * layout.dp_size + df["dp_rank"]).astype(np.int32)
    df = df.sort_values(["pp_rank", "dp_rank", "start_ns"], kind="stable").reset_index(drop=True)
    assert len(df) == n
    return pa.Table.from_pandas(df[[f.name for f in OP_SPAN]], schema=OP_SPAN, preserve_index=False)


def vpp_window(dp: int = 2, pp: int = 2, vpp: int = 2, m: int = 4, n_steps: int = 2, *, fwd_ms: float = 10.0,
               bwd_ms: float = 20.0, p2p_ms: float = 0.5, noise: float = 0.0, seed: int = 0,
               window_id: int = 0, t0: int = 10**12) -> tuple[pa.Table, JobLayout]:
    lay = JobLayout(dp_size=dp, pp_size=pp, vpp_size=vpp)
    rng = np.random.default_rng(seed)
    V = vpp * pp
    rows: list[dict] = []
    seqs: dict = {}

    def add(s, d, step, optype, st, en, mc=-1, gmc=-1, mb=-1):
        k = (s, d, step, optype)
        rows.append({"dp_rank": d, "pp_rank": s, "step": step, "optype": optype, "start_ns": int(st), "duration_ns": int(en - st),
                         "seq_id": seqs.get(k, 0), "mc": mc, "gmc": gmc, "mb_id": mb})
        seqs[k] = seqs.get(k, 0) + 1

    t = t0
    for k in range(n_steps):
        step = window_id + k
        c_free = np.zeros((pp, dp))
        for s in range(pp):
            for mc in range(vpp):
                st = t + (mc * 100_000)
                en = t + vpp * 100_000 + 2 * MS
                for d in range(dp):
                    add(s, d, step, "params-all-gather", st, en, mc=mc)
            c_free[s] = t + vpp * 100_000 + 2 * MS
        orders = [[("F", mc, i) for mc in range(vpp) for i in range(m)]
                  + [("B", mc, i) for mc in reversed(range(vpp)) for i in range(m)] for _ in range(pp)]
        pos = [0] * pp
        fend: dict = {}
        bend: dict = {}
        free = {key: np.zeros(dp) for key in [(s, x) for s in range(pp) for x in ("fr", "fs", "br", "bs")]}
        left = sum(len(o) for o in orders)
        while left:
            moved = False
            for s in range(pp):
                while pos[s] < len(orders[s]):
                    kind, mc, i = orders[s][pos[s]]
                    g = mc * pp + s
                    peer_g = g - 1 if kind == "F" else g + 1
                    has_peer = 0 <= peer_g < V
                    done = fend if kind == "F" else bend
                    if has_peer and (peer_g, i) not in done:
                        break
                    ready = c_free[s] + GAP
                    if has_peer:
                        ps = peer_g % pp
                        rk, sk = ("fr", "fs") if kind == "F" else ("br", "bs")
                        send_st = np.maximum(done[(peer_g, i)] + GAP, free[(ps, sk)])
                        recv_st = np.maximum(ready, free[(s, rk)])
                        en = np.maximum(send_st, recv_st) + int(p2p_ms * MS)
                        free[(ps, sk)] = en
                        free[(s, rk)] = en
                        for d in range(dp):
                            add(s, d, step, "forward-recv" if kind == "F" else "backward-recv", recv_st[d], en[d])
                            add(ps, d, step, "forward-send" if kind == "F" else "backward-send", send_st[d], en[d])
                        ready = en + GAP
                    base = fwd_ms if kind == "F" else bwd_ms
                    dur = (base * MS * rng.normal(1.0, noise, dp).clip(0.5, 1.5)).astype(np.int64) if noise \
                        else np.full(dp, int(base * MS))
                    en = ready + dur
                    for d in range(dp):
                        add(s, d, step, "forward-compute" if kind == "F" else "backward-compute", ready[d], en[d],
                            mc=mc, gmc=g, mb=i)
                    (fend if kind == "F" else bend)[(g, i)] = en
                    c_free[s] = en
                    pos[s] += 1
                    left -= 1
                    moved = True
            assert moved, "schedule stuck"
        chain = np.zeros((pp, dp))
        for s in range(pp):
            st = c_free[s] + GAP
            for d in range(dp):
                add(s, d, step, "gc", st[d], st[d], mb=0)
                add(s, d, step, "layernorm-grads-all-reduce", st[d] + GAP, st[d] + GAP + 50_000)
            chain[s] = st + 2 * GAP + 50_000
        if pp > 1:
            en = np.maximum(chain[0], chain[pp - 1]) + MS
            for s in (0, pp - 1):
                for d in range(dp):
                    add(s, d, step, "embedding-grads-all-reduce", chain[s][d], en[d])
                chain[s] = en + GAP
        for s in range(pp):
            for mc in range(vpp):
                en = chain[s].max() + 3 * MS
                for d in range(dp):
                    add(s, d, step, "grads-reduce-scatter", chain[s][d], en, mc=mc)
                chain[s] = np.full(dp, en + GAP)
        clip = chain.max() + 200_000
        for s in range(pp):
            for d in range(dp):
                add(s, d, step, "optimizer-clip-main-grad", chain[s][d], clip)
                add(s, d, step, "optimizer", clip + GAP, clip + GAP + 2 * MS)
        t = int(clip + 5 * MS)
    return _table(rows, "vpp-job", window_id, lay), lay


def with_noop_sends(table: pa.Table, layout: JobLayout) -> pa.Table:
    """Add the recorded no-op sends of the last chunk: one forward-send per last-chunk forward."""
    df = table.to_pandas()
    last = layout.vpp_size * layout.pp_size - 1
    f = df[(df.optype == "forward-compute") & (df.gmc == last)].copy()
    noop = f.assign(optype="forward-send", start_ns=f.start_ns + f.duration_ns + 1000, duration_ns=1000,
                    mc=-1, gmc=-1, mb_id=-1)
    out = pd.concat([df, noop], ignore_index=True)
    out["seq_id"] = out.sort_values("start_ns").groupby(["dp_rank", "pp_rank", "step", "optype"]).cumcount()
    return pa.Table.from_pandas(out, schema=OP_SPAN, preserve_index=False)


def overlap_dp(table: pa.Table) -> pa.Table:
    """Overlapped DP: the reduce-scatter becomes a separate all-reduce in the chain, and a new
    reduce-scatter runs right after each worker's last backward (a DP collective)."""
    df = table.to_pandas()
    df.loc[df.optype == "grads-reduce-scatter", "optype"] = "separate-grads-all-reduce"
    b = df[df.optype == "backward-compute"]
    last_b = b.loc[b.groupby(["step", "dp_rank", "pp_rank"]).start_ns.idxmax()]
    rs = last_b.assign(optype="grads-reduce-scatter", start_ns=last_b.start_ns + last_b.duration_ns + GAP,
                       seq_id=0, mc=0, gmc=-1, mb_id=-1)
    grp_start = rs.groupby(["step", "pp_rank"]).start_ns.transform("max")
    rs["duration_ns"] = grp_start + 300_000 - rs.start_ns
    out = pd.concat([df, rs], ignore_index=True)
    return pa.Table.from_pandas(out, schema=OP_SPAN, preserve_index=False)
