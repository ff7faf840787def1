"""Structured logs: one JSON object per line with the fields a log shipper indexes."""
import io
import json
import logging

import pytest

from core import config, logs


@pytest.fixture(autouse=True)
def _restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def _capture(fmt, **static):
    logs.configure(fmt, logging.INFO, **static)
    buf = io.StringIO()
    logging.getLogger().handlers[0].setStream(buf)
    return buf


def test_json_lines_carry_level_logger_static_and_extra_fields():
    buf = _capture("json", shard=3)
    log = logging.getLogger("ray_jobs.shard")
    log.info("window %s stored", "j/0/1", extra={"job_id": "j", "latency_s": 0.25})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("step failed")
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert lines[0]["msg"] == "window j/0/1 stored" and lines[0]["level"] == "info"
    assert lines[0]["logger"] == "ray_jobs.shard" and lines[0]["shard"] == 3
    assert lines[0]["job_id"] == "j" and lines[0]["latency_s"] == 0.25 and lines[0]["ts"].endswith("+00:00")
    assert lines[1]["level"] == "error" and "RuntimeError: boom" in lines[1]["exc"]


def test_text_format_is_one_readable_line():
    buf = _capture("text", shard=1)
    logging.getLogger("x").warning("hello")
    assert buf.getvalue().rstrip().endswith("WARNING x shard=1: hello")


def test_unknown_format_is_refused_in_config_and_in_code():
    with pytest.raises(config.ConfigError, match="log_format must be one of text, json"):
        config.load(None, env={"STRAGGLERSCOPE_PIPELINE_LOG_FORMAT": "xml"})
    assert config.load(None, env={"STRAGGLERSCOPE_PIPELINE_LOG_FORMAT": "json"}).pipeline.log_format == "json"
    with pytest.raises(ValueError):
        logs.configure("xml")
