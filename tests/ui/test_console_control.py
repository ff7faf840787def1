"""The console's "Change at run time" form (issue 54) with Streamlit's AppTest over the demo store (no browser).

Nothing reaches Kafka: ``actions.control.publish`` is replaced by a recorder, as the command line's tests
do, so what the console would publish is what the recorder holds.
"""
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # real chDB store

APP = str(Path(__file__).resolve().parents[2] / "ui" / "app.py")
TOKEN = "s3cret-token-of-the-console"


@pytest.fixture
def published(monkeypatch):
    from actions import control

    sent = []
    monkeypatch.setattr(control, "publish", lambda conn, change: sent.append(change))
    return sent


@pytest.fixture
def console(demo_store_url, monkeypatch, tmp_path):
    """A console with control on (a Kafka address and a 0600 token file); ``console(False)``: read-only."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("STRAGGLERSCOPE_STORE", demo_store_url)
    monkeypatch.setenv("STRAGGLERSCOPE_KAFKA_BOOTSTRAP", "127.0.0.1:9")  # never dialled: publish is a recorder

    def start(control: bool = True, page: str = "pages/job.py", job: str = "ui-003"):
        if control:
            f = tmp_path / "control.token"
            f.write_text(TOKEN + "\n")
            f.chmod(0o600)
            monkeypatch.setenv("STRAGGLERSCOPE_UI_CONTROL_TOKEN_FILE", str(f))
        else:
            monkeypatch.delenv("STRAGGLERSCOPE_UI_CONTROL_TOKEN_FILE", raising=False)
        at = AppTest.from_file(APP, default_timeout=60).run()
        at.switch_page(page).run()
        if page == "pages/job.py":
            at.selectbox(key="job").set_value(job).run()
        assert not at.exception, at.exception
        return at

    return start


def _fill(at, prefix: str, token: str = TOKEN, who: str = "alice", **settings):
    for name, value in settings.items():
        at.text_input(key=f"{prefix}_{name}").set_value(value)
    at.text_input(key=f"{prefix}_who").set_value(who)
    at.text_input(key=f"{prefix}_token").set_value(token)
    return at


def _press(at, label: str):
    next(b for b in at.button if b.label == label).click().run()
    assert not at.exception, at.exception
    return at


def _errors(at) -> list[str]:
    return [e.value.replace("\\", "") for e in at.error]


def test_read_only_without_the_token_file(console, published):
    at = console(control=False)
    assert "Change at run time" not in [s.value for s in at.subheader]
    assert not [b for b in at.button if b.label == "Publish the change"]
    at.switch_page("pages/fleet.py").run()
    assert "Change at run time" not in [s.value for s in at.subheader] and published == []


def test_a_wrong_token_is_refused_and_nothing_is_published(console, published):
    at = _fill(console(), "ctl_job", token="guess", sample="1/1")
    _press(at, "Publish the change")
    assert _errors(at) == ["Refused: wrong control token.  \nNothing was published."]
    _press(_fill(at, "ctl_job", token=""), "Clear this job's changes")
    assert "Refused: wrong control token." in _errors(at)[0] and published == []


def test_a_right_token_publishes_exactly_the_change_asked_for(console, published):
    at = _fill(console(), "ctl_job", sample="1/1", hang_min_s="30")
    at.selectbox(key="ctl_job_profiling").set_value("pause (paused)")
    at.number_input(key="ctl_job_minutes").set_value(10)
    _press(at, "Publish the change")
    assert not at.error, _errors(at)
    [change] = published
    assert change.scope == "job:ui-003" and change.who == "alice"
    assert change.what == {"sample": "1/1", "hang_min_s": 30.0, "profiling": "paused"}
    assert change.until - change.when == 600 * 10**9
    assert at.success[0].value.replace("\\", "").startswith(f"Published change {change.change_id}: job:ui-003: ")
    # Clearing the job's changes is one record that clears every change of its scope.
    _press(at, "Clear this job's changes")
    assert [(c.scope, c.clears, c.what) for c in published[1:]] == [("job:ui-003", "*", {})]


def test_bad_input_is_refused_with_the_checks_reason(console, published):
    at = _press(_fill(console(), "ctl_job", sample="0/0", hang_min_s="30"), "Publish the change")
    [error] = _errors(at)
    assert error.startswith("Refused: sample 0/0: need 1 <= K <= N <= 1000000") and published == []
    # Nothing named, no name given, an unknown job: each refused in one line, nothing published.
    at = _press(_fill(at, "ctl_job", sample="", hang_min_s=""), "Publish the change")
    assert _errors(at)[0].startswith("Refused: the change sets nothing")
    at = _press(_fill(at, "ctl_job", who="  ", sample="5/10"), "Publish the change")
    assert _errors(at)[0].startswith("Refused: type your name")
    assert published == []


def test_the_fleet_page_changes_the_fleet_with_its_own_settings(console, published):
    at = console(page="pages/fleet.py")
    assert "Change at run time" in [s.value for s in at.subheader]
    _press(_fill(at, "ctl_fleet", lemons_min_jobs="5", heartbeat_s="2"), "Publish the change")
    assert not at.error, _errors(at)
    [change] = published
    assert change.scope == "fleet" and change.what == {"lemons_min_jobs": 5, "heartbeat_s": 2.0} and not change.until
    # A job's form leaves the fleet-only settings out: nothing would apply them for one job.
    at.switch_page("pages/job.py").run()
    keys = {t.key for t in at.text_input}
    assert "ctl_job_hang_min_s" in keys and "ctl_job_lemons_min_jobs" not in keys


def test_a_token_file_open_to_others_keeps_control_off(console, published, tmp_path):
    at = console()
    (tmp_path / "control.token").chmod(0o644)
    at.run()
    assert any("is open to other users" in w.value.replace("\\", "") for w in at.warning)
    assert not [b for b in at.button if b.label == "Publish the change"] and published == []
