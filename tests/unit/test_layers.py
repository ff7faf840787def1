"""The layers (README, "Layers"): every package imports only what sits below it, checked on the source."""
import ast
from pathlib import Path

from tests.conftest import ROOT

# package -> the project packages its modules may import (itself included). Lazy imports inside
# functions count too: a layer rule that holds only at import time does not hold.
ALLOWED = {
    "core": {"core"},
    "analyzers": {"core", "analyzers"},
    "generators": {"core", "generators"},
    "ingest": {"core", "ingest"},
    "ray_jobs": {"core", "analyzers", "ray_jobs"},
    "storage": {"core", "storage"},
    "ui": {"core", "analyzers", "storage", "ui"},  # the console reads the store and re-simulates
    "services": {"core", "storage", "services"},  # the store daemon's launcher runs storage.daemon
    "examples": {"core", "generators", "ingest", "services", "examples"},
}
PROJECT = set(ALLOWED) | {"stragglerscope", "tests", "benchmarks"}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_every_package_imports_only_the_layers_below_it():
    wrong = []
    for pkg, allowed in ALLOWED.items():
        files = sorted((ROOT / pkg).rglob("*.py"))
        assert files, f"no package {pkg}/"
        for f in files:
            for line, module in _imports(f):
                top = module.split(".")[0]
                if top in PROJECT and top not in allowed:
                    wrong.append(f"{f.relative_to(ROOT)}:{line} imports {module}")
    assert wrong == [], "imports against the layers:\n" + "\n".join(wrong)


def test_the_checker_sees_lazy_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from storage import open_store\n    import ray_jobs.shard\n")
    assert [m for _, m in _imports(f)] == ["storage", "ray_jobs.shard"]
