"""Configuration: defaults, TOML, environment, and errors that name the key."""
import pytest

from core import config as C


def test_defaults_are_the_embedded_local_setup():
    cfg = C.load(env={})
    assert cfg.kafka.bootstrap == ""
    assert cfg.store.url.startswith("chdb://")
    assert cfg.ray.address == ""
    assert cfg.ui.address == "127.0.0.1"


def test_toml_then_environment(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[kafka]\nbootstrap = "127.0.0.1:9999"\npartitions = 4\n[pipeline]\nshards = 1\n')
    cfg = C.load(str(f), env={"STRAGGLERSCOPE_KAFKA_PARTITIONS": "16", "STRAGGLERSCOPE_STORE": "chdb:///tmp/x"})
    assert cfg.kafka.bootstrap == "127.0.0.1:9999"
    assert cfg.kafka.partitions == 16
    assert cfg.pipeline.shards == 1
    assert cfg.store.url == "chdb:///tmp/x"


@pytest.mark.parametrize(
    "text, match",
    [
        ("[nope]\nx = 1\n", r"unknown section \[nope\]"),
        ("[kafka]\nbootstrapp = 'x'\n", "unknown key kafka.bootstrapp"),
        ("[kafka]\npartitions = 'many'\n", "kafka.partitions: expected int"),
        ("[kafka\n", "not valid TOML"),
        # A finding printed only at a confidence above the one that pages: the pager would name what nobody sees.
        ("[alerts]\nlink_shown_confidence = 0.6\n", "link_shown_confidence <= link_confidence"),
        ("[alerts]\nlink_certain = 1.5\n", "link_certain <= 1"),
    ],
)
def test_bad_files_name_what_is_wrong(tmp_path, text, match):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(C.ConfigError, match=match):
        C.load(str(f), env={})


def test_missing_file():
    with pytest.raises(C.ConfigError, match="config file not found"):
        C.load("/nonexistent/x.toml", env={})


def test_bad_environment_value():
    with pytest.raises(C.ConfigError, match="environment: pipeline.shards"):
        C.load(env={"STRAGGLERSCOPE_PIPELINE_SHARDS": "two"})


def test_describe_lists_every_key_with_its_meaning():
    text = C.describe()
    assert "[kafka]" in text and "bootstrap = ''" in text and "Tansu" in text
    assert "idle_timeout_s" in text


def test_the_readme_configuration_table_is_the_code_s():
    """README's reference is `stragglerscope config` pasted: a new key must appear in both."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert C.describe().strip() in readme
