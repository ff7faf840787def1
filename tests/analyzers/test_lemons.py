"""Lemon hosts: implicated by several jobs, more than their share of the fleet's GPU-hours explains."""
from __future__ import annotations

import numpy as np

from analyzers.lemons import Incident, LemonParams, by_label, lemon_hosts


def _fleet(rng, lemon_jobs: int, hosts=300, jobs=400, background=0.03):
    """Jobs on 8 random hosts each; each job implicates one of its hosts with probability ``background``
    (an ordinary straggler); the lemon 'h7' is implicated by every one of its first ``lemon_jobs`` jobs."""
    exposure = {f"h{i}": 0.0 for i in range(hosts)}
    incidents, lemon_seen = [], 0
    for j in range(jobs):
        on = [f"h{i}" for i in rng.choice(hosts, 8, replace=False)]
        hours = float(rng.uniform(10, 100))
        for h in on:
            exposure[h] += hours
        if "h7" in on and lemon_seen < lemon_jobs:
            lemon_seen += 1
            incidents.append(Incident("h7", f"job{j}", 0, j, "worker", "window 0: worker on h7 S_w 1.4"))
        elif rng.random() < background:
            h = str(rng.choice(on))
            incidents.append(Incident(h, f"job{j}", 0, j, "worker", f"window 0: worker on {h}"))
    return incidents, exposure


def test_a_host_three_jobs_implicated_is_a_lemon_and_no_ordinary_host_is():
    rng = np.random.default_rng(7)
    incidents, exposure = _fleet(rng, lemon_jobs=3)
    scores = lemon_hosts(incidents, exposure)
    lemons = [s.host for s in scores if s.lemon]
    assert lemons == ["h7"], [(s.host, s.jobs, round(s.p_value, 6)) for s in scores[:5]]
    top = scores[0]
    assert top.jobs == 3 and top.score > 3 and len(top.evidence) == 3


def test_two_jobs_or_one_job_many_times_are_not_enough():
    rng = np.random.default_rng(8)
    incidents, exposure = _fleet(rng, lemon_jobs=2)
    assert not any(s.lemon for s in lemon_hosts(incidents, exposure))
    many = [Incident("h1", "bad-job", 0, t, "worker", "again") for t in range(50)]
    assert not any(s.lemon for s in lemon_hosts(many, {"h1": 10.0, "h2": 10.0}))


def test_a_host_that_ran_ten_times_the_gpu_hours_needs_more_jobs():
    """Exposure: a host implicated 3 times in 3 jobs is a lemon only if that is unlikely for what it ran."""
    incs = [Incident("big", f"j{k}", 0, k, "worker", "") for k in range(3)]
    incs += [Incident(f"h{k}", f"x{k}", 0, k, "worker", "") for k in range(30)]
    exposure = {"big": 3000.0, **{f"h{k}": 100.0 for k in range(300)}}
    (big,) = [s for s in lemon_hosts(incs, exposure) if s.host == "big"]
    assert not big.lemon and big.expected_jobs > 2
    assert lemon_hosts(incs, exposure, LemonParams(max_p=0.9))[0].host == "big"


def test_hosts_under_one_switch_are_seen_together():
    incs = [Incident(h, f"j{h}{k}", 0, k, "hang", "") for h in ("a", "b") for k in range(2)]
    groups = by_label(lemon_hosts(incs, {"a": 10.0, "b": 10.0, "c": 10.0}), {"a": "sw1", "b": "sw1", "c": "sw2"})
    assert sorted(s.host for s in groups["sw1"]) == ["a", "b"] and "sw2" not in groups
