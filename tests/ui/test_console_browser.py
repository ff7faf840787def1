"""The console in a real browser, read as a person reads it: Debian's Chromium driven by Playwright.

The console reads a demo store through the store daemon (as in `stragglerscope demo`). Every page
is opened from the front page and must show real content, log no browser error, show no raw
nanosecond timestamp and cut no text; an alert's link must open its job at its window in one click.
A PNG of each page lands in tests/artifacts/ for review.
"""
import re
import time

import pytest

from tests.ui.conftest import RAW_TIME, Reader, fill_demo_store, serve_console

pytestmark = pytest.mark.integration

# (page, its link in the sidebar, text that proves real content)
PAGES = [("fleet", None, "Jobs analysed"), ("alerts", "Alerts", "refreshed every 5 s"),
         ("job", "Job", "Worker slowdown"), ("sql", "SQL", "Named queries")]


@pytest.fixture(scope="module")
def console():
    with serve_console(fill_demo_store) as url:
        yield url


@pytest.fixture
def reader(console, browser):
    r = Reader(browser, console)
    yield r
    r.close()


def assert_reads_well(r: Reader) -> None:
    body = r.text()
    assert "Traceback" not in body, body[:2000]
    assert not re.search(RAW_TIME, body), re.findall(RAW_TIME, body)
    assert r.cut_texts() == []
    # Viewers get no Deploy button (ui/.streamlit/config.toml: client.toolbarMode = "viewer").
    assert r.page.get_by_test_id("stAppDeployButton").count() == 0
    assert "Deploy" not in r.page.inner_text("header")


@pytest.mark.parametrize("name, link, expect", PAGES, ids=[p[0] for p in PAGES])
def test_page_renders_real_content_without_console_errors(reader, artifacts, name, link, expect):
    t0 = time.perf_counter()
    reader.front()
    if link:
        reader.go(link, expect)
    elapsed = time.perf_counter() - t0
    assert_reads_well(reader)
    reader.screenshot(artifacts / f"console-{name}.png")
    assert expect in reader.text()
    assert not reader.errors, reader.errors
    (artifacts / "console-timings.txt").open("a").write(f"{name} {elapsed:.2f}\n")


def test_an_alert_link_opens_its_job_at_its_window(reader, artifacts):
    reader.front()
    reader.go("Alerts", "refreshed every 5 s")
    text = reader.text()
    assert "ago" in text and "UTC" in text, text[:1000]
    # The whole summary is on the page (wrapped, not cut), after the job it is about.
    assert re.search(r"straggling S=1\.\d\d \(uneven sequence lengths\), \d+% of 64 GPUs wasted in window 30", text)
    link = reader.page.get_by_role("link", name="ui-003 · window 30")
    assert link.count() == 1, reader.text()[:3000]
    link.click()
    reader.settle("Link matrix")  # the job page's last section: the script has run to its end
    assert re.search(r"job=ui-003", reader.page.url) and re.search(r"window=30", reader.page.url), reader.page.url
    body = reader.text()
    # The window picker shows the alerted window.
    assert reader.page.get_by_role("combobox", name="Window").input_value().startswith("window 30 · S 1.")
    # The verdict in words, whole: its title and its sentence with figures.
    assert "Main cause: Uneven sequence lengths" in body
    assert re.search(r"correlation r = 0\.\d{3} over \d+ microbatches", body), body
    assert "History" in body and "Against its own past" in body  # the demo store's regression of ui-003
    assert_reads_well(reader)
    reader.screenshot(artifacts / "console-job-from-alert.png")
    assert not reader.errors, reader.errors


def test_a_hang_alert_opens_the_picture_with_its_culprit_outlined(reader, artifacts):
    reader.front()
    reader.go("Alerts", "refreshed every 5 s")
    reader.page.get_by_role("link", name="ui-002 · hang").click()
    reader.settle("Link matrix")
    grid = reader.page.locator("svg.hang-grid")
    assert grid.count() == 1
    culprits = grid.locator("g.cell.culprit")
    assert culprits.count() == 1
    missing = re.search(r"rank (\d+) \(dp \d+, pp \d+, tp \d+\)[^.]* never entered it", reader.text())
    assert missing, reader.text()[:3000]
    assert culprits.first.get_attribute("data-ranks") == missing.group(1)
    assert culprits.first.get_attribute("data-state") == "never_entered"
    assert grid.locator("path.wait-arrow").count() > 0
    assert_reads_well(reader)
    reader.screenshot(artifacts / "console-job-hang.png")
    assert not reader.errors, reader.errors
