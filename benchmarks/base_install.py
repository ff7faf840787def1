"""What the base install adds to a training image, and what the exporter costs to import (issue 49).

    .venv/bin/python benchmarks/base_install.py [--server]

In a fresh virtual environment: numpy and pyarrow first (a training image has them), then `pip install
<this repository>` (the base: no `server` extra). Prints the megabytes the base adds beyond numpy and
pyarrow (target: at most 30 MB), then the import time of what a traced rank imports (the exporter, the trace
session, the producer; median of 7 fresh interpreters). ``--server``: also the `server` extra on top, for
the comparison (downloads about 1.3 GB).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6


def site(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args], check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="store_true", help="also measure the server extra (downloads ~1.3 GB)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        venv = Path(d) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        empty = size_mb(site(venv))
        import numpy
        import pyarrow

        pip(venv, f"numpy=={numpy.__version__}", f"pyarrow=={pyarrow.__version__}")
        stack = size_mb(site(venv))
        from tests.packaging import project_copy

        src = project_copy(Path(d) / "src")
        pip(venv, str(src))
        base = size_mb(site(venv))
        listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                                capture_output=True, text=True, check=True).stdout.split()
        print(f"numpy {numpy.__version__} and pyarrow {pyarrow.__version__}: {stack - empty:.0f} MB")
        print(f"the base install adds {base - stack:.1f} MB beyond them (target: at most 30 MB): "
              f"{', '.join(x for x in listed if not x.startswith(('numpy', 'pyarrow', 'pip', 'setuptools')))}")
        code = ("import time; t = time.perf_counter(); import ingest.exporter, ingest.autotrace.session, "
                "ingest.producer, ingest.rank_watch; print(time.perf_counter() - t)")
        times = []
        for _ in range(7):
            out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                                 check=True, cwd=d).stdout
            times.append(float(out.strip()))
        print(f"a traced rank's imports (exporter, session, producer, watch): median "
              f"{statistics.median(times) * 1e3:.0f} ms over 7 fresh interpreters")
        if a.server:
            t0 = time.monotonic()
            pip(venv, f"{src}[server]")
            print(f"the server extra on top: {size_mb(site(venv)) - base:.0f} MB more "
                  f"({time.monotonic() - t0:.0f} s to install)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
