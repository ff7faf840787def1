"""Console page timings over a large store: every page's script run, cold and warm, with AppTest.

    .venv/bin/python benchmarks/console.py [--jobs 100000] [--windows 300000] [--repeat 3]

Fills a chDB store with ``--windows`` synthetic window results of ``--jobs``
jobs (the storage benchmark's fleet model) plus a dozen jobs with real
analyses, hangs, link faults and alerts (the console tests' demo fleet), then
runs each page of ``ui/app.py`` with Streamlit's AppTest: the first run
(cold: the store is opened and every query runs) and the median of
``--repeat`` reruns (warm: cached queries). The browser adds its own rendering
on top (see tests/ui/test_console_browser.py). Target (issue 7): every page in
at most 2 s with 100k jobs in the store.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PAGES = [("fleet", None), ("alerts", "pages/alerts.py"), ("job", "pages/job.py"), ("sql", "pages/sql.py")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--windows", type=int, default=300_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from storage import open_store
    from storage_bench_fleet import Fleet, load  # noqa: F401  (see the import shim below)
    from tests.ui.conftest import fill_demo_store
    from streamlit.testing.v1 import AppTest

    work = Path(tempfile.mkdtemp(prefix="ss-console-bench-"))
    try:
        url = f"chdb://{work / 'store'}"
        store = open_store(url)
        store.setup()
        t0 = time.perf_counter()
        load(store, Fleet(args.jobs, seed=5), args.windows, batches=3, optype_fraction=0.1)
        fill_demo_store(store)
        jobs = store.run_named("fleet_summary", {}).to_pylist()[0]["jobs"]
        print(f"store: {jobs:,} jobs, {args.windows:,} synthetic windows + the demo fleet, "
              f"filled in {time.perf_counter() - t0:.0f} s")
        store.close()
        os.environ["STRAGGLERSCOPE_STORE"] = url
        at = AppTest.from_file(str(ROOT / "ui" / "app.py"), default_timeout=300)
        print(f"{'page':<8}{'cold s':>9}{'warm s (median)':>17}")
        worst = 0.0
        for name, path in PAGES:
            t = time.perf_counter()
            (at.run() if path is None else at.switch_page(path).run())
            cold = time.perf_counter() - t
            if at.exception:
                print(f"{name}: exception {at.exception}")
                return 1
            warm = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                at.run()
                warm.append(time.perf_counter() - t)
            w = statistics.median(warm)
            worst = max(worst, cold)
            print(f"{name:<8}{cold:>9.2f}{w:>17.2f}")
        print(f"slowest cold page: {worst:.2f} s (target <= 2 s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    import importlib.util

    # The storage benchmark's fleet model, loaded by path (benchmarks/ is a folder of scripts).
    spec = importlib.util.spec_from_file_location("storage_bench_fleet", ROOT / "benchmarks" / "storage.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["storage_bench_fleet"] = mod
    sys.exit(main())
