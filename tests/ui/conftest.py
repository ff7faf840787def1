"""A demo store for the console tests, and a browser that reads the console as a person does.

No Kafka or Ray here: the console reads only the store, so the fixture fills
one directly with what the pipeline would have written (window results of
real what-if analyses, hangs, link faults, alerts, registrations).
``serve_console`` runs the console over such a store; ``Reader`` is a tab of
Debian's Chromium with what every page is asked: its text (inputs included),
the texts it cuts, a screenshot of the whole page.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

import pyarrow as pa
import pytest

from core import codec
from core import schema as S


def cause_of(n_jobs: int = 12, seed: int = 3) -> dict[str, str]:
    """Injected cause of each demo job (the ground truth of the console tests)."""
    from generators.fleetgen import make_fleet

    return {f"ui-{i:03d}": j.cause for i, j in enumerate(make_fleet(n_jobs, seed, 8, 256))}


def fill_demo_store(store, n_jobs: int = 12, windows: int = 2, seed: int = 3) -> list[str]:
    from analyzers import downtime, hang
    from core.config import AlertConfig
    from core.registration import Registration
    from generators.faultgen import hang_incident, link_incident
    from generators.fleetgen import fleet_windows, make_fleet
    from ray_jobs.alerts import AlertRules
    from analyzers.window import analyze_window

    now = time.time_ns()
    jobs = [dataclasses.replace(j, job_id=f"ui-{i:03d}") for i, j in enumerate(make_fleet(n_jobs, seed, 8, 256))]
    store.insert("job", pa.concat_tables([j.registration(now, 3) for j in jobs]))
    rules = AlertRules(AlertConfig(min_gpus=1, cooldown_s=0))
    by_kind: dict[str, list[pa.Table]] = {}
    for spec, wid, ops in fleet_windows(jobs, windows, 3, now - 3600 * 10**9):
        info = Registration.from_row(spec.registration(now, 3).to_pylist()[0])
        ccl = link_incident("link", 16, wid, job_id=spec.job_id) if spec.job_id == "ui-001" else None
        if ccl is not None:
            c = ccl.ccl
            c = c.set_column(c.schema.get_field_index("window_id"), "window_id", pa.array([wid] * c.num_rows, pa.int64()))
            ccl = c
        tables = analyze_window(ops, info, (spec.job_id, 0, wid), True, "", ccl)
        row = tables["window"].to_pylist()[0]
        alerts = rules.evaluate_window(row, 0.0, now)
        if tables["link_fault"].num_rows:
            alerts += rules.evaluate_links(tables["link_fault"].to_pylist(), 0.0, now)
        tables["alert"] = codec.from_rows(S.ALERT, alerts)
        tables["op_span"] = ops  # the pipeline keeps small windows' raw spans (timeline drill-down)
        for kind, t in tables.items():
            by_kind.setdefault(kind, []).append(t)
    # A communication hang and a node loss, each over its job's whole registered world, so that every
    # cell of the console's hang picture has a rank behind it.
    worlds = {j.job_id: info for j in jobs for info in [j.registration(now, 3).to_pylist()[0]]}
    for job_id, kind in (("ui-002", "comm_hang"), ("ui-007", "node_loss")):
        inc = hang_incident(kind, worlds[job_id]["n_gpus"], 1, job_id=job_id)
        tr = hang.HangTracker(job_id, params=hang.HangParams(floor_s=60))
        tr.add_ccl(inc.ccl)
        hb = inc.heartbeats
        if kind == "comm_hang":  # rank 0 dumped PyTorch's Flight Recorder with its stacks
            fr = json.dumps({"version": "2.10", "groups": {"default_pg": {"enqueued": 8, "started": 8, "completed": 7}},
                             "pending": [{"group": "default_pg", "seq": 8, "p2p_seq": 0, "op": "nccl:all_reduce",
                                          "state": "started", "sizes": [[1024]]}]})
            hb = hb.set_column(hb.schema.get_field_index("flight_recorder"), "flight_recorder",
                               pa.array([fr if r == 0 else "" for r in hb["rank"].to_pylist()], pa.string()))
        tr.add_heartbeats(hb)
        found = tr.evaluate(inc.now_ns, input_alive=True)
        hangs = hang.to_tables([found], now)["hang"]
        by_kind.setdefault("hang", []).append(hangs)
        [row] = hangs.to_pylist()
        by_kind["alert"].append(codec.from_rows(S.ALERT, rules.evaluate_hang(row, 0.0, now)))
    # ui-003 got slower against its own past from its last window: a regression as the pipeline stores it.
    w1 = max(t["window_id"][0].as_py() for t in by_kind["window"] if t["job_id"][0].as_py() == "ui-003")
    by_kind["regression"] = [codec.from_rows(S.REGRESSION, [dict(
        job_id="ui-003", kind="regression", attempt=0, window_id=w1, began_window=w1, began_step=w1, change=0.18,
        before_s=1.0, after_s=1.18, optypes_json='{"grads-reduce-scatter": 0.85}', scope="every worker",
        summary=f"ui-003: step time +18% since window {w1} (step {w1}): 1.000 s -> 1.180 s; grads-reduce-scatter "
                f"+85% (85% of it), compute unchanged: communication; every worker", found_ns=now)])]
    # A lemon-host scoring pass as `run` stores it: node-07 implicated by three jobs, node-03 by one.
    ev = [dict(job_id=f"ui-00{i}", attempt=0, kind=k, at_ns=now - (5 - i) * 3600 * 10**9, what=w)
          for i, k, w in ((4, "worker", "window 0: worker dp1/pp0 S_w 1.40"), (5, "node_loss", "node loss for 300 s"),
                          (6, "degraded_worker", "window 8: dp1/pp0 +22% over its own best"))]
    by_kind["lemon_host"] = [codec.from_rows(S.LEMON_HOST, [
        dict(host="node-07", scored_ns=now, period_s=7 * 86400.0, label="switch-2", jobs=3, incidents=3,
             gpu_hours=12.5, expected_jobs=0.05, p_value=2e-5, lemon=True, evidence_json=json.dumps(ev)),
        dict(host="node-03", scored_ns=now, period_s=7 * 86400.0, label="switch-1", jobs=1, incidents=2,
             gpu_hours=40.0, expected_jobs=0.2, p_value=0.18, lemon=False, evidence_json=json.dumps(ev[:1]))])]
    from generators.downtimegen import generate_downtime_fleet

    faults = generate_downtime_fleet(n_jobs=3, days=2.0, seed=1)
    by_kind["downtime"] = [downtime.to_tables(downtime.account_downtime(faults.tables()))["downtime"]]
    # Run-time changes as the shards store them: ui-003 profiled every step for an hour from step 1200 on all its
    # ranks, which replaced its 5/10 of before; a quieter fleet hang rule that was cleared again.
    from core.control import make_change

    quiet = make_change("bob", now - 7200 * 10**9, None, {"hang_min_s": 30})
    changes = [make_change("alice", now - 60 * 10**9, "ui-003", {"sample": "1/1"}, for_s=3600, from_step=1200),
               make_change("alice", now - 1800 * 10**9, "ui-003", {"sample": "5/10"}), quiet,
               make_change("bob", now - 3600 * 10**9, None, {}, clears=quiet.change_id)]
    by_kind["control_change"] = [codec.from_rows(S.CONTROL_CHANGE, [c.row() for c in changes])]
    for kind, ts in by_kind.items():
        t = pa.concat_tables([x for x in ts if x.num_rows] or ts[:1])
        if t.num_rows:
            store.insert(kind, t)
    return [j.job_id for j in jobs]


@pytest.fixture(scope="session")
def demo_store_url(tmp_path_factory):
    """chdb:// URL of a filled store; the console tests read it (one process at a time)."""
    from storage import open_store

    path = tmp_path_factory.mktemp("ui-store") / "store"
    url = f"chdb://{path}"
    store = open_store(url)
    store.setup()
    fill_demo_store(store)
    store.close()
    return url


# -- the console in a real browser ----------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"
RAW_TIME = r"(?<![\d.])\d{19}(?![\d.])"
"""A 19-digit number: nanoseconds since the epoch, which nobody reads (the issue's 1795812303008193449)."""


@contextlib.contextmanager
def serve_console(fill):
    """A live console (Streamlit on 127.0.0.1) over a new store that ``fill(store)`` writes; yields its URL.

    The console reads the store through the store daemon, as ``stragglerscope demo`` runs it.
    """
    import subprocess
    import tempfile

    from core.config import Config
    from services.ports import free_port
    from services.store_daemon import StoreDaemon
    from storage import open_store
    from stragglerscope.demo import start_console, wait_console

    if not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is not installed: run `make setup-test` (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="ss-ui-") as tmp, StoreDaemon(f"chdb://{tmp}/store") as daemon:
        store = open_store(daemon.url)
        store.setup()
        fill(store)
        store.close()
        cfg = Config().replace(ui={"address": "127.0.0.1", "port": free_port()})
        proc = start_console(daemon.url, cfg, output=subprocess.PIPE)
        url = f"http://127.0.0.1:{cfg.ui.port}"
        try:
            wait_console(url)
        except TimeoutError:
            proc.kill()
            pytest.fail("streamlit did not come up: " + proc.stdout.read().decode()[-2000:])
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


class Reader:
    """A browser tab used as a person uses the console, with what the tests ask of every page."""

    def __init__(self, browser, url: str):
        self.url = url
        self.page = browser.new_page(viewport={"width": 1500, "height": 1100})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("response", lambda r: self.errors.append(f"HTTP {r.status} {r.url}") if r.status >= 400 else None)

    def front(self, expect: str = "Jobs analysed") -> None:
        # Arrive as a person does: the console's front page. (Deep links make Streamlit's own front
        # end probe PATH/_stcore/health first and log a 404.)
        self.page.goto(self.url, wait_until="networkidle")
        self.settle(expect)

    def go(self, link: str, expect: str) -> None:
        """Through the sidebar, as a reader switches pages."""
        self.page.get_by_test_id("stSidebarNav").get_by_text(link, exact=True).click()
        self.settle(expect)

    def settle(self, expect: str) -> None:
        """Until ``expect`` shows and Streamlit's script has finished (its running indicator is gone, and stays
        gone a moment: it shows only some time after a run starts)."""
        self.page.get_by_text(expect, exact=False).first.wait_for(timeout=30_000)
        for _ in range(20):
            self.page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')",
                                        timeout=30_000)
            self.page.wait_for_timeout(400)
            if not self.page.locator("[data-testid='stStatusWidget']").count():
                return

    def text(self) -> str:
        """What a reader sees: the page's text, and what its inputs show (values and placeholders)."""
        shown = self.page.eval_on_selector_all(
            "[data-testid='stMain'] input, [data-testid='stMain'] textarea",
            "els => els.map(e => (e.value || '') + ' ' + (e.placeholder || '')).join('\\n')")
        return self.page.inner_text("[data-testid='stMain']") + "\n" + shown

    def cut_texts(self) -> list[str]:
        """Texts the page cuts with an ellipsis or hides past a box's edge: what a reader cannot read whole.

        Any box that clips (overflow hidden or clip, or an ellipsis) and holds text wider than itself: the
        text may sit in a child (a page link's label is a paragraph inside a clipping span)."""
        return self.page.evaluate("""() => {
            const cut = [];
            for (const el of document.querySelectorAll('[data-testid="stMain"] *')) {
                if (el.offsetParent === null || !el.textContent.trim()
                    || el.closest('svg, canvas, [data-testid="stDataFrame"], .vega-embed, [data-testid="stCode"]'))
                    continue;
                const s = getComputedStyle(el);
                const clips = s.textOverflow === 'ellipsis' || ['hidden', 'clip'].includes(s.overflowX);
                if (clips && el.scrollWidth > el.clientWidth + 1) cut.push(el.textContent.trim().slice(0, 200));
            }
            return cut;
        }""")

    def screenshot(self, path) -> None:
        """The whole page, not only the first screen: Streamlit scrolls inside its main section, so the
        viewport is made as tall as that section for the shot."""
        for _ in range(2):  # at the new size charts re-lay themselves out, and the page's height changes
            h = self.page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
            self.page.set_viewport_size({"width": 1500, "height": min(max(int(h), 1100), 9000)})
            self.page.wait_for_timeout(600)
        self.page.screenshot(path=str(path))
        self.page.set_viewport_size({"width": 1500, "height": 1100})

    def close(self) -> None:
        self.page.close()
