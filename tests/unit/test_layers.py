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
    "actions": {"core", "analyzers", "storage", "actions"},  # use cases: stored rows to an analyzer and back
    "ui": {"core", "analyzers", "storage", "actions", "ui"},  # the console reads the store and re-simulates
    "services": {"core", "storage", "services"},  # the store daemon's launcher runs storage.daemon
    "examples": {"core", "generators", "ingest", "services", "examples"},
    # The command line drives every layer but the console, which it starts as a Streamlit process.
    "stragglerscope": {"core", "analyzers", "generators", "ingest", "ray_jobs", "storage", "actions", "services",
                       "stragglerscope"},
    # Benchmarks measure any layer with the tests' own harness (fakes, project copies); nothing imports them.
    "benchmarks": {"core", "analyzers", "generators", "ingest", "ray_jobs", "storage", "actions", "ui", "services",
                   "stragglerscope", "tests", "benchmarks"},
}
PROJECT = set(ALLOWED) | {"tests"}


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


def _module_graph() -> dict[str, set[str]]:
    """Each project module (not package ``__init__``) and the project modules it imports, lazily or not."""
    files = {}
    for pkg in ALLOWED:
        for f in (ROOT / pkg).rglob("*.py"):
            if f.name != "__init__.py":
                files[".".join(f.relative_to(ROOT).with_suffix("").parts)] = f
    graph = {}
    for name, f in files.items():
        deps = set()
        for _, module in _imports(f):
            parts = module.split(".")
            # ``from a.b import c`` names module a.b.c or a name in a.b: the longest that is a module.
            for k in range(len(parts), 0, -1):
                if ".".join(parts[:k]) in files:
                    deps.add(".".join(parts[:k]))
                    break
        graph[name] = deps - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other through imports (strongly connected, more than one)."""
    order, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm; the graph is a few hundred modules, recursion is fine
        order[v] = low[v] = len(order)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def test_no_modules_import_each_other():
    """A circle (even through a lazy import) means neither module can be read, tested or moved alone."""
    assert _cycles(_module_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# What only a store object answers to (not ``insert`` or ``query``: lists and frames have those too): an
# analyzer that calls these was handed a store, whatever it imports.
STORE_CALLS = {"run_named", "load_offsets", "store_offsets", "window_stored", "load_jobs",
               "load_state", "store_state"}


def _store_uses(path: Path):
    """(line, what) of each parameter named like a store and each call of a store's methods on a name
    other than self (an analyzer's own method of the same name is its own business)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                if a.arg in ("store", "store_url", "open_store"):
                    yield node.lineno, f"parameter {a.arg}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STORE_CALLS:
            owner = node.func.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                yield node.lineno, f"call of .{node.func.attr}()"


def test_no_analyzer_is_handed_a_store():
    """Analyzers compute on tables and return tables: reading and storing is ``actions/``'s and the pipeline's."""
    wrong = [f"{f.relative_to(ROOT)}:{line} {what}" for f in sorted((ROOT / "analyzers").rglob("*.py"))
             for line, what in _store_uses(f)]
    assert wrong == [], "analyzers that use a store:\n" + "\n".join(wrong)


def test_the_store_check_sees_a_store_passed_in(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def advise(store, job):\n    return store.run_named('job_info', {})\n\n"
                 "class R:\n    def insert(self, x):\n        return self.insert(x)\n")
    assert [what for _, what in _store_uses(f)] == ["parameter store", "call of .run_named()"]
