"""What the GPU says of itself: clocks, power, temperature, throttling and errors, sampled beside training.

A ``worker`` verdict names the slow worker but not why; the GPU often can: an
SM clock held down by a power cap or heat, ECC errors, PCIe replays
(MegaScale, Megatron's straggler detector and Minder read these). The
exporter's heartbeat thread samples the rank's own GPU through NVML
(``nvidia-ml-py``) every heartbeat and sends the sample with it
(``core.schema.HEARTBEAT``'s ``gpu_*`` fields), never from the training thread.

Without NVML (no GPU, no driver, the package missing) ``NvmlSampler.sample``
returns None once it has said why in ``unavailable``: nothing is sampled and
nothing breaks. ``nvml`` is injected (``pynvml`` by default) so tests drive a
fake with NVML's calls.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

# NVML's clocks-event (throttle) reason bits, by the names an on-call engineer reads.
THROTTLE_REASONS = {
    0x1: "gpu idle", 0x2: "application clocks setting", 0x4: "software power cap", 0x8: "hardware slowdown",
    0x10: "sync boost", 0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
    0x80: "hardware power brake", 0x100: "display clock setting",
}
_IGNORED = 0x1 | 0x2 | 0x10  # idle, a set clock and sync boost are not faults


@dataclasses.dataclass(frozen=True)
class GpuSample:
    sm_mhz: int
    mem_mhz: int
    power_w: float
    power_limit_w: float
    temp_c: int
    throttle: str               # the reasons that hold the clock down, comma-separated; '' if none
    ecc_uncorrected: int        # volatile (since the driver loaded); -1 where not supported
    pcie_replays: int           # -1 where not supported

    def fields(self) -> dict[str, Any]:
        """The HEARTBEAT fields of this sample."""
        return {f"gpu_{k}": v for k, v in dataclasses.asdict(self).items()}


NO_SAMPLE = {"gpu_sm_mhz": -1, "gpu_mem_mhz": -1, "gpu_power_w": -1.0, "gpu_power_limit_w": -1.0, "gpu_temp_c": -1,
             "gpu_throttle": "", "gpu_ecc_uncorrected": -1, "gpu_pcie_replays": -1}
"""The HEARTBEAT fields where nothing was sampled."""


def throttle_names(mask: int) -> str:
    return ", ".join(name for bit, name in THROTTLE_REASONS.items() if mask & bit and not bit & _IGNORED)


def local_gpu_index() -> int:
    """The GPU this rank uses: torch's current device where torch has initialised CUDA, else LOCAL_RANK."""
    try:
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:
        pass
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


class NvmlSampler:
    """Samples one GPU; ``sample()`` returns a ``GpuSample`` or None (no NVML: ``unavailable`` says why)."""

    def __init__(self, nvml=None, index: int | None = None):
        self.unavailable = ""
        self._nvml = nvml
        self._handle = None
        self._index = index
        self.samples = 0

    def _open(self) -> bool:
        if self._handle is not None or self.unavailable:
            return self._handle is not None
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            index = local_gpu_index() if self._index is None else self._index
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            return True
        except Exception as e:  # no driver, no GPU, no package: nothing to sample, nothing to break
            self.unavailable = f"NVML unavailable ({type(e).__name__}: {e})"[:300]
            return False

    def sample(self) -> GpuSample | None:
        if not self._open():
            return None
        n, h = self._nvml, self._handle
        try:
            sm = int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))
            mem = int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))
            power = n.nvmlDeviceGetPowerUsage(h) / 1000.0
            limit = n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
            temp = int(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
            get_reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                n.nvmlDeviceGetCurrentClocksThrottleReasons  # the name before NVML 12.2
            reasons = throttle_names(int(get_reasons(h)))
        except Exception as e:  # a GPU that fell off the bus says so here, once: the heartbeat goes on
            self.unavailable = f"NVML failed ({type(e).__name__}: {e})"[:300]
            self._handle = None
            return None
        self.samples += 1
        return GpuSample(sm, mem, power, limit, temp, reasons, self._optional(
            lambda: n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)),
            self._optional(lambda: n.nvmlDeviceGetPcieReplayCounter(h)))

    @staticmethod
    def _optional(read) -> int:
        """A counter some GPUs do not keep (ECC off, no PCIe replay counter): -1 then."""
        try:
            return int(read())
        except Exception:
            return -1
