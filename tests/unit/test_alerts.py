"""Alert rules: thresholds, job size, cool-down per (job, rule)."""
import pytest

from core.config import AlertConfig
from ray_jobs.alerts import AlertRules


def row(**kw):
    base = dict(job_id="j", attempt=0, window_id=0, slowdown=1.3, waste_fraction=0.23, wasted_gpu_hours=1.0,
                n_gpus=64, verdict="worker", m_w=0.9, m_s=0.0, launch_slowdown=1.0, note="")
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "kw, rules",
    [
        ({}, ["slowdown"]),
        ({"slowdown": 1.05}, []),
        ({"n_gpus": 4}, []),
        ({"slowdown": float("nan")}, []),
        ({"launch_slowdown": 1.2}, ["slowdown", "fidelity"]),
        ({"verdict": "analysis_failed", "slowdown": float("nan"), "note": "boom"}, ["analysis_failed"]),
    ],
)
def test_rules(kw, rules):
    alerts = AlertRules(AlertConfig()).evaluate_window(row(**kw), 0.0, 0)
    assert [a["rule"] for a in alerts] == rules


def test_cool_down_per_job_and_rule():
    r = AlertRules(AlertConfig(cooldown_s=600))
    assert r.evaluate_window(row(), 0.0, 0)
    assert not r.evaluate_window(row(window_id=1), 300.0, 0)
    assert r.evaluate_window(row(job_id="other"), 300.0, 0)
    assert r.evaluate_window(row(window_id=2), 601.0, 0)
    assert r.suppressed == 1


def test_severity_and_summary():
    a = AlertRules(AlertConfig()).evaluate_window(row(slowdown=1.8, waste_fraction=0.44), 0.0, 0)[0]
    assert a["severity"] == "critical"
    assert "S=1.80" in a["summary"] and "worker" in a["summary"] and "64 GPUs" in a["summary"]


# -- webhook delivery ----------------------------------------------------------
import http.server
import json
import threading
import time

from ray_jobs.alerts import WebhookSender, post_webhook


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_webhook_posts_json_to_a_real_http_server():
    got = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        sender = WebhookSender(f"http://127.0.0.1:{srv.server_port}/hook")
        for i in range(3):
            assert sender.submit({"rule": "hang", "n": i})
        sender.close()
        assert [a["n"] for a in got] == [0, 1, 2] and sender.sent == 3 and sender.failed == 0
    finally:
        srv.shutdown()


def test_webhook_to_a_dead_port_fails_without_raising():
    assert post_webhook("http://127.0.0.1:9/none", {"a": 1}, timeout_s=0.5) is False


def test_a_slow_webhook_never_blocks_submit_and_overflow_is_counted():
    release = threading.Event()

    def slow_post(url, alert):
        release.wait(5)
        return True

    sender = WebhookSender("http://x", post=slow_post, max_queue=2)
    t0 = time.monotonic()
    results = [sender.submit({"n": i}) for i in range(10)]
    assert time.monotonic() - t0 < 0.1
    assert sender.dropped == results.count(False) >= 7
    release.set()
    sender.close()
    assert sender.sent == results.count(True)


def test_a_failing_webhook_is_retried_then_counted():
    calls = []

    def flaky(url, alert):
        calls.append(alert["n"])
        return len(calls) >= 2  # first try fails, the retry succeeds

    sender = WebhookSender("http://x", post=flaky, retries=2, backoff_s=0.01)
    sender.submit({"n": 1})
    sender.close()
    assert calls == [1, 1] and sender.sent == 1 and sender.failed == 0

    never = WebhookSender("http://x", post=lambda u, a: False, retries=1, backoff_s=0.01)
    never.submit({"n": 2})
    never.close()
    assert never.failed == 1 and never.sent == 0


def _link_rows(history, window, kind="source", src=3, dst=-1, conf=0.7):
    """A window's LINK_FAULT rows as the shard hands them to the alert rules: weighed by the job's history."""
    from analyzers.links import fault_table
    from analyzers.links.fault import LinkFault

    faults = history.weigh(("j", 0, window), [LinkFault("tcp", kind, src, dst, conf, 9.0, {})])
    return fault_table(faults, ("j", 0, window)).to_pylist()


def test_a_link_finding_pages_when_the_next_window_finds_it_again_or_when_near_certain():
    """Issue 38: one window's finding alone flipped between elements on a noisy host and paged each time. Whether
    the window before found it is the findings' history's to say (issue 51: it was worked out twice)."""
    from analyzers.links.history import FindingHistory

    rules, h = AlertRules(AlertConfig(cooldown_s=0.0)), FindingHistory()
    first, = rules.evaluate_links(_link_rows(h, 0), 1.0, 1)
    again, = rules.evaluate_links(_link_rows(h, 10), 2.0, 2)
    other, = rules.evaluate_links(_link_rows(h, 20, "link", 3, 4), 3.0, 3)
    row = _link_rows(FindingHistory(), 30, "destination", -1, 6)[0]
    sure, = rules.evaluate_links([dict(row, confidence=0.95)], 4.0, 4)  # near certain on its own
    assert [a["severity"] for a in (first, again, other, sure)] == ["warning", "critical", "warning", "critical"]
    assert "found in the window before too" in again["summary"]
    assert rules.evaluate_links(_link_rows(h, 40, conf=0.3), 5.0, 5) == []  # under the floor: no alert
