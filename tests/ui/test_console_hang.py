"""The picture of a real hang, read in a real browser.

The job of tests/integration/test_gloo_hang.py: a gloo DP2 x PP2 training whose rank 1 SIGSTOPs
itself mid-training, through the real exporter, producer and Tansu. The shard's hang monitor,
fed from Kafka, finds the hang; the store gets what the pipeline would write (the job's own
registration, the HANG row, the alert). A reader then opens the console as a person does: the
alert, one click, the job's hang picture, where rank 1 must be the outlined culprit that never
entered the collective its three peers wait in, with the flame graph of their stacks beside it.
"""
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from tests.ui.conftest import Reader, serve_console

pytestmark = pytest.mark.integration


def _real_hang(broker) -> dict[str, list[pa.Table]]:
    """The registration and the HANG row of a gloo job whose rank 1 stops (the integration test's job)."""
    from analyzers.hang import HangParams
    from core import codec, topics
    from core.kafka_admin import ensure_topics
    from ray_jobs.hang_monitor import HangReducer
    from ray_jobs.kafka_source import KafkaSource

    pytest.importorskip("torch")
    ensure_topics(broker.bootstrap, topics.INPUT_TOPICS, 4)
    job = f"gloo-hang-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.train_gloo", "--bootstrap", broker.bootstrap, "--job-id", job,
         "--steps", "8", "--stop-rank", "1", "--stop-at-step", "3", "--heartbeat-s", "0.5",
         "--hang-dump-s", "2", "--dist-timeout", "90"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    # The integration test's margins for a loaded 2-core machine.
    monitor = HangReducer(HangParams(floor_s=8.0), every_s=0.5)
    src = KafkaSource(broker.bootstrap, [topics.TOPIC_JOBS, topics.TOPIC_HEARTBEATS, topics.TOPIC_CCL], range(4))
    src.seek({})
    regs, hangs = [], []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not hangs:
            for m in src.poll(300):
                kind, t = codec.decode(m.value)
                t = t.filter(pc.equal(t["job_id"], job))
                if not t.num_rows:
                    continue
                if kind == "job":
                    regs.append(t)
                elif kind == "heartbeat":
                    monitor.add_heartbeats(t, time.monotonic())
                elif kind == "ccl_record":
                    monitor.add_ccl(t, time.monotonic())
            found = monitor.evaluate(time.monotonic())
            if found.num_rows:
                hangs.append(found)
            assert proc.poll() is None or hangs, proc.stdout.read().decode()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        src.close()
    assert hangs, "no hang detected within 120 s"
    assert regs, "the job's registration never arrived"
    return {"job": regs[:1], "hang": hangs[:1]}


@pytest.fixture(scope="module")
def hang_console(broker):
    from core import codec
    from core import schema as S
    from core.config import AlertConfig
    from ray_jobs.alerts import AlertRules

    tables = _real_hang(broker)
    [row] = tables["hang"][0].to_pylist()
    alerts = AlertRules(AlertConfig(cooldown_s=0)).evaluate_hang(row, 0.0, time.time_ns())

    def fill(store):
        store.insert("job", tables["job"][0])
        store.insert("hang", tables["hang"][0])
        store.insert("alert", codec.from_rows(S.ALERT, alerts))

    with serve_console(fill) as url:
        yield url, row


def test_the_hang_of_a_real_gloo_job_shows_its_culprit_in_the_picture(hang_console, browser, artifacts):
    url, hang = hang_console
    assert (hang["kind"], hang["missing_ranks"]) == ("comm_hang", "1"), hang  # what the injected fault is
    r = Reader(browser, url)
    try:
        r.front()
        r.go("Alerts", "refreshed every 5 s")
        r.page.get_by_role("link", name=f"{hang['job_id']} · hang").click()
        r.settle("No window of this job has been analysed yet")
        r.page.locator("svg.hang-grid").first.wait_for(timeout=10_000)
        r.screenshot(artifacts / "console-real-hang.png")
        body = r.text()
        assert re.search(r"rank 1 \(dp 1, pp 0\)[^.]* never entered(?: it)?: it is the culprit", body), body[:3000]
        grid = r.page.locator("svg.hang-grid")
        assert grid.count() == 1
        # Four cells, DP 2 x PP 2: rank 1 outlined as the one that never entered, its peers waiting.
        cells = {c.get_attribute("data-ranks"): c.get_attribute("data-state") for c in grid.locator("g.cell").all()}
        assert sorted(cells) == ["0", "1", "2", "3"], cells
        culprit = grid.locator("g.cell.culprit")
        assert culprit.count() == 1
        assert (culprit.get_attribute("data-ranks"), culprit.get_attribute("data-state")) == ("1", "never_entered")
        assert all(cells[r].startswith("waiting") for r in "023"), cells
        # The arrows are the wait chain: each waiting rank points at whom it waits for, and the chain ends at 1.
        arrows = {(a.get_attribute("data-from"), a.get_attribute("data-to"))
                  for a in grid.locator("path.wait-arrow").all()}
        assert len(arrows) == 3 and all(f != "1" for f, _ in arrows), arrows
        assert ("3", "1") in arrows or ("0", "1") in arrows, arrows
        # The merged stacks beside it: the peers' frames, and rank 1's missing stack named.
        flame = r.page.locator("svg.flame")
        assert flame.count() == 1 and "train_gloo.py" in flame.inner_html()
        assert "no stack from rank 1" in flame.inner_html()
        assert not re.search(r"(?<![\d.])\d{19}(?![\d.])", body)
        assert r.cut_texts() == []
        assert not r.errors, r.errors
    finally:
        r.close()
