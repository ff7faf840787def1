"""A slow worker's GPUs against its peers' (analyzers/hardware.py)."""
from analyzers.hardware import hardware_evidence


def _s(sm=1980, throttle="", temp=65, ecc=0, replays=0):
    return dict(sm_mhz=sm, mem_mhz=2619, power_w=650.0, power_limit_w=700.0, temp_c=temp, throttle=throttle,
                ecc_uncorrected=ecc, pcie_replays=replays)


def test_a_power_capped_gpu_is_told_apart_from_its_peers():
    samples = {r: _s() for r in range(8)}
    samples[5] = _s(sm=1140, throttle="software power cap")
    ev = hardware_evidence([5], samples)
    assert ev["sentence"] == "SM clock 1,140 MHz vs the peers' median 1,980; throttled: software power cap"
    assert {f["what"] for f in ev["findings"]} == {"sm_clock", "throttle"}


def test_heat_and_errors_count_and_alike_gpus_say_nothing():
    samples = {r: _s() for r in range(4)}
    samples[2] = _s(temp=88, ecc=4, replays=120)
    ev = hardware_evidence([2], samples)
    assert [f["what"] for f in ev["findings"]] == ["temperature", "ecc_uncorrected", "pcie_replays"]
    assert hardware_evidence([1], {r: _s() for r in range(4)}) == {}
    assert hardware_evidence([1], {1: _s(), 2: dict(_s(), sm_mhz=-1)}) == {}  # no sampled peer: nothing to say
    everyone = {r: _s(throttle="hardware thermal slowdown") for r in range(4)}
    assert hardware_evidence([0], everyone) == {}  # the whole rack is hot: not this worker's own cause
