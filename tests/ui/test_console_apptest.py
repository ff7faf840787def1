"""Every console page's logic with Streamlit's AppTest over a demo store (no browser)."""
import re
from pathlib import Path

import pytest

from tests.ui.conftest import RAW_TIME

pytestmark = pytest.mark.integration  # real chDB store

APP = str(Path(__file__).resolve().parents[2] / "ui" / "app.py")
PAGES = [None, "pages/alerts.py", "pages/job.py", "pages/sql.py"]


@pytest.fixture
def app(demo_store_url, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("STRAGGLERSCOPE_STORE", demo_store_url)
    at = AppTest.from_file(APP, default_timeout=60)
    return at


def _text(at) -> str:
    parts = [m.value for m in at.markdown] + [str(m.value) for m in at.metric] + [t.value for t in at.title]
    parts += [s.value for s in at.subheader] + [c.value for c in at.caption] + [i.value for i in at.info]
    return "\n".join(str(p) for p in parts)


def _alert_ids(url: str, **params) -> list[str]:
    """The alerts' ids, newest first, as the alerts page lists them (ids are not shown to readers)."""
    from storage import open_store

    return open_store(url).run_named("alert_history", params).column("alert_id").to_pylist()


def _raw_times(at) -> list[str]:
    """19-digit numbers (ns since the epoch) anywhere a reader sees them: text, metrics, tables."""
    found = re.findall(RAW_TIME, _text(at))
    for df in (d.value for d in at.dataframe):
        for col in df.columns:
            if df[col].dtype.kind in "iu" and len(df) and (df[col].abs() >= 10**18).any():
                found.append(f"{col}: {df[col].iloc[0]}")
    return found


def test_fleet_page(app):
    at = app.run()
    assert not at.exception, at.exception
    labels = {m.label: m.value for m in at.metric}
    assert labels["Jobs analysed"] == "12"
    assert labels["Windows"] == "24"
    assert float(labels["Mean S"]) > 1.0
    assert at.dataframe, "top wasting jobs are listed"
    assert "CDF of straggler slowdown S" in _text(at)
    # Stragglers and fault downtime side by side, and MFU from the registrations' FLOPs.
    assert int(labels["Fault incidents"]) > 0 and labels["Fault downtime GPU-hours"] != "–"
    assert labels["Downtime from detection + diagnosis"].endswith("%")
    assert any(c.value.startswith("12 jobs · median MFU ≈ 0.") for c in at.caption), [c.value for c in at.caption]


def test_no_page_shows_raw_nanoseconds(app):
    at = app.run()
    for page in PAGES[1:]:
        at.switch_page(page).run()
        assert not at.exception, (page, at.exception)
        assert _raw_times(at) == [], page
    at.switch_page("pages/job.py").run()
    at.selectbox(key="job").set_value("ui-002").run()  # a job with a hang: its detection time is an id too
    assert not at.exception and _raw_times(at) == []


def test_alerts_page_reads_at_a_glance(app):
    at = app.run()
    at.switch_page("pages/alerts.py").run()
    assert not at.exception, at.exception
    text = _text(at)
    # When (an age and a clock time), severity, job, what happened (whole), rule.
    assert re.search(r"\*\*(just now|\d+ s ago)\*\*", text), text[:2000]
    assert re.search(r"\d\d:\d\d:\d\d UTC", text)
    assert {"straggling", "hang", "slow link", "node loss"} <= {m.value for m in at.markdown}
    assert any(m.value.startswith("communication hang in all\\_reduce") for m in at.markdown)
    assert "20 alerts" in text
    # Filters: a rule, and a time range that leaves nothing out of a store filled seconds ago.
    at.selectbox(key="alert_rule").set_value("hang").run()
    assert "1 alerts" in _text(at) and "ui-002" not in _text(at).split("What happened")[0]
    at.selectbox(key="alert_rule").set_value("all").run()
    at.selectbox(key="alert_range").set_value("last hour").run()
    assert "20 alerts" in _text(at)


def test_acknowledgements_are_stored_and_survive_a_new_session(app, demo_store_url, monkeypatch):
    from streamlit.testing.v1 import AppTest

    at = app.run()
    at.switch_page("pages/alerts.py").run()
    first = _alert_ids(demo_store_url, acked=0)[0]
    at.multiselect(key="ack_pick").set_value([first]).run()
    at.text_input(key="ack_by").set_value("alice").run()
    at.text_input(key="ack_note").set_value("drained host-3").run()
    next(b for b in at.button if b.label == "Acknowledge selected").click().run()
    assert not at.exception, at.exception
    assert first not in _alert_ids(demo_store_url, acked=0)
    # Another on-call's console (a new session) no longer lists it as open...
    other = AppTest.from_file(APP, default_timeout=60).run()
    other.switch_page("pages/alerts.py").run()
    assert "19 alerts" in _text(other)
    # ...and shows who acknowledged it when asked; re-opening restores it.
    next(t for t in other.toggle if t.label == "Show acknowledged").set_value(True).run()
    assert "20 alerts" in _text(other)
    assert any(re.fullmatch(r"acknowledged by alice (just now|\d+ s ago)\\: drained host-3", c.value)
               for c in other.caption), [c.value for c in other.caption]
    other.multiselect(key="ack_pick").set_value([first]).run()
    next(b for b in other.button if b.label == "Re-open selected").click().run()
    next(t for t in other.toggle if t.label == "Show acknowledged").set_value(False).run()
    assert first in _alert_ids(demo_store_url, acked=0) and "20 alerts" in _text(other)


def test_an_alerts_query_parameters_open_its_job_at_its_window(app, demo_store_url):
    from tests.ui.conftest import cause_of

    job = next(j for j, c in cause_of().items() if c == "seq_imbalance")
    alert = next(a for a in _alert_ids(demo_store_url, job_id=job, rule="slowdown") if a.endswith("/0"))
    at = app.run()
    at.query_params.update(job=job, attempt="0", window="0", alert=alert)
    at.switch_page("pages/job.py").run()
    assert not at.exception, at.exception
    assert at.selectbox(key="job").value == job
    assert at.selectbox(key="window_pick").value == "0/0"
    assert any(i.value.startswith("**From the alert of ") and "in window 0" in i.value for i in at.info)
    text = _text(at)
    assert "**Main cause: Uneven sequence lengths**" in text
    assert re.search(r"correlation r = 0\.\d{3} over \d+ microbatches", text)
    # The history of the job's windows, and the job's own alerts.
    heads = [h.value for h in at.subheader]
    assert "History" in heads and "Alerts (2)" in heads, heads


def test_job_page_shows_stored_remedies_and_per_step_heatmaps(app):
    from tests.ui.conftest import cause_of

    at = app.run()
    at.switch_page("pages/job.py").run()
    job = next(j for j, c in cause_of().items() if c == "slow_worker")
    at.selectbox(key="job").set_value(job).run()
    assert not at.exception, at.exception
    labels = [e.label for e in at.expander]
    assert any(lab.startswith("1. Swap the slow host, for: slow worker · ") for lab in labels), labels
    assert "Main cause: Slow worker" in _text(at)
    steps = [o for o in at.selectbox(key="heat_step").options if o.startswith("step ")]
    at.selectbox(key="heat_step").set_value(steps[0]).run()
    assert not at.exception and not any("No per-step worker cells" in i.value for i in at.info)


def test_job_page_shows_the_run_time_changes_made_for_the_job_and_the_fleet(app):
    at = app.run()
    at.switch_page("pages/job.py").run()
    at.selectbox(key="job").set_value("ui-003").run()
    assert not at.exception, at.exception
    assert "Run-time changes (4)" in [s.value for s in at.subheader]
    [df] = [d.value for d in at.dataframe if "settings" in d.value.columns]
    rows = {r["settings"] or r["state"]: r for r in df.to_dict("records")}
    assert rows["sample=1/1"]["who"] == "alice" and rows["sample=1/1"]["for"] == "this job"
    assert rows["sample=1/1"]["state"].startswith("in force until ") and rows["sample=1/1"]["from step"] == "1200"
    # The job's 5/10 of before: replaced by the later change of its setting, not in force beside it.
    assert rows["sample=5/10"]["state"] == f"replaced by {rows['sample=1/1']['change']}"
    assert rows["hang_min_s=30.0"]["state"] == "cleared" and rows["hang_min_s=30.0"]["for"] == "the fleet"
    assert rows["hang_min_s=30.0"]["from step"] == "next"  # the fleet's: each rank's next step end
    at.selectbox(key="job").set_value("ui-004").run()  # another job sees the fleet's changes only
    assert "Run-time changes (2)" in [s.value for s in at.subheader]


def test_job_page_timeline_of_actual_vs_ideal(app):
    at = app.run()
    at.switch_page("pages/job.py").run()
    at.selectbox(key="job").set_value("ui-000").run()
    at.toggle(key="tl_on").set_value(True).run()
    assert not at.exception, at.exception
    cap = next(c.value for c in at.caption if c.value.startswith("step "))
    actual, ideal = (float(cap.split(f"{k} ")[1].split(" ms")[0]) for k in ("actual", "ideal"))
    assert ideal <= actual * 1.001, cap  # the ideal never takes longer than what ran


def test_job_page_shows_heatmap_verdicts_links_and_hangs(app):
    at = app.run()
    at.switch_page("pages/job.py").run()
    assert not at.exception, at.exception
    at.selectbox(key="job").set_value("ui-001").run()
    assert not at.exception, at.exception
    text = _text(at)
    assert "Worker slowdown" in text and "Per-step slowdown" in text
    assert "Link matrix" in text
    # ui-001's windows each carry the same slow link: the job's one answer leads the section (issue 52).
    assert re.search(r"\*\*This job:\*\* The link from rank \d+ to rank \d+, in \d+ of \d+ windows? with a finding "
                     r"since window \d+", text), text
    at.selectbox(key="job").set_value("ui-002").run()
    text = _text(at)
    assert "Hang" in [s.value for s in at.subheader]
    assert "**Communication hang**, detected " in text
    assert re.search(r"63 ranks have waited in all\\_reduce \\#\d+ of group world for 5 min; rank \d+ \(dp \d+, "
                     r"pp \d+, tp \d+\) on node-\d+ never entered it\\: it is the culprit\.", text), text
    recorded = [d.value for d in at.dataframe if "not completed" in d.value.columns]
    assert recorded and recorded[0]["not completed"].tolist() == ["nccl:all_reduce #8 (started)"], recorded
    # The node loss of another job: its lost ranks named with their host.
    at.selectbox(key="job").set_value("ui-007").run()
    assert "**Node loss**, detected " in _text(at)
    assert re.search(r"ranks \d+-\d+ on node-\d+ stopped sending heartbeats", _text(at))


def test_sql_page_runs_named_and_refuses_writes(app):
    at = app.run()
    at.switch_page("pages/sql.py").run()
    assert not at.exception, at.exception
    assert at.dataframe, "the default named query shows a table"
    at.selectbox[0].set_value("alert_history").run()
    assert "ts (UTC)" in at.dataframe[0].value.columns  # nanoseconds shown as times
    at.text_area[0].set_value("DROP TABLE windows").run()
    at.button[0].click().run()
    assert at.error, "a write is refused with an error"


def test_job_page_shows_a_regression_against_its_own_past(app):
    """A stored regression: its sentence under the history, a mark at its window, the op types before and after."""
    at = app.run()
    at.switch_page("pages/job.py").run()
    at.selectbox(key="job").set_value("ui-003").run()
    assert not at.exception, at.exception
    text = _text(at)
    assert "**Against its own past** (1 change, newest first)" in text, text
    plain = text.replace("\\", "")  # the page escapes Markdown's special characters
    assert "step time +18% since window" in plain and "compute unchanged: communication" in plain, plain
    assert any(c.value.startswith("Op types, seconds per step") for c in at.caption)
    at.selectbox(key="job").set_value("ui-000").run()
    assert any(c.value.startswith("No regression against this job's own past") for c in at.caption)


def test_hosts_page_names_the_lemon_with_its_evidence(app):
    at = app.run()
    at.switch_page("pages/hosts.py").run()
    assert not at.exception, at.exception
    assert [m.value for m in at.metric][:2] == ["1", "2"]
    labels = [e.label for e in at.expander]
    assert labels[0] == "🍋 node-07 (switch-2): 3 jobs, 3 findings", labels
    text = _text(at).replace("\\", "")
    assert "[ui-005](/job?job=ui-005&attempt=0) · node loss · node loss for 300 s" in text, text
    assert "By rack or switch" in [s.value for s in at.subheader]
