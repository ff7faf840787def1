"""A copy of this repository's installable part, for `pip install` in tests and benchmarks.

``pip install <folder>`` builds in the folder it is given (setuptools writes ``build/`` and ``*.egg-info``
there): from a copy, a test leaves the checkout as it found it.
"""
from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SKIP = (".git", ".venv", "build", "dist", "tests", "benchmarks", "docs", "infra", "__pycache__", "*.egg-info",
         ".stragglerscope", ".pytest_cache", ".hypothesis", ".ruff_cache", "bench_data", "*.pyc")


def project_copy(dest: Path) -> Path:
    """The repository without its tests, benchmarks, docs and local state, at ``dest``; returns ``dest``."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*_SKIP))
    return dest
