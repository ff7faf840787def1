"""Fabric port counters: the sampler over fake sysfs trees laid out as on real hosts, the exporter's rows, the
shard's reducer and boundary, the evidence and its wording, and the lemon score (ingest/port_counters.py,
analyzers/fabric.py)."""
from __future__ import annotations

import json
import logging
import os

import pyarrow as pa

from analyzers import explain
from analyzers.fabric import FabricParams, host_verdicts, port_incidents, with_fabric_evidence
from analyzers.lemons import LemonParams, lemon_hosts
from analyzers.links import fault_table
from analyzers.links.fault import LinkFault
from core import codec
from core import schema as S
from core.config import ValidationConfig
from ingest.exporter import RankExporter
from ingest.port_counters import PortCounterSampler, counter_delta, reports_ports
from ray_jobs import boundary as B
from ray_jobs.port_counters import PortCounterReducer

SEC = 10**9
T0 = 1_800_000_000 * SEC
BASE = dict(port_xmit_wait=1000, port_xmit_discards=0, symbol_error=2, port_rcv_errors=0, link_downed=1,
            link_error_recovery=4, port_xmit_data=10**12, port_rcv_data=10**12, port_xmit_packets=7)
HW = dict(out_of_buffer=5, np_cnp_sent=100, rp_cnp_handled=90, req_cqe_error=3)


class Clock:
    """Monotonic ns that moves ``step_s`` every reading: two readings of one sample are apart by that too."""

    def __init__(self, step_s: float = 1.0):
        self.t, self.step = 10**12, int(step_s * SEC)

    def __call__(self) -> int:
        self.t += self.step
        return self.t


def port(root, device="mlx5_0", n=1, state="4: ACTIVE", hw=None, **counters):
    """A port as the kernel lays it out: ports/<n>/counters/<name>, hw_counters/<name>, state ("4: ACTIVE")."""
    base = os.path.join(root, device, "ports", str(n))
    os.makedirs(os.path.join(base, "counters"), exist_ok=True)
    for name, v in counters.items():
        with open(os.path.join(base, "counters", name), "w") as f:
            f.write(f"{v}\n")
    if hw is not None:
        os.makedirs(os.path.join(base, "hw_counters"), exist_ok=True)
        for name, v in hw.items():
            with open(os.path.join(base, "hw_counters", name), "w") as f:
                f.write(f"{v}\n")
    with open(os.path.join(base, "state"), "w") as f:
        f.write(state + "\n")


def host_tree(root, **changes):
    """A two-NIC host (mlx5_0 with driver counters, mlx5_1 without), each counter at BASE plus ``changes``."""
    port(root, "mlx5_0", 1, hw={k: v + changes.get(k, 0) for k, v in HW.items()},
         **{k: v + changes.get(k, 0) for k, v in BASE.items()})
    port(root, "mlx5_1", 1, **BASE)


def two_samples(tmp_path, step_s=1.0, **changes):
    root = str(tmp_path / "ib")
    host_tree(root)
    s = PortCounterSampler(root, clock=Clock(step_s))
    assert s.sample() == []  # the first reading only primes
    host_tree(root, **changes)
    return s, {(r["device"], r["port"]): r for r in s.sample()}


# -- the sampler ------------------------------------------------------------------------------------------------

def test_a_congested_port_sends_its_waits_and_data_in_bytes(tmp_path):
    s, rows = two_samples(tmp_path, port_xmit_wait=400_000_000, port_xmit_data=2_500_000_000, out_of_buffer=7)
    r = rows[("mlx5_0", 1)]
    assert r["xmit_wait"] == 400_000_000 and r["elapsed_ns"] > 0 and r["state"] == "ACTIVE"
    assert r["xmit_bytes"] == 4 * 2_500_000_000  # port_xmit_data counts 4-octet words
    assert r["rcv_bytes"] == 0 and r["link_downed"] == 0 and r["rcv_discards"] == -1  # mlx5 has no port_rcv_discards
    assert json.loads(r["hw_counters_json"]) == {"out_of_buffer": 7, "np_cnp_sent": 0, "rp_cnp_handled": 0}
    assert rows[("mlx5_1", 1)]["hw_counters_json"] == "{}" and rows[("mlx5_1", 1)]["xmit_wait"] == 0
    assert not r["reset"] and s.unavailable == "" and s.skipped == 0


def test_a_counter_that_went_back_was_reset_and_counts_from_zero(tmp_path):
    assert counter_delta(10, 25) == (15, False) and counter_delta(100, 7) == (7, True)
    assert counter_delta(None, 5) == (-1, False)
    root = str(tmp_path / "ib")
    host_tree(root)
    s = PortCounterSampler(root, clock=Clock())
    s.sample()
    port(root, "mlx5_0", 1, hw=HW, **dict(BASE, symbol_error=0, link_downed=0, port_xmit_data=300))
    r = next(r for r in s.sample() if r["device"] == "mlx5_0")
    assert r["reset"] and r["symbol_errors"] == 0 and r["link_downed"] == 0 and r["xmit_bytes"] == 1200


def test_garbage_or_unreadable_counters_are_skipped_and_said_once(tmp_path, caplog):
    root = str(tmp_path / "ib")
    host_tree(root)
    s = PortCounterSampler(root, clock=Clock())
    s.sample()
    counters = os.path.join(root, "mlx5_0", "ports", "1", "counters")
    with open(os.path.join(counters, "symbol_error"), "w") as f:
        f.write("N/A\n")
    os.remove(os.path.join(counters, "link_downed"))
    os.mkdir(os.path.join(counters, "link_downed"))  # read fails with an OSError, as an unreadable file would
    with caplog.at_level(logging.WARNING, logger="ingest.port_counters"):
        for _ in range(3):
            rows = {r["device"]: r for r in s.sample()}
    assert rows["mlx5_0"]["symbol_errors"] == -1 and rows["mlx5_0"]["link_downed"] == -1
    assert rows["mlx5_0"]["xmit_wait"] == 0 and rows["mlx5_1"]["symbol_errors"] == 0  # the rest as usual
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("skipped" in m for m in said), said
    assert s.skipped == 6


def test_a_host_without_infiniband_samples_nothing_and_says_so_once(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ingest.port_counters"):
        for root in (str(tmp_path / "absent"), str(tmp_path)):
            s = PortCounterSampler(root, clock=Clock(), rescan_s=0.0)  # rescanned every time: still said once
            assert [s.sample() for _ in range(5)] == [[]] * 5
            assert s.unavailable.startswith("no InfiniBand/RoCE port counters under")
    assert len([r for r in caplog.records if "not sampled" in r.getMessage()]) == 2  # once per sampler


def test_the_root_comes_from_the_environment_and_one_rank_per_host_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("STRAGGLERSCOPE_SYSFS_IB", str(tmp_path))
    assert PortCounterSampler().root == str(tmp_path)
    assert reports_ports({}) and reports_ports({"LOCAL_RANK": "0"})
    assert not reports_ports({"LOCAL_RANK": "3"}) and not reports_ports({"LOCAL_RANK": "x"})


def test_slow_reads_back_off_to_a_duty_cycle(tmp_path):
    root = str(tmp_path / "ib")
    host_tree(root)
    clock = Clock()
    s = PortCounterSampler(root, clock=clock, timer=Clock(step_s=0.05))  # a reading takes 50 ms: a driver that asks
    # its firmware on every read
    s.sample()
    assert s.sample() == []  # not before cost / MAX_DUTY (seconds) later
    clock.t += 3600 * SEC
    assert len(s.sample()) == 2


# -- the exporter -----------------------------------------------------------------------------------------------

def test_the_exporter_sends_the_ports_after_each_heartbeat_and_never_fails_on_them(tmp_path):
    root = str(tmp_path / "ib")
    host_tree(root)
    got = []
    exp = RankExporter("j", 4, 0, 0, got.append, heartbeat_s=3600, use_cuda=False, tcp_flows=False, nvml=False,
                       host="h1", port_counters=PortCounterSampler(root, clock=Clock()))
    exp._beat()
    host_tree(root, link_downed=3)
    exp._beat()
    ports = [t for t in got if S.kind_of(t.schema) == "port_counter"]
    assert len(ports) == 1 and ports[0].num_rows == 2 and exp.stats.port_counters == 2
    r = ports[0].to_pylist()[0]
    assert (r["job_id"], r["rank"], r["host"], r["device"], r["link_downed"]) == ("j", 4, "h1", "mlx5_0", 3)
    assert [S.kind_of(t.schema) for t in got] == ["heartbeat", "heartbeat", "port_counter"]

    class Broken:
        def sample(self):
            raise RuntimeError("sysfs went away")
    got.clear()
    exp._ports = Broken()
    exp._beat()
    assert [S.kind_of(t.schema) for t in got] == ["heartbeat"] and exp.stats.errors == 1
    exp._ports = None
    exp.close()
    off = RankExporter("j", 1, 0, 0, got.append, heartbeat_s=3600, use_cuda=False, tcp_flows=False, nvml=False,
                       port_counters=False)
    assert off._ports is None
    off.close()


# -- the shard --------------------------------------------------------------------------------------------------

def rows_of(host, t_s, device="mlx5_0", **counts):
    base = dict(job_id="j", attempt=0, rank=0, host=host, device=device, port=1, ts_ns=T0 + t_s * SEC,
                elapsed_ns=2 * SEC, state="ACTIVE", xmit_wait=0, xmit_discards=0, rcv_discards=-1, symbol_errors=0,
                rcv_errors=0, link_downed=0, link_error_recovery=0, xmit_bytes=10**9, rcv_bytes=10**9,
                hw_counters_json='{"out_of_buffer":1}', reset=False)
    return dict(base, **counts)


def test_the_reducer_stores_a_sum_a_minute_per_port_and_keeps_the_raw_rows_for_evidence():
    red = PortCounterReducer(every_s=60.0)
    at = (("ss.heartbeats", 0), 1)
    for i in range(30):  # a heartbeat every 2 s for a minute
        red.add("port_counter", codec.from_rows(S.PORT_COUNTER, [rows_of("h1", 2 * i, symbol_errors=i % 2)]), at,
                now=2.0 * i)
    (unit,) = red.due(60.0)
    (row,) = unit.tables["port_counter"].to_pylist()
    assert row["elapsed_ns"] == 60 * SEC and row["symbol_errors"] == 15 and row["rcv_discards"] == -1
    assert row["xmit_bytes"] == 30 * 10**9 and row["hw_counters_json"] == '{"out_of_buffer":30}'
    assert row["ts_ns"] == T0 + 58 * SEC
    red.add("port_counter", unit.tables["port_counter"], None, now=60.0)  # fed back by the shard: not input
    assert red.due(200.0) == []
    assert len(red.ports_of(["h1"], T0 + 10 * SEC, T0 + 20 * SEC)) == 5 and red.ports_of(["h2"]) == []


def test_the_boundary_refuses_impossible_port_rows():
    good = rows_of("h1", 0)
    bad = [dict(good, xmit_wait=-5), dict(good, device=""), dict(good, elapsed_ns=-1),
           dict(good, hw_counters_json="x" * 5000)]
    split = B.check_port_counters(codec.from_rows(S.PORT_COUNTER, [good] + bad), "j", None, ValidationConfig())
    assert split.good.num_rows == 1 and sum(n for n, _ in split.refused) == 4


# -- evidence ---------------------------------------------------------------------------------------------------

def window_rows():
    """A congested host, a flapping one and a healthy one, over a window of 10 s (heartbeats every 2 s)."""
    rows = []
    for i in range(5):
        rows.append(rows_of("h1", 2 * i, xmit_wait=240_000_000))  # waits 12% of each 2 s at 1 ns a tick
        rows.append(rows_of("h2", 2 * i, link_downed=1 if i in (1, 2, 4) else 0, link_error_recovery=2,
                            symbol_errors=28))
        rows.append(rows_of("h3", 2 * i, xmit_wait=1_000))
    return rows


def test_each_host_gets_a_short_verdict_of_its_ports_in_the_window():
    v = host_verdicts(window_rows(), T0 - 2 * SEC, T0 + 8 * SEC, hosts=["h1", "h2", "h3", "h4"])
    assert v["h1"].problem and v["h1"].sentence == "port mlx5_0/1 of host h1: transmit waits 12% of the window"
    assert v["h2"].problem and v["h2"].sentence == ("port mlx5_0/1 of host h2: link downed 3 times, "
                                                    "10 link recoveries, 140 symbol errors")
    assert not v["h3"].problem and v["h3"].sentence == "ports of host h3: no waits or errors (1 port)"
    assert not v["h4"].problem and v["h4"].sentence == "ports of host h4: not sampled"
    assert not host_verdicts(window_rows(), T0 - 2 * SEC, T0 + 8 * SEC, params=FabricParams(wait_share=0.2))["h1"].problem


def test_a_link_finding_on_a_host_whose_port_waits_or_errs_says_so():
    faults = [LinkFault("dp", "link", 0, 2, 0.95, 4.0, {"cells": []}), LinkFault("dp", "link", 4, 5, 0.9, 3.0, {})]
    rank_hosts = {0: "h1", 1: "h1", 2: "h2", 3: "h2", 4: "h3", 5: "h3"}
    out = with_fabric_evidence(faults, window_rows(), rank_hosts, T0 - 2 * SEC, T0 + 8 * SEC)
    first, second = fault_table(out, ("j", 0, 0)).to_pylist()
    ev = json.loads(first["evidence_json"])
    assert ev["cells"] == [] and [f["host"] for f in ev["fabric"]] == ["h1", "h2"] and ev["fabric"][0]["ranks"] == [0]
    said = explain.link_sentence(first)
    assert "; port mlx5_0/1 of host h1: transmit waits 12% of the window; port mlx5_0/1 of host h2: link downed " \
           "3 times" in said, said
    assert second["evidence_json"] == "{}"  # h3 is healthy: nothing added
    assert with_fabric_evidence(faults, [], rank_hosts) is faults


def test_the_window_analysis_puts_the_ports_of_a_link_finding_s_hosts_into_its_evidence():
    """The shard hands the window's analysis its ranks' hosts and their port rows (``WindowContext``): the slow
    NIC's host, whose link flapped during the window, is said in the finding; a host without trouble is not."""
    from analyzers.window import WindowContext, analyze_window
    from core.layout import JobLayout
    from core.registration import Registration
    from generators.faultgen import link_incident

    inc = link_incident("source", 8, 2)
    culprit = inc.truth["src"]
    enter = inc.ccl["enter_ns"].to_numpy()
    shift = int(enter.min()) - (T0 - 2 * SEC)  # the port rows' window onto the records' own clock
    rows = tuple(dict(r, ts_ns=r["ts_ns"] + shift) for r in window_rows() if r["host"] == "h2")
    rank_hosts = {r: ("h2" if r == culprit else f"ok{r}") for r in range(8)}
    reg = Registration("linkjob", 0, JobLayout(dp_size=8, pp_size=1), 1)
    tables = analyze_window(codec.empty(S.OP_SPAN), reg, ("linkjob", 0, 0), True, "", inc.ccl,
                            context=WindowContext(rank_hosts=rank_hosts, port_rows=rows))
    top = max(tables["link_fault"].to_pylist(), key=lambda r: r["confidence"])
    assert (top["kind"], top["src"]) == ("source", culprit), top
    fabric = json.loads(top["evidence_json"])["fabric"]
    # The records span well under a second: the one port reading that covers it is what is said.
    assert [f["host"] for f in fabric] == ["h2"] and "symbol errors" in fabric[0]["sentence"], fabric
    assert "port mlx5_0/1 of host h2: 2 link recoveries, 28 symbol errors" in explain.link_sentence(top)


def test_port_errors_add_to_the_lemon_host_score():
    incidents = []
    for j in range(4):  # h2's link flaps under four jobs; h1 is only congested (not its fault)
        rows = [dict(r, job_id=f"job-{j}") for r in window_rows()]
        incidents += port_incidents(rows)
    assert {i.host for i in incidents} == {"h2"} and {i.kind for i in incidents} == {"port_errors"}
    assert incidents[0].what.startswith("port mlx5_0/1: link downed 3 times")
    scores = lemon_hosts(incidents, {"h1": 10.0, "h2": 10.0, "h3": 10.0} | {f"x{i}": 10.0 for i in range(200)},
                         LemonParams(min_jobs=3, max_p=1e-3))
    assert scores[0].host == "h2" and scores[0].lemon and scores[0].jobs == 4


def test_the_lemon_watch_reads_port_errors_from_the_store():
    from ray_jobs.lemon_watch import LemonWatch

    class Store:
        def run_named(self, name, params):
            if name == "lemon_port_errors":
                return pa.Table.from_pylist([dict(job_id="a", attempt=0, host="h2", device="mlx5_0", port=1,
                                                  ts_ns=T0, elapsed_ns=60 * SEC, link_downed=2, symbol_errors=0,
                                                  rcv_errors=-1, xmit_wait=5)])
            return pa.table({})
    incidents, _ = LemonWatch(Store()).incidents(0, T0 * 2)
    assert [(i.host, i.kind, i.what) for i in incidents] == [("h2", "port_errors", "port mlx5_0/1: link downed 2 times")]


def test_the_job_pages_fabric_panel_words_the_ports_it_is_given():
    import pandas as pd

    from analyzers.fabric import by_port
    from ui.fabric_view import port_panel

    summed = [dict(p, hw_counters_json="{}") for p in by_port(window_rows()).values()]
    said, table = port_panel(pd.DataFrame(summed))
    assert said == ["port mlx5_0/1 of host h1: transmit waits 12% of the window",
                    "port mlx5_0/1 of host h2: link downed 3 times, 10 link recoveries, 140 symbol errors"]
    assert table["host"].tolist() == ["h1", "h2", "h3"] and table["transmit waits"].tolist()[0] == "12.0%"
    assert table["discards"].tolist() == [0, 0, 0] and table["sent GB"].tolist() == [5.0, 5.0, 5.0]
    assert port_panel(pd.DataFrame())[1].empty
