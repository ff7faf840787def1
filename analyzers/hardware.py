"""Why is that worker slow? Its GPUs against its peers', from the samples its heartbeats carried (NVML).

``hardware_evidence(ranks, samples)`` compares the latest sample of the
``ranks`` of a slow worker (or host) with the median of every other rank's:
an SM clock well below its peers', a throttle reason they do not have (a
power cap, heat), a hotter GPU, uncorrected ECC errors or PCIe replays its
peers lack. It returns the differences with their figures and one sentence
("SM clock 1,140 MHz vs the peers' median 1,980; throttled: software power
cap"), or nothing where the GPUs look alike or were not sampled. Pure: the
samples come in (``ray_jobs.hang_monitor.HangReducer.gpu_of``);
``with_hardware_evidence`` adds them to a window's worker verdicts, inside its analysis
(``analyzers.window``).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import pyarrow as pa


CLOCK_LOW = 0.9
"""An SM clock under this share of the peers' median is a finding (boost clocks wander by a few percent)."""
HOTTER_C = 10
"""A GPU this many degrees over the peers' median is a finding."""


def _median(values) -> float:
    v = [x for x in values if x is not None and x >= 0]
    return float(np.median(v)) if v else math.nan


def hardware_evidence(ranks: list[int], samples: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """{'sentence': ..., 'findings': [...], ...} of how the GPUs of ``ranks`` differ from the others'; {} if not."""
    mine = [samples[r] for r in ranks if r in samples and samples[r].get("sm_mhz", -1) >= 0]
    peers = [s for r, s in samples.items() if r not in ranks and s.get("sm_mhz", -1) >= 0]
    if not mine or not peers:
        return {}
    findings, parts = [], []
    sm, peer_sm = min(s["sm_mhz"] for s in mine), _median(s["sm_mhz"] for s in peers)
    if peer_sm > 0 and sm < CLOCK_LOW * peer_sm:
        findings.append({"what": "sm_clock", "value": sm, "peers_median": peer_sm})
        parts.append(f"SM clock {sm:,} MHz vs the peers' median {peer_sm:,.0f}")
    peer_throttle = {t for s in peers for t in filter(None, s.get("throttle", "").split(", "))}
    own = sorted({t for s in mine for t in filter(None, s.get("throttle", "").split(", "))} - peer_throttle)
    if own:
        findings.append({"what": "throttle", "value": own})
        parts.append(f"throttled: {', '.join(own)}")
    temp, peer_temp = max(s.get("temp_c", -1) for s in mine), _median(s.get("temp_c", -1) for s in peers)
    if peer_temp == peer_temp and temp >= peer_temp + HOTTER_C:
        findings.append({"what": "temperature", "value": temp, "peers_median": peer_temp})
        parts.append(f"{temp} C vs the peers' {peer_temp:.0f} C")
    for field, name in (("ecc_uncorrected", "uncorrected ECC errors"), ("pcie_replays", "PCIe replays")):
        v, peer = max(s.get(field, -1) for s in mine), _median(s.get(field, -1) for s in peers)
        if v > 0 and (peer != peer or v > peer):
            findings.append({"what": field, "value": v, "peers_median": peer})
            parts.append(f"{v:,} {name} (peers' median {0 if peer != peer else peer:,.0f})")
    if not findings:
        return {}
    power = max(s.get("power_w", -1) for s in mine)
    limit = min(s.get("power_limit_w", -1) for s in mine)
    return {"sentence": "; ".join(parts), "findings": findings, "ranks": sorted(ranks),
            "power_w": power, "power_limit_w": limit}


def with_hardware_evidence(verdicts: list[dict], ops: pa.Table,
                           samples: Mapping[int, Mapping[str, Any]]) -> list[dict]:
    """A window's verdicts with each slow-worker verdict given what its GPUs say against their peers' ("SM clock
    1,140 MHz vs the peers' median 1,980; throttled: sw_power_cap"), in its ``hardware`` and its summary; the
    others as they were. ``samples``: rank -> its latest GPU sample."""
    if not samples or not any(v.get("kind") == "worker" for v in verdicts):
        return verdicts
    # Each (worker, rank) once: a window holds up to hundreds of thousands of spans.
    seen = ops.select(["dp_rank", "pp_rank", "rank"]).group_by(["dp_rank", "pp_rank", "rank"], use_threads=False)
    coords = list(zip(*(seen.aggregate([]).column(c).to_pylist() for c in ("dp_rank", "pp_rank", "rank"))))
    out = []
    for v in verdicts:
        if v.get("kind") == "worker":
            tops = {(w["dp_rank"], w["pp_rank"]) for w in v.get("evidence", {}).get("top_workers", [])}
            found = hardware_evidence(sorted({r for d, p, r in coords if (d, p) in tops}), samples)
            if found:
                v = {**v, "hardware": found, "summary": f"{v.get('summary', '')}; its GPU: {found['sentence']}"}
        out.append(v)
    return out
