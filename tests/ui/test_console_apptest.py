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
