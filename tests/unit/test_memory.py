"""core.memory.small_pages: numpy stops asking for huge pages, unless the user chose."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import os, numpy as np
    from core.memory import small_pages
    small_pages()
    # numpy's switch returns its previous setting: what small_pages left it at
    print(os.environ.get("NUMPY_MADVISE_HUGEPAGE"), np._core.multiarray._set_madvise_hugepage(True))
""")


def _probe(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env_value is not None:
        env["NUMPY_MADVISE_HUGEPAGE"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_off_by_default_and_inherited_by_children():
    assert _probe(None) == "0 False"


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_the_users_choice_stands():
    assert _probe("1") == "1 True"
    assert _probe("0") == "0 False"
