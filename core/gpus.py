"""What a GPU can do at most, by the name its driver reports.

Both sides need it: the tracer registers a job's peak FLOP/s when it starts (``ingest``) and the MFU of a
stored window falls back to it when a registration says 0 (``analyzers.mfu``), so it lives below both.
"""
from __future__ import annotations

import re

PEAK_FLOPS_BY_GPU = {
    "A100": 312e12, "A800": 312e12, "A40": 149.7e12, "A10": 125e12, "L4": 121e12, "L40": 181e12, "L40S": 362e12,
    "H100": 989e12, "H800": 989e12, "H200": 989e12, "GH200": 989e12, "H20": 148e12,
    "B100": 1.75e15, "B200": 2.25e15, "GB200": 2.5e15,
}
"""Dense BF16 peak FLOP/s of one GPU by type (vendor data sheets, the SXM/OAM parts). A name is matched by
its model number as ``torch.cuda.get_device_name()`` spells it (``"NVIDIA H100 80GB HBM3"``); the PCIe and
NVL variants of a part, slower, are in ``_VARIANTS``."""

_VARIANTS = {("H100", "PCIE"): 756e12, ("H100", "NVL"): 835e12, ("H200", "NVL"): 835e12}


def peak_flops_of(gpu_name: str) -> float:
    """Dense BF16 peak FLOP/s of the GPU called ``gpu_name``; 0 for a name not in the table (or a CPU)."""
    text = str(gpu_name or "").upper()
    names = re.findall(r"[A-Z]+\d+[A-Z]?", text)  # "NVIDIA H100-80GB", "NVIDIA L40S"
    words = set(re.findall(r"[A-Z]+", text))
    for n in names:
        if n in PEAK_FLOPS_BY_GPU:  # exactly: an A10G is not an A10
            variant = next((v for (part, w), v in _VARIANTS.items() if part == n and w in words), None)
            return variant or PEAK_FLOPS_BY_GPU[n]
    return 0.0
