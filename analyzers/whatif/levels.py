"""Level order of the dependency graph and the dependency-cycle error.

``levels_of_groups`` contracts every communication group to one node and
gives each node its longest-path level (Kahn's algorithm, one vectorised
frontier per round): ops of one level depend only on lower levels, so a
simulation pass can process a level at a time. A cycle means the trace's op
order cannot have happened; ``raise_cycle`` names the ops on it in a
``WhatIfInputError``.
"""
from __future__ import annotations

import numpy as np

from .load import PreparedOps, WhatIfInputError


def levels_of_groups(gsrc: np.ndarray, gdst: np.ndarray, n_groups: int, p: PreparedOps, rows: np.ndarray,
            code: np.ndarray, gid: np.ndarray) -> np.ndarray:
    """Longest-path level of every group (Kahn's algorithm, one frontier per round)."""
    self_loop = gsrc == gdst
    if self_loop.any():
        g = int(gsrc[self_loop][0])
        raise_cycle([g], p, rows, code, gid)
    order = np.argsort(gsrc, kind="stable")
    succ = gdst[order]
    ptr = np.zeros(n_groups + 1, np.int64)
    np.cumsum(np.bincount(gsrc, minlength=n_groups), out=ptr[1:])
    indeg = np.bincount(gdst, minlength=n_groups)
    level = np.full(n_groups, -1, np.int64)
    frontier = np.flatnonzero(indeg == 0)
    L = 0
    done = 0
    while len(frontier):
        level[frontier] = L
        done += len(frontier)
        lo, hi = ptr[frontier], ptr[frontier + 1]
        cnt = hi - lo
        tot = int(cnt.sum())
        if tot == 0:
            break
        # Successor slots of the frontier, flattened.
        rep = np.repeat(lo - np.concatenate([[0], np.cumsum(cnt)[:-1]]), cnt)
        targets = succ[np.arange(tot) + rep]
        np.subtract.at(indeg, targets, 1)
        t = np.unique(targets)
        frontier = t[indeg[t] == 0]
        L += 1
    if done < n_groups:
        left = np.flatnonzero(level < 0)
        raise_cycle(_find_cycle(left, gsrc, gdst, level), p, rows, code, gid)
    return level


def _find_cycle(left: np.ndarray, gsrc: np.ndarray, gdst: np.ndarray, level: np.ndarray) -> list[int]:
    """A cycle among the groups Kahn's algorithm could not place (walk predecessors)."""
    unplaced = level < 0
    m = unplaced[gsrc] & unplaced[gdst]
    s, d = gsrc[m], gdst[m]
    pred: dict[int, int] = {}
    for a, b in zip(s.tolist(), d.tolist()):
        pred.setdefault(b, a)
    g = int(left[0])
    seen: dict[int, int] = {}
    path: list[int] = []
    while g not in seen and g in pred:
        seen[g] = len(path)
        path.append(g)
        g = pred[g]
    if g in seen:
        return path[seen[g]:][::-1]
    return path[:6]


def raise_cycle(groups: list[int], p: PreparedOps, rows: np.ndarray, code: np.ndarray, gid: np.ndarray) -> None:
    from core.optypes import OPTYPES

    names = []
    for g in groups[:6]:
        i = int(np.flatnonzero(gid == g)[0])
        r = int(rows[i])
        names.append(f"step {int(p.steps[p.step_idx[r]])} dp{int(p.dp[r])}/pp{int(p.pp[r])} "
                     f"{OPTYPES[int(code[i])]} #{int(p.seq[r])}")
    more = f" (+{len(groups) - 6} more)" if len(groups) > 6 else ""
    raise WhatIfInputError(f"dependency cycle: {' -> '.join(names)}{more}; the trace's op order is inconsistent")
