"""Run a function right after a module is imported (or now, if it already is).

The automatic instrumentation must patch ``torch.distributed`` before the
training script looks anything up in it, without importing torch itself in
processes that never use it (the launcher, data workers, shell tools). A
finder at the front of ``sys.meta_path`` wraps the loader of the watched
modules so the callback runs as soon as the module's body has executed.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from typing import Callable

log = logging.getLogger(__name__)

_callbacks: dict[str, list[Callable]] = {}


def _run(name: str, module) -> None:
    for fn in _callbacks.pop(name, []):
        try:
            fn(module)
        except Exception as e:  # an instrumentation bug must not break the import
            log.warning("stragglerscope: post-import hook for %s failed: %r", name, e)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _run(module.__name__, module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


_finder = _Finder()


def when_imported(name: str, fn: Callable) -> None:
    """Call ``fn(module)`` once ``name`` is imported; at once when it already is."""
    mod = sys.modules.get(name)
    if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False) is False:
        fn(mod)
        return
    _callbacks.setdefault(name, []).append(fn)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
