"""Is it the job or the machine? Hosts implicated across jobs, weighed by how much they ran.

Each window is judged alone: a host that makes one job straggle today and
another tomorrow is seen as two unrelated stragglers. Across the fleet it is
a lemon (Meta's study of 4M jobs found such nodes only offline). Every
implication of a host is an ``Incident``: a ``worker`` verdict's slow worker,
a hang's suspect, a lost node, a degraded worker, each mapped to the hosts
its ranks ran on. A host's ``exposure`` is the GPU-hours it ran, in any job.

``lemon_hosts`` scores each host over a period: the distinct jobs that
implicated it, against what its exposure would bring at the fleet's own rate
of incidents per GPU-hour (a Poisson tail: how unlikely that many jobs by
chance). A host implicated by at least ``min_jobs`` distinct jobs whose count
is that unlikely is a lemon; the evidence lists the jobs, windows and
verdicts. Hosts may carry labels (rack, switch) so incidents under one switch
are seen together (``by_label``).
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Iterable

from core.config import LemonConfig


@dataclasses.dataclass(frozen=True)
class Incident:
    host: str
    job_id: str
    attempt: int
    at_ns: int
    kind: str        # worker | hang | node_loss | degraded_worker | link | port_errors
    what: str        # e.g. "window 400: worker dp3/pp1 S_w 1.42"


LemonParams = LemonConfig
"""The scoring's parameters are the ``[lemons]`` section (``core.config.LemonConfig``: ``min_jobs``, ``max_p``)."""


@dataclasses.dataclass(frozen=True)
class HostScore:
    host: str
    jobs: int                 # distinct jobs that implicated it
    incidents: int
    gpu_hours: float          # its exposure
    expected_jobs: float      # at the fleet's rate, for its exposure
    p_value: float            # P(at least `jobs` | expected_jobs), Poisson
    lemon: bool
    evidence: list[dict]

    @property
    def score(self) -> float:
        """-log10 of the p-value: 3 = one in a thousand by chance."""
        return -math.log10(max(self.p_value, 1e-300))


def _poisson_tail(k: int, mu: float) -> float:
    """P(X >= k) for X ~ Poisson(mu)."""
    if k <= 0:
        return 1.0
    if mu <= 0:
        return 0.0
    term = math.exp(-mu)
    below = term
    for i in range(1, k):
        term *= mu / i
        below += term
    return max(0.0, 1.0 - below)


def lemon_hosts(incidents: Iterable[Incident], exposure: dict[str, float],
                params: LemonParams = LemonParams()) -> list[HostScore]:
    """Every implicated host with its score, lemons first, then the most unlikely."""
    by_host: dict[str, list[Incident]] = defaultdict(list)
    for inc in incidents:
        by_host[inc.host].append(inc)
    total_hours = sum(exposure.values())
    jobs_total = sum(len({(i.job_id, i.attempt) for i in v}) for v in by_host.values())
    rate = jobs_total / total_hours if total_hours > 0 else 0.0  # job-implications per GPU-hour, fleet-wide
    out = []
    for host, incs in by_host.items():
        hours = exposure.get(host, 0.0)
        jobs = len({(i.job_id, i.attempt) for i in incs})
        expected = rate * hours
        p = _poisson_tail(jobs, expected) if hours > 0 else 1.0
        lemon = jobs >= params.min_jobs and p <= params.max_p
        evidence = [dict(job_id=i.job_id, attempt=i.attempt, kind=i.kind, at_ns=i.at_ns, what=i.what)
                    for i in sorted(incs, key=lambda i: i.at_ns)[-20:]]
        out.append(HostScore(host, jobs, len(incs), hours, expected, p, lemon, evidence))
    out.sort(key=lambda s: (not s.lemon, s.p_value, -s.jobs))
    return out


def by_label(scores: list[HostScore], labels: dict[str, str]) -> dict[str, list[HostScore]]:
    """Implicated hosts grouped by a label (rack, switch): several under one switch point at the switch."""
    out: dict[str, list[HostScore]] = defaultdict(list)
    for s in scores:
        out[labels.get(s.host, "")].append(s)
    return dict(out)
