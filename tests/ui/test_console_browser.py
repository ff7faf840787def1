"""The console in a real browser: Debian's Chromium driven by Playwright, against a live Streamlit.

The console reads a demo store through the store daemon (as in `stragglerscope demo`).
Every page is visited; each must show real content and log no browser console
error; a PNG of each lands in tests/artifacts/ for review.
"""
import os
import subprocess
import time

import pytest

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
# (page, its link in the sidebar, text that proves real content)
PAGES = [("fleet", None, "Jobs analysed"), ("alerts", "Alerts", "refreshed every 5 s"),
         ("job", "Job", "Worker slowdown"), ("sql", "SQL", "Named queries")]


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    from core.config import Config
    from services.ports import free_port
    from services.store_daemon import StoreDaemon
    from storage import open_store
    from stragglerscope.demo import start_console, wait_console
    from tests.ui.conftest import fill_demo_store

    if not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is not installed: run `make setup-test` (apt-get install chromium)")
    path = tmp_path_factory.mktemp("browser-store") / "store"
    with StoreDaemon(f"chdb://{path}") as daemon:
        store = open_store(daemon.url)
        store.setup()
        fill_demo_store(store)
        store.close()
        cfg = Config().replace(ui={"address": "127.0.0.1", "port": free_port()})
        proc = start_console(daemon.url, cfg, output=subprocess.PIPE)
        url = f"http://127.0.0.1:{cfg.ui.port}"
        try:
            wait_console(url)
        except TimeoutError:
            proc.kill()
            pytest.fail("streamlit did not come up: " + proc.stdout.read().decode()[-2000:])
        yield url
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


@pytest.mark.parametrize("name, link, expect", PAGES, ids=[p[0] for p in PAGES])
def test_page_renders_real_content_without_console_errors(console, browser, artifacts, name, link, expect):
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(f"HTTP {r.status} {r.url}") if r.status >= 400 else None)
    t0 = time.perf_counter()
    # Arrive as a person does: the console's front page, then the sidebar link. (Deep links
    # make Streamlit's own front end probe PATH/_stcore/health first and log a 404.)
    page.goto(console, wait_until="networkidle")
    if link:
        page.get_by_test_id("stSidebarNav").get_by_text(link, exact=True).click()
    page.get_by_text(expect, exact=False).first.wait_for(timeout=30_000)
    # Streamlit keeps running the script after the first element shows: wait for it to settle.
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=30_000)
    elapsed = time.perf_counter() - t0
    page.screenshot(path=str(artifacts / f"console-{name}.png"), full_page=True)
    body = page.inner_text("body")
    assert "Traceback" not in body, body[:2000]
    assert expect in body
    assert not errors, errors
    (artifacts / "console-timings.txt").open("a").write(f"{name} {elapsed:.2f}\n")
    page.close()
