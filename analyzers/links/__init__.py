"""Link diagnosis of one job window: which link, NIC or receiver is slow, or which rank sends late.

Two kinds of evidence, both from the window's CCL records (``core.schema.CCL_RECORD``):
- ``reported``: per-peer transfer times that the collective library timed
  itself (a latency matrix per group, its hot cells, rows and columns);
- ``measured``: every other record, through the enter and exit times each
  rank recorded: p2p sends matched with their receives across ranks, and the
  members of each collective side by side; ``localise`` names the fault by
  intersecting the slow and the healthy observations.

``diagnose_window(ccl) -> LinkDiagnosis`` (faults and the whole matrix),
``diagnose(ccl)`` its faults, ``to_tables(diagnosis, key)`` the LINK_FAULT and
LINK_CELL rows of the window.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa

from analyzers.links.fault import KINDS, LinkFault
from analyzers.links.localise import comm_faults, late_senders
from analyzers.links.measured import (MeasuredParams, Observation, collective_observations, judge, measured_rows,
                                      p2p_observations)
from analyzers.links.reported import Edges, LinkParams, diagnose_group, edges_from_ccl
from core import codec, jsonutil
from core import schema as S

__all__ = ["KINDS", "LinkFault", "LinkParams", "MeasuredParams", "Edges", "Observation", "LinkDiagnosis",
           "diagnose", "diagnose_window", "edges_from_ccl", "diagnose_group", "to_tables"]


@dataclasses.dataclass(frozen=True)
class LinkDiagnosis:
    faults: list[LinkFault]            # most confident first
    edges: list[Edges]                 # reported matrices, one per group
    observations: list[Observation]    # measured pairs and collective groups


def diagnose_window(ccl: pa.Table, params: LinkParams = LinkParams(),
                    measured: MeasuredParams = MeasuredParams()) -> LinkDiagnosis:
    """Faults and matrices of every group of the window."""
    faults: list[LinkFault] = []
    edges = edges_from_ccl(ccl) if ccl.num_rows else []
    for e in edges:
        faults += diagnose_group(e, params)
    observations: list[Observation] = []
    rest = measured_rows(ccl) if ccl.num_rows else ccl
    if rest.num_rows:
        observations = p2p_observations(rest) + collective_observations(rest, measured)
        judge(observations, measured)
        faults += comm_faults(observations, measured) + late_senders(observations, measured)
    faults.sort(key=lambda f: (-f.confidence, -f.slowdown))
    return LinkDiagnosis(faults, edges, observations)


def diagnose(ccl: pa.Table, params: LinkParams = LinkParams()) -> list[LinkFault]:
    """Every group of the window; faults most severe first."""
    return diagnose_window(ccl, params).faults


MAX_REPORTED_CELLS = 20_000
"""Cells of reported matrices stored per window: a 8,192-rank group has ~100,000; the slowest are kept."""


def _cells(d: LinkDiagnosis) -> list[dict]:
    rows = []
    for o in d.observations:
        common = dict(ns_per_byte=o.ns_per_byte, median_ns=o.median_ns, samples=o.samples, ratio=o.ratio,
                      status=o.status)
        if o.kind == "p2p":
            rows.append(dict(group="p2p", src=o.members[0], dst=o.members[1],
                             wait_ns=o.wait_ns if o.wait_ns == o.wait_ns else -1.0, **common))
        else:
            rows += [dict(group=o.name, src=r, dst=-1, wait_ns=o.lateness_ns.get(r, -1.0), **common)
                     for r in o.members]
    reported = []
    for e in d.edges:
        med = float(np.median(e.time_per_byte)) if len(e.time_per_byte) else math.nan
        for s, t, v, w, n in zip(e.src.tolist(), e.dst.tolist(), e.time_per_byte.tolist(), e.wait_ns.tolist(),
                                 e.samples.tolist()):
            reported.append(dict(group=e.group, src=s, dst=t, ns_per_byte=v, median_ns=math.nan, wait_ns=w,
                                 samples=n, ratio=v / med if med > 0 else math.nan, status="unknown"))
    if len(reported) > MAX_REPORTED_CELLS:
        reported = sorted(reported, key=lambda r: -r["ratio"])[:MAX_REPORTED_CELLS]
    return rows + reported


def to_tables(d: LinkDiagnosis, key: tuple[str, int, int]) -> dict[str, pa.Table]:
    """{"link_fault": LINK_FAULT rows, "link_cell": LINK_CELL rows} of one window ``key`` (job, attempt, window)."""
    ident = dict(job_id=key[0], attempt=key[1], window_id=key[2])
    return {
        "link_fault": codec.from_rows(S.LINK_FAULT, [dict(
            ident, group=f.group, kind=f.kind, src=f.src, dst=f.dst, confidence=f.confidence, slowdown=f.slowdown,
            evidence_json=jsonutil.dumps(f.evidence)) for f in d.faults]),
        "link_cell": codec.from_rows(S.LINK_CELL, [dict(ident, **c) for c in _cells(d)]),
    }
