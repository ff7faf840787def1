"""The command line: help for every command, one-line errors for bad input."""
import pytest

from stragglerscope.cli import build_parser, main

COMMANDS = ["demo", "run", "replay", "sql", "whatif", "import", "console", "store", "config"]


def test_help_lists_every_command_and_the_configuration(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for c in COMMANDS:
        assert c in out
    assert "STRAGGLERSCOPE_" in out and "[kafka]" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_its_own_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert len(capsys.readouterr().out) > 100


def _one_line_error(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and match in err


def test_missing_config_file(capsys):
    _one_line_error(capsys, ["demo", "--config", "/nope.toml"], "config file not found")


def test_bad_config_value(capsys, monkeypatch):
    monkeypatch.setenv("STRAGGLERSCOPE_PIPELINE_SHARDS", "lots")
    _one_line_error(capsys, ["run"], "expected int")


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_unreachable_broker(capsys, monkeypatch):
    monkeypatch.setenv("STRAGGLERSCOPE_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    _one_line_error(capsys, ["run"], "no Kafka broker reachable at 127.0.0.1:1")


def test_demo_rejects_nonsense_sizes(capsys):
    _one_line_error(capsys, ["demo", "--jobs", "0"], "--jobs must be at least 1")


def test_sql_needs_a_name_or_query(capsys):
    _one_line_error(capsys, ["sql"], "give a query name")


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_bad_flag_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["demo", "--frobnicate"])
    assert e.value.code == 2


def test_import_needs_a_destination(capsys, tmp_path):
    _one_line_error(capsys, ["import", "kineto", str(tmp_path / "x.json")], "say where the records go")


def test_import_missing_file(capsys, tmp_path):
    _one_line_error(capsys, ["import", "kineto", str(tmp_path / "x.json"), "--out", str(tmp_path / "o.parquet")],
                    "no such file")


def test_replay_of_a_missing_path(capsys, tmp_path):
    _one_line_error(capsys, ["replay", str(tmp_path / "nope")], "no such file or folder")


def test_replay_of_a_folder_without_a_trace(capsys, tmp_path):
    _one_line_error(capsys, ["replay", str(tmp_path)], "expected one trace-*.parquet")


def test_a_record_that_does_not_decode_is_a_user_error_not_a_bug():
    """The errors printed as one line (exit 2) include the codec's; a moved class must not drop out silently."""
    from core.codec import DecodeError
    from core.kafka_admin import BrokerError
    from stragglerscope.cli import _user_errors

    errs = _user_errors()
    assert DecodeError in errs and BrokerError in errs
