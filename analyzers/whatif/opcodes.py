"""Op-type tables of the dependency model (docs/whatif.md, sections 1 to 3).

Every op type of ``core.optypes.OPTYPES`` gets a small integer code (its
index there), a stream, whether it is idealised as communication (median of
transfer durations) or compute (mean of durations), and the attribution group
it belongs to (sends and recvs merge into ``forward-pp-comm`` and
``backward-pp-comm``).
"""
from __future__ import annotations

import numpy as np

from core.optypes import OPTYPES

CODE = {name: i for i, name in enumerate(OPTYPES)}
F = CODE["forward-compute"]
B = CODE["backward-compute"]
OPT = CODE["optimizer"]
GC = CODE["gc"]
FS = CODE["forward-send"]
FR = CODE["forward-recv"]
BS = CODE["backward-send"]
BR = CODE["backward-recv"]
PAG = CODE["params-all-gather"]
RS = CODE["grads-reduce-scatter"]
SAR = CODE["separate-grads-all-reduce"]
EMB = CODE["embedding-grads-all-reduce"]
CLIP = CODE["optimizer-clip-main-grad"]
LN = CODE["layernorm-grads-all-reduce"]

# Streams of one worker: ops of one stream run one after the other.
S_COMPUTE, S_DP, S_FR, S_BR, S_FS, S_BS, S_SYNC = range(7)
STREAM_OF_CODE = np.zeros(len(OPTYPES), np.int8)
for _c, _s in ((F, S_COMPUTE), (B, S_COMPUTE), (OPT, S_COMPUTE), (GC, S_COMPUTE), (PAG, S_DP), (RS, S_DP),
               (SAR, S_DP), (FR, S_FR), (BR, S_BR), (FS, S_FS), (BS, S_BS), (EMB, S_SYNC), (CLIP, S_SYNC),
               (LN, S_SYNC)):
    STREAM_OF_CODE[_c] = _s
STREAM_NAMES = ("compute", "dp-comm", "forward-recv", "backward-recv", "forward-send", "backward-send", "sync")

COMPUTE_CODES = (F, B, OPT, GC)
IS_COMM = np.ones(len(OPTYPES), bool)
IS_COMM[list(COMPUTE_CODES)] = False
"""Idealised by the median of transfer durations (layernorm included)."""

DP_COLLECTIVES = (PAG, RS, SAR)

# Attribution groups (by_optype keys).
GROUP_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys(
        "forward-pp-comm" if n in ("forward-send", "forward-recv")
        else "backward-pp-comm" if n in ("backward-send", "backward-recv") else n
        for n in OPTYPES
    )
)
GROUP_OF_CODE = np.array([GROUP_NAMES.index(
    "forward-pp-comm" if n in ("forward-send", "forward-recv")
    else "backward-pp-comm" if n in ("backward-send", "backward-recv") else n) for n in OPTYPES], np.int16)

COMM_GROUPS = frozenset(g for g in GROUP_NAMES if g not in ("forward-compute", "backward-compute", "optimizer", "gc"))
"""Attribution groups that are communication (for the communication verdict)."""
