"""The console's run-time control switch (issue 54): the token file, the constant-time match, and what the console
process is told of the configuration."""
from __future__ import annotations

import pytest

from core.config import Config
from core.control import ControlError
from actions.control import console_control_off, read_console_token, token_matches


def _token(tmp_path, text: str = "tok-123\n", mode: int = 0o600) -> str:
    f = tmp_path / "console.token"
    f.write_text(text)
    f.chmod(mode)
    return str(f)


def test_the_token_is_the_file_s_text_and_must_match_whole(tmp_path):
    path = _token(tmp_path)
    assert read_console_token(path) == "tok-123"
    assert token_matches("tok-123", path) and token_matches(" tok-123 ", path)
    assert not token_matches("tok-12", path) and not token_matches("", path) and not token_matches("tok-1234", path)


@pytest.mark.parametrize("text, mode, why", [
    ("  \n", 0o600, "must hold one token"),  # an empty token would match an empty field
    ("tok", 0o644, "open to other users (mode 0644): chmod 600"),
    ("x" * 5000, 0o600, "must hold one token"),
])
def test_a_token_file_that_cannot_be_trusted_is_refused(tmp_path, text, mode, why):
    path = _token(tmp_path, text, mode)
    with pytest.raises(ControlError, match=why.replace("(", r"\(").replace(")", r"\)")):
        token_matches("tok", path)


def test_control_is_off_unless_kafka_and_a_usable_token_file_are_configured(tmp_path):
    assert "the console is read-only" in console_control_off(Config())
    path = _token(tmp_path)
    assert "needs the fleet's Kafka" in console_control_off(Config().replace(ui={"control_token_file": path}))
    on = Config().replace(ui={"control_token_file": path}, kafka={"bootstrap": "k:9092"})
    assert console_control_off(on) == ""
    missing = on.replace(ui={"control_token_file": str(tmp_path / "nope")})
    assert console_control_off(missing).startswith("cannot read the console's control token file")


def test_the_console_process_gets_the_kafka_and_ui_keys_but_no_secret(tmp_path):
    """Streamlit's script cannot take --config: what control needs travels as STRAGGLERSCOPE_* variables, which its
    ``load()`` reads back to the same values."""
    from core.config import load
    from stragglerscope.demo import console_env

    path = _token(tmp_path)
    cfg = Config().replace(kafka={"bootstrap": "k:9092", "ssl_check_hostname": False, "sasl_password": "pw"},
                           ui={"control_token_file": path})
    env = console_env(cfg)
    assert env["STRAGGLERSCOPE_UI_CONTROL_TOKEN_FILE"] == path
    assert "STRAGGLERSCOPE_KAFKA_SASL_PASSWORD" not in env and "pw" not in env.values()
    back = load(env=env)
    assert (back.kafka.bootstrap, back.kafka.ssl_check_hostname, back.ui) == ("k:9092", False, cfg.ui)


def test_the_console_command_refuses_to_start_with_control_it_cannot_offer(tmp_path, monkeypatch, capsys):
    from stragglerscope.cli import main

    monkeypatch.setenv("STRAGGLERSCOPE_UI_CONTROL_TOKEN_FILE", _token(tmp_path, mode=0o640))
    monkeypatch.setenv("STRAGGLERSCOPE_KAFKA_BOOTSTRAP", "k:9092")
    assert main(["console"]) == 2
    err = capsys.readouterr().err
    assert "console control: the console's control token file" in err and err.count("\n") == 1


S = 10**9  # ns


def _row(change_id: str, when_s: int, what: dict | None = None, scope: str = "job:j1", until_s: int = 0,
         clears: str = "", from_step: int = 0) -> dict:
    import json

    return dict(change_id=change_id, scope=scope, when_ns=when_s * S, until_ns=until_s * S,
                what_json=json.dumps(what or {}), clears=clears, from_step=from_step)


@pytest.mark.parametrize("rows, want", [
    ([_row("a", 10, {"sample": "1/1"})], ["in force until cleared"]),
    ([_row("a", 10, {"sample": "1/1"}, until_s=50)], ["ran out"]),
    ([_row("a", 10, {"sample": "1/1"}, until_s=500)], ["in force until T500"]),
    # A later change of the same setting in the same scope replaces it, even once the later one ended.
    ([_row("a", 10, {"sample": "5/10"}), _row("b", 20, {"sample": "1/1"}, until_s=30, from_step=40)],
     ["replaced by b", "ran out"]),
    # Only some of its settings replaced: in force for the others, and says which were.
    ([_row("a", 10, {"sample": "5/10", "hang_min_s": 30}), _row("b", 20, {"sample": "1/1"})],
     ["in force until cleared; sample replaced by b", "in force until cleared"]),
    # Replaced and then its other setting cleared by id: each setting ended, by what ended it first.
    ([_row("a", 10, {"sample": "5/10", "hang_min_s": 30}), _row("b", 20, {"sample": "1/1"}),
      _row("c", 30, clears="a")], ["cleared, replaced by b", "in force until cleared", "clears a"]),
    # The fleet's change of a setting does not replace a job's, nor the other way; a clear of one scope ends
    # only that scope's changes made before it.
    ([_row("a", 10, {"sample": "5/10"}, scope="fleet"), _row("b", 20, {"sample": "1/1"}),
      _row("c", 30, scope="fleet", clears="*"), _row("d", 40, {"sample": "2/10"}, scope="fleet")],
     ["cleared", "in force until cleared", "clears every change of its scope", "in force until cleared"]),
    # A change that ran out before a later one was made ran out; it was not replaced.
    ([_row("a", 10, {"sample": "1/1"}, until_s=15), _row("b", 20, {"sample": "5/10"})],
     ["ran out", "in force until cleared"]),
])
def test_the_job_page_says_what_became_of_each_stored_change(rows, want):
    from actions.control import audit_states

    assert audit_states(rows, 100 * S, lambda ns: f"T{ns // S}") == want
    assert audit_states(rows[::-1], 100 * S, lambda ns: f"T{ns // S}") == want[::-1]  # the table's order is any
