"""Name the slow link, NIC or receiver by intersecting what slow and healthy observations share.

Each observation (``measured.Observation``) depends on a set of elements: the
NIC egress and ingress of ranks and the directed links between them. A p2p
pair s>d depends on s's egress, d's ingress and the link s>d; a collective on
every member's egress and ingress and the links of its ring. With one fault
at a time, the faulty element is in every slow observation and in no healthy
one. DP, TP and PP groups overlap, so a job has many observations to
intersect:

- one link left: ``link``; one egress: ``source`` (a slow NIC sending); one
  ingress: ``destination`` (a slow receiver);
- a rank's egress and ingress together (only collectives, which go both
  ways, saw it): ``endpoint``;
- the elements of one p2p pair that nothing healthy cleared: ``link``, at a
  third of the confidence;
- nothing in common: ``comm_slow`` per slow observation (several faults, or
  one the observations cannot place).

Late senders (``noncomm_slow``) are ranks that come late, not transfers that
are slow: receivers wait for them, they are the last into their collectives.
A rank that was itself waiting for a late or slow peer is not blamed. A rank
that exchanges with several peers at once (a ring written with isend/irecv)
is judged step by step (``measured.exchange_arrivals``): there, waiting
spreads to every rank and a median wait names no one. Where every rank of the
job trades like that, what decides is how long each rank works on its own
between two exchanges against the job's median rank (what a late rank adds,
and nothing its neighbours do moves), else when it arrives after its peers.
Either way, late means behind by a stable margin: in a low quantile of its steps or
collectives, by more than the job's own step-to-step jitter, measured on the
job (``_floor``), not by a fixed share of a step.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from analyzers.links.fault import LinkFault, element_name, finding_of
from analyzers.links.measured import Arrivals, MeasuredParams, Observation, Work, jitter


def _strength(ratio: float) -> float:
    """0..1 from how far beyond healthy the slow observations are (ratio 3: 0.63, ratio 10: 0.99)."""
    return float(1 - math.exp(-max(ratio - 1, 0.0) / 2))


def comm_faults(observations: list[Observation], params: MeasuredParams = MeasuredParams()) -> list[LinkFault]:
    """Faults of slow communication, localised by intersection."""
    slow = [o for o in observations if o.status == "slow"]
    if not slow:
        return []
    cleared = set().union(*(o.elements() for o in observations if o.status == "ok"))
    candidates = set.intersection(*(o.elements() for o in slow)) - cleared
    ratio = float(np.median([o.ratio for o in slow]))
    evidence = {
        "slow": [o.evidence() for o in slow],
        "cleared_by": sorted(o.name for o in observations if o.status == "ok")[:50],
        "candidates": sorted(element_name(c) for c in candidates),
        # A residual clock offset shorter than this cannot have made these observations slow.
        "skew_margin_ns": float(min(o.excess_ns() for o in slow)),
    }
    group = slow[0].name.split(" ", 1)[0] if len(slow) == 1 else "+".join(sorted({o.name for o in slow}))[:200]
    conf = _strength(ratio)
    egress = {c[1] for c in candidates if c[0] == "egress"}
    ingress = {c[1] for c in candidates if c[0] == "ingress"}
    links = [c for c in candidates if c[0] == "link"]
    if len(candidates) == 1:
        (c,) = candidates
        return [LinkFault(group, *finding_of(c), conf, ratio, evidence)]
    if not links and len(egress) == 1 and egress == ingress:
        (r,) = egress
        return [LinkFault(group, "endpoint", int(r), int(r), conf * 0.8, ratio, evidence)]
    if len(links) == 1 and {("egress", links[0][1]), ("ingress", links[0][2])} >= candidates - set(links):
        _, s, d = links[0]
        return [LinkFault(group, "link", int(s), int(d), conf / len(candidates), ratio, evidence)]
    # No single element explains it all: say where it was slow, unlocalised.
    out = []
    for o in slow:
        s, d = o.members if o.kind == "p2p" else (-1, -1)
        out.append(LinkFault(o.name.split(" ", 1)[0], "comm_slow", int(s), int(d), _strength(o.ratio) * 0.3,
                             o.ratio, {**evidence, "slow": [o.evidence()]}))
    return out


def _later_than_the_rest(lat: float, others: list[float], params: MeasuredParams) -> bool:
    """A member ``lat`` late (median over the group's collectives) stands out from the others' lateness.

    A multiple of the others' median, or, in a group of three and more, beyond their spread: on a shared
    host the members of an 8-rank job reach a collective tens of milliseconds apart by themselves, so a rank
    120 ms late stood 2.2x the median of the others and was not named, though it was the last every time
    and 5 spreads beyond them. In a pair the other member is 0 late by definition: the multiple decides.
    """
    med = float(np.median(others)) if others else 0.0
    if lat >= params.wait_ratio * max(med, 1.0):
        return True
    if len(others) < 2:
        return False
    spread = 1.4826 * float(np.median(np.abs(np.asarray(others) - med)))
    return lat - med >= params.late_spread * max(spread, params.min_wait_ns)


def _stands_out(r: int, p2p: list[Observation], params: MeasuredParams) -> bool:
    """Whether the receivers of rank ``r``'s sends waited for it far more than those of the other senders.

    On a shared host every rank is sometimes scheduled late: in a healthy hand-written ring on two cores one
    rank or another came out 'late' at confidence 0.99, a different one in each run. A late sender stands
    out from the others' typical wait by several spreads (robust: the median absolute deviation of the
    senders' median waits). Without sends of its own or of others, the collectives decide alone.
    """
    per_sender: dict[int, list[float]] = {}
    for o in p2p:
        per_sender.setdefault(o.members[0], []).append(o.wait_ns)
    if r not in per_sender or len(per_sender) < 3:
        return True
    mine = float(np.median(per_sender[r]))
    others = np.array([float(np.median(v)) for s, v in per_sender.items() if s != r])
    med = float(np.median(others))
    spread = 1.4826 * float(np.median(np.abs(others - med)))
    return mine - med >= params.late_spread * max(spread, params.min_wait_ns)


def _floor(params: MeasuredParams, period_ns: float, jitter_ns: float, jitters: float | None = None) -> float:
    """How far behind the others a rank must stay to be late: beyond the job's own jitter (``jitters`` of it,
    ``late_jitter`` by default, measured on the job), ``min_wait_ns`` and ``min_period_share`` of its step,
    where these are known."""
    jitters = params.late_jitter if jitters is None else jitters
    return max(params.min_wait_ns, params.min_period_share * period_ns if period_ns == period_ns else 0.0,
               jitters * jitter_ns if jitter_ns == jitter_ns else 0.0)


def _quantiles(per_rank: list[np.ndarray], q: float) -> np.ndarray:
    """The ``q`` quantile of each array (nan for an empty one), one numpy call per distinct length: 15,360
    ranks of a 16,384-rank pipeline window one by one took 2.3 s; their arrays mostly have one length."""
    out = np.full(len(per_rank), np.nan)
    lengths = np.array([len(m) for m in per_rank], dtype=np.int64)
    for n in np.unique(lengths[lengths > 0]).tolist():
        idx = np.flatnonzero(lengths == n)
        out[idx] = np.quantile(np.stack([per_rank[i] for i in idx.tolist()]), q, axis=1)
    return out


def steps_jitter(per_rank: list[np.ndarray]) -> float:
    """The job's own step-to-step jitter of a per-step margin (each rank's arrival after its exchange peers,
    ``measured.exchange_arrivals``, or its work against the job's median rank, ``measured.work_margins``): how
    far each rank's margin moves around that rank's own median, pooled over every rank (``measured.jitter``)."""
    per_rank = [m for m in per_rank if len(m)]
    if not per_rank:
        return math.nan
    medians = _quantiles(per_rank, 0.5)
    return jitter(np.concatenate(per_rank) - np.repeat(medians, [len(m) for m in per_rank]))


@dataclasses.dataclass(frozen=True)
class _StepsLate:
    """How a rank was found late step by step: ``margins`` per step (its arrival after its exchange peers, or
    its own work before the step beyond the job's median rank), their ``late_quantile`` ``low``, the ``floor``
    it passed, the job's ``jitter_ns`` of that measure, and ``measure`` (arrival | work)."""
    margins: np.ndarray
    low: float
    floor: float
    jitter_ns: float
    measure: str


def _late_by_steps(margins: np.ndarray, period_ns: float, jitter_ns: float, measure: str, jitters: float,
                   params: MeasuredParams, low: float | None = None) -> _StepsLate | None:
    """Behind by a stable margin over at least ``min_collectives`` steps: the ``late_quantile`` of the per-step
    margins (``low``, where already computed) at the floor (``_floor``, with the job's jitter of the same
    measure, ``jitters`` of it) or beyond."""
    if len(margins) < params.min_collectives:
        return None
    low = float(np.quantile(margins, params.late_quantile)) if low is None else low
    floor = _floor(params, period_ns, jitter_ns, jitters)
    return _StepsLate(margins, low, floor, jitter_ns, measure) if low >= floor else None


def _beyond_jitter(r: int, o: Observation, params: MeasuredParams) -> float | None:
    """Member ``r``'s margin over the others of collective ``o`` (its median lateness less theirs) where it is
    the last one in by a stable margin: last in ``last_share`` of them, its ``late_quantile`` of lateness past
    the others' median by the floor (``_floor``: the job's jitter), and standing out from the others' lateness
    (``_later_than_the_rest``); None where it is not."""
    share = params.last_share_pair if len(o.members) == 2 else params.last_share_group
    if o.status == "slow" or o.samples < params.min_collectives or o.last_share.get(r, 0.0) < share:
        return None  # before the others are gathered: in a 512-rank group that is 512 x 512 items
    others = [v for q, v in o.lateness_ns.items() if q != r]
    lat = o.lateness_ns.get(r, 0.0)
    med = float(np.median(others)) if others else 0.0
    low = o.low_lateness_ns.get(r, lat) - med
    if low < _floor(params, o.period_ns, o.jitter_ns) or not _later_than_the_rest(lat, others, params):
        return None
    return lat - med


def late_senders(observations: list[Observation], params: MeasuredParams = MeasuredParams(),
                 arrivals: dict[int, Arrivals] | None = None, work: dict[int, Work] | None = None) -> list[LinkFault]:
    """Ranks that come late to send: receivers wait for them and they enter collectives last.

    Late means later than the others by a stable margin, beyond the job's own jitter measured on the job
    (``_floor``). Where every rank does the same (``measured.work_margins``: data parallel, a ring) and the
    window holds at least ``min_collectives`` steps of it, by the time it works on its own before each step's
    first call against the job's median rank, ``work_jitters`` of the job's jitter of it, and by nothing else:
    what a late rank adds, and what nothing the others do moves. Else: in its collectives (``_beyond_jitter``)
    and, for a rank that exchanges with several peers at once (``measured.exchange_arrivals``), at each step's exchange against those peers, not by its
    receivers' waits, which in such a job spread to every rank. The finding's evidence carries the margin in
    ns (``margin_ns``: median over its collectives or steps), as a share of the step (``margin_share_of_step``)
    and against the jitter (``jitter_ns``); its confidence is how many jitters the margin is
    (``1 - exp(-margin / jitter)``, times the share of its observations it was late in)."""
    arrivals, work = arrivals or {}, work or {}
    p2p = [o for o in observations if o.kind == "p2p"]
    coll = [o for o in observations if o.kind == "collective"]
    med_wait = float(np.median([o.wait_ns for o in p2p])) if p2p else 0.0
    items: dict[int, int] = {}
    late: dict[int, list[tuple[float, float, float]]] = {}  # rank -> (margin, step, jitter) of each late item
    for o in p2p:
        s = o.members[0]
        if s in arrivals:
            continue
        items[s] = items.get(s, 0) + 1
        if o.status != "slow" and o.wait_ns >= max(params.min_wait_ns, params.wait_ratio * med_wait):
            late.setdefault(s, []).append((o.wait_ns, math.nan, math.nan))
    # A rank whose work the window holds for enough steps is judged by it alone: where every rank does the same,
    # its lateness into a call is its own work plus when its previous call ended, which the others decide.
    by_work = {r for r, w in work.items() if len(w.margin_ns) >= params.min_collectives}
    by_steps: dict[int, _StepsLate] = {}
    w_jitter = steps_jitter([w.margin_ns for w in work.values()])
    judged = sorted(by_work)
    for r, low in zip(judged, _quantiles([work[r].margin_ns for r in judged], params.late_quantile).tolist()):
        w = work[r]
        found = _late_by_steps(w.margin_ns, w.period_ns, w_jitter, "work", params.work_jitters, params, low)
        if found is not None:
            by_steps[r] = found
    a_jitter = steps_jitter([a.margin_ns for a in arrivals.values()])
    a_low = _quantiles([a.margin_ns for a in arrivals.values()], params.late_quantile)
    for (r, a), low in zip(arrivals.items(), a_low.tolist()):
        items[r] = items.get(r, 0) + len(a.steps)
        found = by_steps.get(r) if r in by_work else _late_by_steps(a.margin_ns, a.period_ns, a_jitter, "arrival",
                                                                     params.late_jitter, params, low)
        if found is not None:
            by_steps[r] = found
            late.setdefault(r, []).extend((float(m), a.period_ns, found.jitter_ns) for m in found.margins.tolist())
    for o in coll:
        for r in o.members:
            items[r] = items.get(r, 0) + 1
            margin = _beyond_jitter(r, o, params) if r not in by_work else None
            if margin is not None:
                late.setdefault(r, []).append((margin, o.period_ns, o.jitter_ns))
    for r, found in by_steps.items():  # late by its work, step by step: its collectives' items are that
        if r not in arrivals:
            late[r] = [(float(m), work[r].period_ns, found.jitter_ns) for m in found.margins.tolist()]
            items[r] = len(found.margins)
    blamed = {r for r, v in late.items() if r in by_steps or len(v) / items[r] >= params.late_fraction}
    blamed = {r for r in blamed if r in arrivals or r in by_steps or _stands_out(r, p2p, params)}
    # Not the root: a rank that waited on a blamed rank's sends, or that receives over a slow transfer.
    waited = {o.members[1] for o in p2p if o.members[0] in blamed and o.members[0] != o.members[1]
              and o.wait_ns >= max(params.min_wait_ns, params.wait_ratio * med_wait)}
    waited -= {r for r, f in by_steps.items() if f.measure == "work"}  # its own work: it waited, and worked longer
    # A rank in any slow observation is late because of the network, which comm_faults reports.
    fed_slowly = {o.members[1] for o in p2p if o.status == "slow"}
    fed_slowly |= {r for o in coll if o.status == "slow" for r in o.members}
    roots = blamed - waited - fed_slowly
    if not roots and blamed - fed_slowly:  # they waited on each other: the latest of them
        roots = {max(blamed - fed_slowly, key=lambda r: float(np.median([m for m, _, _ in late[r]])))}
    return [_finding(r, late[r], items[r], med_wait, arrivals.get(r), by_steps.get(r), params)
            for r in sorted(roots)]


def _nanmedian(values: list[float]) -> float:
    known = [v for v in values if v == v]
    return float(np.median(known)) if known else math.nan


def _finding(r: int, late: list[tuple[float, float, float]], items: int, med_wait: float, a: Arrivals | None,
             steps: _StepsLate | None, params: MeasuredParams) -> LinkFault:
    """The ``noncomm_slow`` finding of root ``r`` from its late items (margin, step, jitter)."""
    margin = float(np.median([m for m, _, _ in late]))
    step, jitter_ns = _nanmedian([p for _, p, _ in late]), _nanmedian([j for _, _, j in late])
    frac = len(late) / items
    evidence = {"late_observations": len(late), "observations": items, "median_wait_ns": margin,
                "median_p2p_wait_ns": med_wait, "skew_margin_ns": margin - params.min_wait_ns, "margin_ns": margin}
    if step == step and step > 0:
        evidence["step_ns"] = step
        evidence["margin_share_of_step"] = margin / step
    if jitter_ns == jitter_ns:  # judged against the job's jitter (collectives, exchanges): it is the scale
        scale = max(jitter_ns, params.min_wait_ns)
        evidence["jitter_ns"] = jitter_ns
    else:  # receivers' waits of p2p sends only
        scale = params.wait_ratio * max(med_wait, params.min_wait_ns)
    if steps is not None:  # judged step by step: at its exchanges, or by its own work before each step
        behind = steps.margins >= steps.floor
        frac = float(np.mean(behind))
        evidence = {**evidence, "late_steps": int(behind.sum()), "steps": len(steps.margins),
                    "median_margin_ns": margin, "low_margin_ns": steps.low,
                    # arrival: after its exchange peers; work: longer on its own than the job's median rank
                    "late_by": steps.measure,
                    # a residual clock offset moves an arrival, never the time between one rank's own calls
                    "skew_margin_ns": steps.low if steps.measure == "arrival" else math.inf}
        if a is not None:
            evidence["exchange_peers"] = list(a.peers)
    conf = min(1.0, frac) * (1 - math.exp(-margin / scale))
    return LinkFault("", "noncomm_slow", int(r), -1, float(conf), margin / scale, evidence)
