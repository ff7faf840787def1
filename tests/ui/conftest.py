"""A demo store for the console tests: real analyses of a generated fleet, written through storage/.

No Kafka or Ray here: the console reads only the store, so the fixture fills
one directly with what the pipeline would have written (window results of
real what-if analyses, hangs, link faults, alerts, registrations).
"""
from __future__ import annotations

import dataclasses
import time

import pyarrow as pa
import pytest

from core import codec
from core import schema as S


def cause_of(n_jobs: int = 12, seed: int = 3) -> dict[str, str]:
    """Injected cause of each demo job (the ground truth of the console tests)."""
    from generators.fleetgen import make_fleet

    return {f"ui-{i:03d}": j.cause for i, j in enumerate(make_fleet(n_jobs, seed, 8, 256))}


def fill_demo_store(store, n_jobs: int = 12, windows: int = 2, seed: int = 3) -> list[str]:
    from analyzers import downtime, hang
    from core.config import AlertConfig
    from core.registration import Registration
    from generators.faultgen import hang_incident, link_incident
    from generators.fleetgen import fleet_windows, make_fleet
    from ray_jobs.alerts import AlertRules
    from ray_jobs.analysis import analyze_window

    now = time.time_ns()
    jobs = [dataclasses.replace(j, job_id=f"ui-{i:03d}") for i, j in enumerate(make_fleet(n_jobs, seed, 8, 256))]
    store.insert("job", pa.concat_tables([j.registration(now, 3) for j in jobs]))
    rules = AlertRules(AlertConfig(min_gpus=1, cooldown_s=0))
    by_kind: dict[str, list[pa.Table]] = {}
    for spec, wid, ops in fleet_windows(jobs, windows, 3, now - 3600 * 10**9):
        info = Registration.from_row(spec.registration(now, 3).to_pylist()[0])
        ccl = link_incident("link", 16, wid, job_id=spec.job_id) if spec.job_id == "ui-001" else None
        if ccl is not None:
            c = ccl.ccl
            c = c.set_column(c.schema.get_field_index("window_id"), "window_id", pa.array([wid] * c.num_rows, pa.int64()))
            ccl = c
        tables = analyze_window(ops, info, (spec.job_id, 0, wid), True, "", ccl)
        row = tables["window"].to_pylist()[0]
        alerts = rules.evaluate_window(row, 0.0, now)
        if tables["link_fault"].num_rows:
            alerts += rules.evaluate_links(tables["link_fault"].to_pylist(), 0.0, now)
        tables["alert"] = codec.from_rows(S.ALERT, alerts)
        tables["op_span"] = ops  # the pipeline keeps small windows' raw spans (timeline drill-down)
        for kind, t in tables.items():
            by_kind.setdefault(kind, []).append(t)
    inc = hang_incident("comm_hang", 32, 1, job_id="ui-002")
    tr = hang.HangTracker("ui-002", params=hang.HangParams(floor_s=60))
    tr.add_ccl(inc.ccl)
    tr.add_heartbeats(inc.heartbeats)
    found = tr.evaluate(inc.now_ns, input_alive=True)
    hangs = hang.to_tables([found], now)["hang"]
    by_kind.setdefault("hang", []).append(hangs)
    [row] = hangs.to_pylist()
    row["summary"] = found.summary()
    by_kind["alert"].append(codec.from_rows(S.ALERT, rules.evaluate_hang(row, 0.0, now)))
    from generators.downtimegen import generate_downtime_fleet

    faults = generate_downtime_fleet(n_jobs=3, days=2.0, seed=1)
    by_kind["downtime"] = [downtime.to_tables(downtime.account_downtime(faults.tables()))["downtime"]]
    for kind, ts in by_kind.items():
        t = pa.concat_tables([x for x in ts if x.num_rows] or ts[:1])
        if t.num_rows:
            store.insert(kind, t)
    return [j.job_id for j in jobs]


@pytest.fixture(scope="session")
def demo_store_url(tmp_path_factory):
    """chdb:// URL of a filled store; the console tests read it (one process at a time)."""
    from storage import open_store

    path = tmp_path_factory.mktemp("ui-store") / "store"
    url = f"chdb://{path}"
    store = open_store(url)
    store.setup()
    fill_demo_store(store)
    store.close()
    return url
