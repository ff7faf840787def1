"""The kernel's view of each transfer: directed flows between ranks from their TCP connections' counters.

Every rank reports its TCP connections over each profiled step
(``core.schema.TCP_FLOW``, read by ``ingest/tcp_flows.py``): its own end and
the other end of each, what it sent that was acknowledged, how long data was
in flight, the RTT. A connection's two ends are two records, one per rank,
with the same endpoints swapped: that pairs them, and names the ranks of a
transfer without any table of addresses. What a rank sent on a connection is
the flow src -> dst.

``flows(table)`` aggregates a window's records into ``Flow``s. What they say,
measured on real gloo traffic through namespaces shaped with ``tc``
(BENCHMARKS.md, "Link diagnosis on real faults"):

- A collective or a pipeline waits for its slowest transfer, so the flow
  through a slow element is **busy** (data in flight) nearly all the time at
  a low rate, while the others are idle most of the time, waiting for it.
  ``busy_fraction`` and ``rate`` (bytes per busy second) find it in every job,
  flat data-parallel rings included, which enter and exit times cannot (every
  rank waits in the same all-reduce).
- Where its queue is tells what is slow. A slow receiver (its ingress) holds
  the data in the network: the flow's RTT grows many times over the job's
  other flows', and, since TCP acknowledges through the same ingress, the RTT
  of what that receiver sends grows too. A slow sender (its NIC egress, or a
  link shaped at it) holds the data in its own queue, which TCP keeps short:
  the RTT barely moves and unsent bytes pile up. Its NIC and one of its links
  look alike unless it sends to another peer as well (a pipeline, a
  bidirectional ring): a flat ring cannot tell them apart.

``analyzers/links/localise.py`` turns flows into findings with the job's other
evidence; this module only measures.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analyzers.links.fault import element_name, finding_of


@dataclasses.dataclass(frozen=True)
class Flow:
    """What ``src`` sent to ``dst`` over a window, summed over their connections and the window's steps."""
    src: int
    dst: int
    bytes: int
    busy_s: float          # time with data in flight (the busiest connection of the pair, step by step)
    elapsed_s: float       # time the readings cover
    rtt_us: float          # median over the steps of the smoothed RTT, weighted by bytes
    min_rtt_us: float
    notsent_bytes: int     # most unsent data seen at a step's end
    sndbuf_s: float        # busy time limited by the sender's buffer
    rwnd_s: float          # busy time limited by the receiver's window
    retrans: int
    steps: int

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.elapsed_s if self.elapsed_s > 0 else math.nan

    @property
    def rate(self) -> float:
        """Bytes per second while data was in flight: what the path delivered when it was used."""
        return self.bytes / self.busy_s if self.busy_s > 0 else math.nan

    def evidence(self) -> dict:
        return {"flow": f"{self.src}>{self.dst}", "mb": round(self.bytes / 1e6, 3),
                "busy": round(self.busy_fraction, 3), "mb_per_s_busy": round(self.rate / 1e6, 3),
                "rtt_ms": round(self.rtt_us / 1e3, 3), "notsent_kb": round(self.notsent_bytes / 1e3, 1),
                "retrans": self.retrans}


def _owners(local: list[str], rank: np.ndarray) -> dict[str, int]:
    """Endpoint -> the rank whose connection it is the local end of (an endpoint two ranks claim: neither)."""
    out: dict[str, int] = {}
    clash: set[str] = set()
    for ep, r in zip(local, rank.tolist()):
        if out.setdefault(ep, r) != r:
            clash.add(ep)
    for ep in clash:
        del out[ep]
    return out


def flows(table: pa.Table, min_bytes: int = 64 << 10, probe: bool = False) -> list[Flow]:
    """Directed flows between ranks of one window's TCP_FLOW records; connections to anything but a rank of
    the window (the Kafka broker, a store, a rendezvous server outside the job) are left out, and so are
    flows that moved less than ``min_bytes`` (their rate says nothing). ``probe``: the path probes' flows
    (``ingest/path_probe.py``) instead of the job's own."""
    if table is None or table.num_rows == 0:
        return []
    if "probe" in table.column_names:
        marked = table["probe"].fill_null(False)
        table = table.filter(marked if probe else pc.invert(marked))
    elif probe:
        return []
    if table.num_rows == 0:
        return []
    rank = table["rank"].to_numpy()
    local = table["local"].to_pylist()
    remote = table["remote"].to_pylist()
    owner = _owners(local, rank)
    cols = {c: table[c].to_numpy() for c in ("step", "elapsed_ns", "bytes_acked", "busy_us", "rtt_us",
                                             "min_rtt_us", "notsent_bytes", "sndbuf_limited_us",
                                             "rwnd_limited_us", "retrans")}
    # (src, dst) -> step -> [bytes, busy_us (max over the pair's connections), elapsed_ns, rtt*bytes, ...]
    acc: dict[tuple[int, int], dict[int, list]] = {}
    for i, (src, rem) in enumerate(zip(rank.tolist(), remote)):
        dst = owner.get(rem)
        sent = int(cols["bytes_acked"][i])
        if dst is None or dst == src or sent <= 0:
            continue
        per_step = acc.setdefault((src, dst), {})
        s = per_step.setdefault(int(cols["step"][i]), [0, 0, 0, 0.0, math.inf, 0, 0, 0, 0])
        s[0] += sent
        s[1] = max(s[1], int(cols["busy_us"][i]))
        s[2] = max(s[2], int(cols["elapsed_ns"][i]))
        s[3] += float(cols["rtt_us"][i]) * sent
        s[4] = min(s[4], float(cols["min_rtt_us"][i]))
        s[5] = max(s[5], int(cols["notsent_bytes"][i]))
        s[6] += int(cols["sndbuf_limited_us"][i])
        s[7] += int(cols["rwnd_limited_us"][i])
        s[8] += int(cols["retrans"][i])
    out = []
    for (src, dst), per_step in sorted(acc.items()):
        v = np.array([s[:4] + s[5:] for s in per_step.values()], dtype=np.float64)
        total = int(v[:, 0].sum())
        if total < min_bytes:
            continue
        rtts = v[:, 3] / np.maximum(v[:, 0], 1)
        order = np.argsort(rtts)
        cum = np.cumsum(v[order, 0])
        rtt = float(rtts[order][np.searchsorted(cum, cum[-1] / 2)])  # byte-weighted median
        min_rtt = min(s[4] for s in per_step.values())
        out.append(Flow(src, dst, total, float(v[:, 1].sum()) / 1e6, float(v[:, 2].sum()) / 1e9, rtt,
                        min_rtt if min_rtt < math.inf else math.nan, int(v[:, 4].max()),
                        float(v[:, 5].sum()) / 1e6, float(v[:, 6].sum()) / 1e6, int(v[:, 7].sum()), len(per_step)))
    return out


@dataclasses.dataclass(frozen=True)
class TcpParams:
    """When the flows of a window name a slow element. Defaults and why: BENCHMARKS.md, "Link diagnosis on real
    faults" (gloo rings and pipelines in namespaces, one element shaped to 40 mbit, and healthy controls)."""
    bottleneck_busy: float = 0.25
    """A flow with data in flight at least this share of the window (a pipeline's transfers and its gradient
    all-reduce take turns: the slow one is busy in its phases only) ..."""
    busy_over_median: float = 1.8
    """... and this many times the median flow's share holds the others up (in a healthy ring all are alike) ..."""
    slow_rate: float = 0.5
    """... while delivering under this share of the median flow's rate when busy: its path is slow."""
    healthy_rate: float = 0.7
    """A flow at this share of the median rate or more clears the elements it crosses."""
    rtt_queue: float = 3.0
    """A flow whose RTT is this many times the job's reference queued in the network: a slow receiver ..."""
    queue_bytes: float = 8_000
    """... where that queue holds at least this much at the bottleneck's rate. A sender's own slow NIC queues
    little at home (the kernel's TCP small queues keep about two packets of a flow in the device queue): its
    RTT rose too, 3.4-4x the reference at 20mbit, by 2-4 KB at its rate; a slow receiver's queue, filled by
    the senders' whole windows, held 13-53 KB (tests/netfaults, flat and bidirectional rings, 20 and 40mbit).
    With the ratio alone a 20mbit NIC was once named its rank's receiver (0.80). Calibrated on a fabric that
    sends wire-size packets (tests/netfaults/fabric.py, no segmentation offload); with TSO a sender may keep
    up to two 64 KB segments at home, and this would have to scale with them (not measured)."""
    coupled_rate: float = 2.0
    """Of the slow flows, those over this many times the slowest one's rate ...
    (measured: the slowest run at the fault's rate, the ones waiting for them in the same ring 2.4-3x it)"""
    bottleneck_most: float = 0.5
    """... and the busiest of the slow flows busy at least this share of the time: a throttled path is busy
    nearly always (0.66-0.99 in every measured fault of tests/diagnosis/data), a healthy one waits."""
    receiver_bound: float = 0.5
    """A flow busy this share of its time or more limited by the receiver's window waited for the receiving
    process to read, not for the network (a healthy pipeline's p2p flows while the next stage computes)."""
    coupled_busy: float = 0.3
    """... or busy under this share of the busiest one's time are held back by the bottleneck, not through it."""
    probe_as_slow: float = 1.5
    """A sender whose path probe (``ingest/path_probe.py``: another peer, the same NIC) ran at no more than this
    many times its bottleneck's rate has the slow NIC. Faster by ``sender_elsewhere`` or more, the probe clears
    its whole path, the sender's NIC included. Measured on the flat ring at 20mbit: the probe of a slow NIC's
    rank 2.2 MB/s against the bottleneck's 2.3; with link 5>4 slow instead, rank 5's probe 24.9 MB/s (10.8x),
    and healthy probes 25-200 MB/s (a 262 KB burst on 2 shared cores: scheduling and slow start, so the probes
    are not compared with each other's median)."""
    probe_clears_nic: float = 1.8
    """A sender whose path probe ran at this many times its bottleneck's rate or more has a NIC with room to
    spare: its one link is named. Through a capped NIC the probe can go no faster than the bottleneck, which
    already fills it (measured 0.96-1.02x at 20 and 40mbit, 4 runs); with the link capped instead it went
    2.1-10.8x, and 2.1x was left "NIC, or the link" under ``sender_elsewhere`` (a flat ring's link 5>4 at
    40mbit, window 6 of one run in 3)."""
    held_up_rate: float = 1.3
    """A slow flow at this many times the slowest one's rate or more may be held up by it, not throttled itself (a
    flat ring's link 5>4 at 40mbit: 5>4 at 2.7 MB/s, its upstream 6>5 at 4.8, 1.8x). Slow flows that run alike
    are throttled alike (rank 6's ingress at 40mbit: 6>5 and 7>6 at 4.66 and 4.71 MB/s)."""
    data_tie: float = 0.85
    """Candidates within this share of the best one's slowdown on the data path are a tie, for the RTT to break."""
    sender_elsewhere: float = 3.0
    """A sender whose flow to another peer delivered this many times the bottleneck's rate is not held up by
    its NIC: its link is named. Measured: a bidirectional ring with link 3>4 at 20mbit, 3>2 at 12x the
    bottleneck's rate though under the healthy share of the job's median (0.57), so not cleared: the NIC
    was named at 0.50 in 1 of 3 runs. A NIC shared by two flows gives both about its rate."""


@dataclasses.dataclass(frozen=True)
class FlowVerdict:
    """A flow's place in the window: the bottleneck, a healthy flow, or neither (slowed by the bottleneck's
    back-pressure, or idle too much to say)."""
    flow: Flow
    status: str            # slow | ok | unknown
    ratio: float           # the reference rate over this flow's rate (1: typical, 10: ten times slower)


def judge_flows(fl: list[Flow], params: TcpParams = TcpParams()) -> list[FlowVerdict]:
    """Each flow against the job's own others (no fixed floor: a healthy job's flows are alike)."""
    if len(fl) < 2:
        return [FlowVerdict(f, "unknown", math.nan) for f in fl]
    busy = np.array([f.busy_fraction for f in fl])
    rate = np.array([f.rate for f in fl])
    med_busy = float(np.nanmedian(busy))
    med_rate = float(np.nanmedian(rate))
    out = []
    for i, f in enumerate(fl):
        others = float(np.nanmedian(np.delete(rate, i)))
        ratio = others / f.rate if f.rate > 0 else math.nan
        if f.busy_s > 0 and f.rwnd_s >= params.receiver_bound * f.busy_s:
            # Busy because the receiving process did not read (its compute; a pipeline stage sends
            # activations ahead of the next stage's recv): the receiver's window, not the network.
            status = "unknown"
        elif (f.busy_fraction >= params.bottleneck_busy and f.busy_fraction >= params.busy_over_median * med_busy
                and f.rate <= params.slow_rate * others):
            status = "slow"
        elif f.rate >= params.healthy_rate * med_rate:
            status = "ok"
        else:
            status = "unknown"
        out.append(FlowVerdict(f, status, ratio))
    slow = [v.flow for v in out if v.status == "slow"]
    if slow and max(f.busy_fraction for f in slow) < params.bottleneck_most:
        # No flow was busy most of the time: nothing throttles the window's traffic (a healthy pipeline's
        # p2p flow, busy a third of the step while the next stage computes, named "link 0>2" at 0.99).
        out = [dataclasses.replace(v, status="unknown") if v.status == "slow" else v for v in out]
        slow = []
    # A synchronous job's flows wait for one another: those behind the bottleneck slow down too (busy less,
    # at a few times its rate). They are neither the fault nor healthy.
    if len(slow) > 1:
        slowest = min(f.rate for f in slow)
        busiest = max(f.busy_fraction for f in slow)
        out = [dataclasses.replace(v, status="unknown") if v.status == "slow" and (
            v.flow.rate > params.coupled_rate * slowest or v.flow.busy_fraction < params.coupled_busy * busiest)
            else v for v in out]
    return out


def carries(f: Flow, element: tuple) -> bool:
    """Whether ``f``'s data crosses ``element`` (``fault.element_of``)."""
    return element in _data_path(f)


def _data_path(f: Flow) -> set[tuple]:
    """What f's data crosses: the sender's egress, the link, the receiver's ingress."""
    return {("egress", f.src), ("ingress", f.dst), ("link", f.src, f.dst)}


def _ack_path(f: Flow) -> set[tuple]:
    """What f's acknowledgements cross, the other way: a slow element there slows f too (TCP's coupling)."""
    return {("egress", f.dst), ("ingress", f.src), ("link", f.dst, f.src)}


def _ref_rtt(fl: list[Flow], around: set[int]) -> float:
    """The RTT of the window's flows that touch none of ``around`` (all flows where every one does)."""
    far = [f.rtt_us for f in fl if f.src not in around and f.dst not in around]
    return float(np.median(far or [f.rtt_us for f in fl]))


def _queued_bytes(rtt_us: float, ref_us: float, rate: float) -> float:
    """What a queue that added ``rtt_us - ref_us`` to the RTT held, drained at ``rate`` bytes per second."""
    return max(rtt_us - ref_us, 0.0) / 1e6 * rate if rate == rate else math.nan


def _healthy_ratio(f: Flow, verdicts: list[FlowVerdict]) -> float:
    """How many times slower ``f`` delivered than the window's healthy flows (their median rate while busy): what
    the confidence in its bottleneck rests on. Not the median of every other flow, as the verdict's ``ratio``:
    in a synchronous job the flows behind the bottleneck slow with it (a flat ring's three downstream of a 20mbit
    ingress ran at 2-4x its rate while the rest ran at 14-30x), and they would halve the measured slowdown of
    an obvious fault. Without a healthy flow, the verdict's ratio."""
    healthy = [v.flow.rate for v in verdicts if v.status == "ok" and v.flow.rate == v.flow.rate]
    if not healthy or not f.rate > 0:
        return next((v.ratio for v in verdicts if v.flow is f), math.nan)
    return max(float(np.median(healthy)) / f.rate, 1.0)


def receiver_queued(fl: list[Flow], src: int, dst: int, params: TcpParams = TcpParams()) -> dict | None:
    """Evidence that ``dst``'s ingress, not the link ``src``>``dst``, holds a transfer up: another rank's flow
    into ``dst`` queued in the network (its RTT ``rtt_queue`` times the reference of the flows that touch
    neither end, holding ``queue_bytes`` or more at its rate), as a slow receiver's queue fills with every
    sender's window; None where none did. A slow link queues only its own flow.

    Why: in a pipeline the transfer into a stage waits on the stage's compute, so its flow is never judged
    slow, and enter and exit times alone named a capped ingress the link from the previous stage (2 of 4
    DP2 x PP2 runs at 40mbit, window 0 or 6). The gradient all-reduce peer's flow into that rank told them
    apart: 23-90 ms of RTT (15-60x its reference, 100-170 KB queued) with the ingress capped, 0.3-2 ms with
    the link capped (tests/diagnosis/data/pp4net_*)."""
    ref = _ref_rtt(fl, {src, dst})
    best = None
    for g in fl:
        if g.dst != dst or g.src == src or not ref > 0:
            continue
        held = _queued_bytes(g.rtt_us, ref, g.rate)
        if g.rtt_us >= params.rtt_queue * ref and held >= params.queue_bytes and (best is None or held > best[1]):
            best = (g, held)
    if best is None:
        return None
    g, held = best
    return {"flow": f"{g.src}>{g.dst}", "rtt_ms": round(g.rtt_us / 1e3, 3), "reference_ms": round(ref / 1e3, 3),
            "queued_kb": round(held / 1e3, 1)}


def where(verdicts: list[FlowVerdict], params: TcpParams = TcpParams(),
          probes: list[Flow] = ()) -> list[tuple[str, int, int, float, dict]]:
    """(kind, src, dst, confidence, evidence) for the slow element behind the bottleneck flows: 'source' (a
    sender's egress), 'destination' (a receiver's ingress) or 'link'. Empty without a bottleneck, or where no
    one element explains them.

    A candidate must lie on every slow flow's path, its data's or its acknowledgements' (TCP couples the two
    directions: a slow egress slows what its rank sends and, through the acknowledgements it sends, what its
    rank receives), and on no healthy flow's data path. Of those, the one that slows the most on the data
    path, the stronger effect, is the answer. A rank's egress and ingress slow the same flows, one through
    the data and the other through the acknowledgements, and may tie: then the RTT of what the rank sends
    decides (a slow ingress queues its acknowledgements in the network; a slow egress queues data at home,
    where TCP keeps the queue short). A ring sends from each rank to one peer: nothing tells a sender's NIC
    from its one link, and its NIC is named with the link as the alternative, at half the confidence, unless
    the sender's path probe (``probes``, ``ingest/path_probe.py``: the same NIC, another link) went out several
    times faster than the bottleneck (it clears the NIC: the link) or crawled as it did (the NIC).
    """
    slow = [v for v in verdicts if v.status == "slow"]
    if not slow:
        return []
    fl = [v.flow for v in verdicts]
    cleared = set().union(*(_data_path(v.flow) for v in verdicts if v.status == "ok"))
    # A path probe that delivered several times the slowest bottleneck's rate crossed nothing that holds the
    # bottleneck to its rate: its sender's NIC, its link and its receiver are cleared like a healthy flow's.
    slowest = min(v.flow.rate for v in slow)
    fast_probes = [g for g in probes if g.rate >= params.sender_elsewhere * slowest]
    cleared |= set().union(*(_data_path(g) for g in fast_probes))
    pool = set().union(*(_data_path(v.flow) | _ack_path(v.flow) for v in slow))
    cands = [e for e in pool if e not in cleared
             and all(e in _data_path(v.flow) or e in _ack_path(v.flow) for v in slow)]
    primary = max(slow, key=lambda v: v.ratio)
    strength = float(1 - math.exp(-max(_healthy_ratio(primary.flow, verdicts) - 1, 0.0) / 2))
    evidence = {"bottleneck": [v.flow.evidence() for v in sorted(slow, key=lambda v: -v.ratio)],
                "cleared_by": sorted([f"{v.flow.src}>{v.flow.dst}" for v in verdicts if v.status == "ok"]
                                     + [f"probe {g.src}>{g.dst}" for g in fast_probes])[:50],
                "candidates": sorted(element_name(c) for c in cands)}
    if not cands:
        if fast_probes and len(slow) > 1:
            # The probes cleared what the slow flows shared: one of them was slowed by the other's back-pressure
            # (a ring's upstream neighbour, 1.9x the slowest rate). The slowest, busiest one alone, less sure.
            return _primary_alone(primary, verdicts, params, probes)
        return []  # several faults, or one the flows cannot place: the collectives' evidence may

    def on_data(e: tuple) -> float:
        return sum(math.log(max(v.ratio, 1.0)) for v in slow if e in _data_path(v.flow))
    top = max(on_data(e) for e in cands)
    if top <= 0:
        return []
    held_up = [v for v in slow if v is not primary and v.flow.rate >= params.held_up_rate * primary.flow.rate]
    if fast_probes and held_up and not any(e in _data_path(primary.flow) for e in cands):
        # What the probes left explains the slowest flow through its acknowledgements only: the others were held
        # up by it (a flat ring's link 5>4 at 40mbit, its upstream 6>5 at 1.8x its rate; rank 5's probe cleared
        # its NIC and left "ingress 5", named at 0.79). The slowest, busiest one alone, less sure.
        return _primary_alone(primary, verdicts, params, probes)
    best = [e for e in cands if on_data(e) >= params.data_tie * top]
    conf = strength
    if len(best) > 1:
        ranks = {e[1] for e in best if len(e) == 2}
        if len(ranks) == 1 and {e[0] for e in best} == {"egress", "ingress"} and len(best) == 2:
            (r,) = ranks
            outs = [g.rtt_us for g in fl if g.src == r]
            ref = _ref_rtt(fl, {r} | {g.dst for g in fl if g.src == r})
            sends_x = max(outs) / ref if outs and ref > 0 else math.nan
            held = _queued_bytes(max(outs), ref, primary.flow.rate) if outs else math.nan
            evidence["rtt"] = {"reference_ms": round(ref / 1e3, 3), "rank_sends_x": round(sends_x, 2),
                               "queued_kb": round(held / 1e3, 1)}
            best = [("ingress", r) if sends_x >= params.rtt_queue and held >= params.queue_bytes else ("egress", r)]
            conf *= 0.8
    if len(best) > 1:
        best, conf = _sender_side(primary.flow, best, fl, params, evidence, conf, probes)
    if len(best) != 1:
        return []
    (e,) = best
    return [(*finding_of(e), conf, evidence)]


def _primary_alone(primary: FlowVerdict, verdicts: list[FlowVerdict], params: TcpParams,
                   probes: list[Flow]) -> list[tuple[str, int, int, float, dict]]:
    """``where`` with the slowest flow the only slow one (the others held up by it), at 0.6 of the confidence."""
    alone = [v if v is primary or v.status != "slow" else dataclasses.replace(v, status="unknown") for v in verdicts]
    return [(k, s, d, c * 0.6, {**ev, "explained": f"{primary.flow.src}>{primary.flow.dst} alone"})
            for k, s, d, c, ev in where(alone, params, probes)]


def _sender_side(f: Flow, best: list[tuple], fl: list[Flow], params: TcpParams, evidence: dict,
                 conf: float, probes: list[Flow] = ()) -> tuple[list[tuple], float]:
    """The bottleneck's own three elements left: the receiver's ingress where its data queued in the network
    (its RTT, and the RTT of what the receiver sends), else the sender's side: its NIC, or its link."""
    ref = _ref_rtt(fl, {f.src, f.dst})
    # What the receiver sends to the bottleneck's own sender is acknowledged through that sender's egress,
    # the other candidate: a slow NIC raises that RTT as much as a slow receiver would (a DP pair that trades
    # both ways, egress 1 at 20mbit: 0>1 at 23x, while 0>2 kept the reference). Its sends to anyone else
    # decide; only a receiver that sends to no one else is judged by that one.
    out_of_dst = ([g.rtt_us for g in fl if g.src == f.dst and g.dst != f.src]
                  or [g.rtt_us for g in fl if g.src == f.dst])
    queued = f.rtt_us / ref if ref > 0 else math.nan
    held = _queued_bytes(f.rtt_us, ref, f.rate)
    dst_acks = max(out_of_dst) / ref if out_of_dst and ref > 0 else math.nan
    evidence["rtt"] = {"reference_ms": round(ref / 1e3, 3), "bottleneck_x": round(queued, 2),
                       "queued_kb": round(held / 1e3, 1),
                       "receiver_sends_x": round(dst_acks, 2) if dst_acks == dst_acks else None}
    if (("ingress", f.dst) in best and queued >= params.rtt_queue and held >= params.queue_bytes
            and (not out_of_dst or dst_acks >= params.rtt_queue)):
        return [("ingress", f.dst)], conf * 0.8
    others_queued = receiver_queued(fl, f.src, f.dst, params) if ("ingress", f.dst) in best else None
    if others_queued is not None:
        # Another sender's flow into the receiver queued in the network too: its ingress, whatever the
        # bottleneck's own queue held (a pipeline's 20mbit ingress: 0>2 held 8.0 KB, just under, while the
        # all-reduce peer's 3>2 ran at 45x the reference RTT; the link was named at 0.60).
        evidence["receiver_queued"] = others_queued
        return [("ingress", f.dst)], conf * 0.8
    side = [e for e in (("egress", f.src), ("link", f.src, f.dst)) if e in best]
    if len(side) == 2:
        # Everything the sender sends leaves through its NIC, so no flow of it can run faster than its NIC
        # delivers: one to another peer at several times the bottleneck's rate (busy time counts only what
        # was in flight, so the two sharing the NIC for a while cannot make that) says the NIC was not the
        # limit. Such a flow need not be healthy by the job's measure, only faster than the bottleneck.
        faster = [g for g in fl if g.src == f.src and g.dst != f.dst and g.rate >= params.sender_elsewhere * f.rate]
        if faster:
            evidence["sender_elsewhere"] = max(faster, key=lambda g: g.rate).evidence()
            return [("link", f.src, f.dst)], conf * 0.8
        # (A probe to the bottleneck's own receiver crossed the same link: it says nothing here. In a pipeline
        # of 4 ranks, half the world away is the rank's pipeline peer.)
        mine = [g for g in probes if g.src == f.src and g.dst != f.dst and g.rate == g.rate]
        if mine and max(g.rate for g in mine) >= params.probe_clears_nic * f.rate:
            # Its probe to another rank, through the same NIC, went faster than a NIC as slow as the
            # bottleneck lets anything through.
            evidence["probe"] = max(mine, key=lambda g: g.rate).evidence()
            return [("link", f.src, f.dst)], conf * 0.8
        if mine and max(g.rate for g in mine) <= params.probe_as_slow * f.rate:
            # Its probe to another rank, through the same NIC and another link, crawled as the bottleneck did.
            evidence["probe"] = max(mine, key=lambda g: g.rate).evidence()
            return [("egress", f.src)], conf * 0.8
        evidence["alternative"] = f"link {f.src}>{f.dst}: the sender has no other transfer to tell them apart"
        evidence["alternative_element"] = ["link", int(f.src), int(f.dst)]  # history.elements: confirmed later
        return [("egress", f.src)], conf * 0.5
    return side, conf * 0.7
