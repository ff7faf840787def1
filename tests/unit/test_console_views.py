"""The console's pure parts: readable times and tables (ui/readable.py) and the hang picture (ui/hang_view.py)."""
import json
import re

import pandas as pd
import pytest

from ui import hang_view as H
from ui import readable as R

NOW = 1_795_826_404_417_431_284  # 2026-11-28 00:40:04 UTC
MIN = 60 * 10**9


@pytest.mark.parametrize("back_s, text", [(2, "just now"), (42, "42 s ago"), (180, "3 min ago"), (5 * 3600, "5 h ago"),
                                          (3 * 86400, "3 days ago"), (-200, "in 3 min")])
def test_ages(back_s, text):
    assert R.ago(NOW - back_s * 10**9, NOW) == text


def test_clock_times_in_the_viewers_zone_and_utc():
    assert R.clock(NOW - MIN, NOW) == "00:39:04 UTC"
    assert R.clock(NOW - MIN, NOW, "Europe/Berlin") == "01:39:04 CET · 00:39:04 UTC"
    assert R.clock(NOW - MIN, NOW, "UTC") == R.clock(NOW - MIN, NOW, "Not/AZone") == "00:39:04 UTC"
    assert R.clock(NOW - 2 * 86400 * 10**9, NOW) == "Nov 26, 00:40 UTC"  # not today: the date too
    assert R.clock(NOW - 400 * 86400 * 10**9, NOW) == "2025-10-24 00:40 UTC"
    assert R.when(NOW - 3 * MIN, NOW) == "3 min ago (00:37:04 UTC)"


def test_readable_frames_show_wall_clock_ns_as_times_and_leave_other_numbers():
    df = pd.DataFrame({"ts_ns": [NOW, NOW - MIN], "acked_ns": [0, NOW], "since_ns": [699_999_000_000, 5],
                       "hang_id": [NOW, NOW], "duration_ns": [10**9, 2 * 10**9], "n": [1, 2]})
    out = R.readable_frame(df)
    assert list(out.columns) == ["ts (UTC)", "acked (UTC)", "since_ns", "hang_id (UTC)", "duration_ns", "n"]
    assert str(out["ts (UTC)"].iloc[1]) == "2026-11-28 00:39:04"
    assert pd.isna(out["acked (UTC)"].iloc[0])  # not acknowledged: a blank, not 1970
    assert out["since_ns"].tolist() == [699_999_000_000, 5] and "ts_ns" in df.columns  # a copy


def test_an_alert_leads_to_its_window_or_hang():
    slow = {"alert_id": "j/0/slowdown/30", "job_id": "j", "attempt": 0, "rule": "slowdown", "summary": "j: S=1.3",
            "details_json": json.dumps({"window_id": 30})}
    assert R.alert_target(slow) == {"job": "j", "attempt": "0", "window": "30", "alert": "j/0/slowdown/30"}
    assert R.alert_subject(slow) == "window\u00a030" and R.alert_text(slow) == "S=1.3"
    failed = dict(slow, alert_id="j/1/analysis_failed/40", attempt=1, rule="analysis_failed", details_json="{}")
    assert R.alert_target(failed)["window"] == "40" and R.alert_target(failed)["attempt"] == "1"
    hang = dict(slow, alert_id=f"j/0/hang/{NOW}", rule="hang", details_json="{}")
    assert R.alert_target(hang)["hang"] == str(NOW) and R.alert_subject(hang) == "hang"
    assert R.alert_subject(dict(hang, rule="node_loss", alert_id="j/0/node_loss/7")) == "node loss"
    assert R.md_escape("last_stage_imbalance in ranks:0-3 [x]") == "last\\_stage\\_imbalance in ranks\\:0-3 \\[x\\]"


def _tracked(kind: str, n: int, job: str = "h"):
    """A HANG row as the hang monitor makes it, from a generated incident."""
    from analyzers.hang import HangParams, HangTracker, to_tables
    from generators.faultgen import hang_incident

    inc = hang_incident(kind, n, 1, job_id=job)
    tr = HangTracker(job, params=HangParams(floor_s=60))
    tr.add_ccl(inc.ccl)
    tr.add_heartbeats(inc.heartbeats)
    return to_tables([tr.evaluate(inc.now_ns, input_alive=True)], NOW)["hang"].to_pylist()[0], inc.truth


def test_the_picture_of_a_communication_hang_outlines_who_never_entered():
    row, truth = _tracked("comm_hang", 64)
    pic = H.picture(row, {"dp_size": 8, "pp_size": 2, "tp_size": 4, "cp_size": 1})
    assert not pic.folded and len(pic.cells) == 64 and pic.culprits == truth["missing"]
    [culprit] = [c for c in pic.cells if c.culprit]
    assert culprit.state == "never_entered" and "never entered all_reduce #" in culprit.detail
    assert {c.state for c in pic.cells if not c.culprit} == {"waiting"}
    svg = H.grid_svg(pic, row["op"])
    assert svg.count('class="cell culprit"') == 1 and svg.count('class="culprit-outline"') == 1
    assert f'data-ranks="{truth["missing"][0]}" data-state="never_entered"' in svg
    # One arrow per waiting worker (16 workers, the culprit's own worker included), to the culprit.
    arrows = re.findall(r'class="wait-arrow" data-from="[^"]*" data-to="(\d+)"', svg)
    assert len(arrows) == 16 and set(arrows) == {str(truth["missing"][0])}
    assert "never entered all_reduce" in svg and "· 63</text>" in svg  # the legend counts the waiting ranks


def test_the_picture_of_a_node_loss_and_of_a_hang_outside_collectives():
    row, truth = _tracked("node_loss", 32)
    pic = H.picture(row, {"dp_size": 4, "pp_size": 2, "tp_size": 4, "cp_size": 1})
    assert pic.culprits == truth["missing"] and {c.state for c in pic.cells if c.culprit} == {"lost"}
    assert pic.collective.startswith("all_reduce #")  # the collective the others wait in
    row, truth = _tracked("noncomm_hang", 16)
    pic = H.picture(row, None)  # no registration stored: one row of ranks
    assert pic.sizes == {"dp": 16, "pp": 1, "tp": 1, "cp": 1}
    [c] = [c for c in pic.cells if c.culprit]
    assert c.ranks == tuple(truth["stuck"]) and c.state == "suspect" and "data-loading" in c.detail


def test_a_wide_job_folds_its_tp_ranks_into_workers_and_samples_its_arrows():
    row, truth = _tracked("comm_hang", 1024)
    pic = H.picture(row, {"dp_size": 32, "pp_size": 4, "tp_size": 8, "cp_size": 1})
    assert pic.folded and len(pic.cells) == 128
    [c] = [c for c in pic.cells if c.culprit]
    assert truth["missing"][0] in c.ranks and c.state == "never_entered" and "7 waiting in all_reduce" in c.detail
    svg = H.grid_svg(pic, row["op"])
    assert svg.count('class="wait-arrow"') == H.MAX_ARROWS


def test_the_flame_graph_names_the_ranks_without_a_stack():
    from analyzers.stacks import merge_stacks

    stacks = {0: "MainThread;train;step;all_reduce\nhelper;poll", 2: "MainThread;train;step;all_reduce\nhelper;poll",
              3: "MainThread;train;backward;recv\nhelper;poll"}
    svg = H.flame_svg(merge_stacks(stacks, all_ranks=[0, 1, 2, 3]).folded(), width=400)
    assert svg.startswith("<svg") and "no stack from rank 1" in svg
    assert svg.index(">MainThread<") < svg.index(">helper<")  # the main thread's band first
    assert "all_reduce [ranks 0,2 | not 1,3]" in svg  # the hover names who is in a frame and who is not
    assert H.flame_svg("") == ""


def test_a_huge_data_parallel_job_keeps_its_picture_small():
    row, truth = _tracked("comm_hang", 8192)
    pic = H.picture(row, {"dp_size": 8192, "pp_size": 1, "tp_size": 1, "cp_size": 1})
    svg = H.grid_svg(pic, row["op"])
    assert len(pic.cells) == 8192 and len(svg) < 1_200_000
    assert f'data-ranks="{truth["missing"][0]}" data-state="never_entered"' in svg


def test_the_flight_recorder_reads_as_a_row_per_rank_and_group():
    ev = {"flight_recorder": {"1": {"groups": {"default_pg": {"enqueued": 3, "started": -1, "completed": 2}},
                                    "pending": [{"group": "default_pg", "seq": 3, "op": "nccl:all_reduce",
                                                 "state": "scheduled"}]},
                              "0": "not a dump"}}
    assert H.recorder_rows(ev) == [{"rank": "1", "group": "default_pg", "enqueued": 3, "started": -1, "completed": 2,
                                    "not completed": "nccl:all_reduce #3 (scheduled)"}]
    assert H.recorder_rows({}) == [] and H.recorder_rows({"flight_recorder": None}) == []
