"""Op types: the Megatron-LM names every layer speaks (docs/whatif.md, section 1).

The what-if model's integer codes for them are in ``analyzers/whatif/opcodes.py``.
"""
from __future__ import annotations

COMPUTE_OPTYPES = ("forward-compute", "backward-compute", "optimizer", "gc")
PP_OPTYPES = ("forward-send", "forward-recv", "backward-send", "backward-recv")
DP_OPTYPES = ("params-all-gather", "grads-reduce-scatter", "separate-grads-all-reduce")
SYNC_OPTYPES = (
    "embedding-grads-all-reduce",
    "optimizer-clip-main-grad",
    "layernorm-grads-all-reduce",
)
OPTYPES = COMPUTE_OPTYPES + PP_OPTYPES + DP_OPTYPES + SYNC_OPTYPES
"""Every op type the what-if model knows. Others are accepted and reported."""
