"""Every console page's logic with Streamlit's AppTest over a demo store (no browser)."""
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # real chDB store

APP = str(Path(__file__).resolve().parents[2] / "ui" / "app.py")


@pytest.fixture
def app(demo_store_url, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("STRAGGLERSCOPE_STORE", demo_store_url)
    at = AppTest.from_file(APP, default_timeout=60)
    return at


def _text(at) -> str:
    parts = [m.value for m in at.markdown] + [str(m.value) for m in at.metric] + [t.value for t in at.title]
    parts += [s.value for s in at.subheader] + [c.value for c in at.caption]
    return "\n".join(str(p) for p in parts)


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


def test_alerts_page(app):
    at = app.run()
    at.switch_page("pages/alerts.py").run()
    assert not at.exception, at.exception
    df = at.dataframe[0].value
    assert {"slowdown", "hang", "link"} <= set(df["rule"])


def test_acknowledgements_are_stored_and_survive_a_new_session(app, demo_store_url, monkeypatch):
    from streamlit.testing.v1 import AppTest

    at = app.run()
    at.switch_page("pages/alerts.py").run()
    first = at.dataframe[0].value["alert_id"].iloc[0]
    at.multiselect[0].set_value([first]).run()
    at.text_input(key="ack_by").set_value("alice").run()
    at.text_input(key="ack_note").set_value("drained host-3").run()
    next(b for b in at.button if b.label == "Acknowledge selected").click().run()
    assert not at.exception, at.exception
    # Another on-call's console (a new session) no longer lists it as open...
    other = AppTest.from_file(APP, default_timeout=60).run()
    other.switch_page("pages/alerts.py").run()
    assert first not in set(other.dataframe[0].value["alert_id"])
    # ...and shows who acknowledged it when asked; re-opening restores it.
    next(t for t in other.toggle if t.label == "Show acknowledged").set_value(True).run()
    df = other.dataframe[0].value
    row = df[df["alert_id"] == first].iloc[0]
    assert (row["acked"], row["acked_by"], row["ack_note"]) == (1, "alice", "drained host-3")
    other.multiselect[0].set_value([first]).run()
    next(b for b in other.button if b.label == "Re-open selected").click().run()
    next(t for t in other.toggle if t.label == "Show acknowledged").set_value(False).run()
    assert first in set(other.dataframe[0].value["alert_id"])


def test_job_page_shows_stored_remedies_and_per_step_heatmaps(app):
    from tests.ui.conftest import cause_of

    at = app.run()
    at.switch_page("pages/job.py").run()
    job = next(j for j, c in cause_of().items() if c == "slow_worker")
    at.selectbox(key="job").set_value(job).run()
    assert not at.exception, at.exception
    labels = [e.label for e in at.expander]
    assert any(lab.startswith("1. swap_host (worker): +") for lab in labels), labels
    steps = [o for o in at.selectbox(key="heat_step").options if o.startswith("step ")]
    at.selectbox(key="heat_step").set_value(steps[0]).run()
    assert not at.exception and not any("No per-step worker cells" in i.value for i in at.info)


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
    at.selectbox(key="job").set_value("ui-002").run()
    assert "Hangs" in _text(at)
    assert any("communication hang" in str(e.label) for e in at.expander), [e.label for e in at.expander]


def test_sql_page_runs_named_and_refuses_writes(app):
    at = app.run()
    at.switch_page("pages/sql.py").run()
    assert not at.exception, at.exception
    assert at.dataframe, "the default named query shows a table"
    at.text_area[0].set_value("DROP TABLE windows").run()
    at.button[0].click().run()
    assert at.error, "a write is refused with an error"
