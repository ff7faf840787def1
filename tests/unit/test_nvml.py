"""The GPU sampled with every heartbeat through NVML, a fake NVML here (CI has no GPU)."""
from __future__ import annotations

import types

from core import schema as S
from ingest.exporter import RankExporter
from ingest.nvml import NvmlSampler, throttle_names


def fake_nvml(sm=1980, power_mw=650_000, reasons=0x0, fail_after=None, ecc=True):
    calls = {"n": 0}

    def clock(h, which):
        calls["n"] += 1
        if fail_after is not None and calls["n"] > fail_after:
            raise RuntimeError("GPU is lost")
        return sm if which == 1 else 2619

    def ecc_errors(h, kind, counter):
        if not ecc:
            raise RuntimeError("ECC mode is disabled")
        return 3
    return types.SimpleNamespace(
        NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0, nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
        nvmlDeviceGetClockInfo=clock, nvmlDeviceGetPowerUsage=lambda h: power_mw,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000, nvmlDeviceGetTemperature=lambda h, s: 71,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: reasons, nvmlDeviceGetTotalEccErrors=ecc_errors,
        nvmlDeviceGetPcieReplayCounter=lambda h: 12)


def test_a_sample_reads_clocks_power_heat_throttling_and_errors():
    s = NvmlSampler(fake_nvml(sm=1140, reasons=0x4 | 0x1), index=0).sample()
    assert (s.sm_mhz, s.mem_mhz, s.power_w, s.power_limit_w, s.temp_c) == (1140, 2619, 650.0, 700.0, 71)
    assert s.throttle == "software power cap"  # an idle GPU is not a fault
    assert (s.ecc_uncorrected, s.pcie_replays) == (3, 12)
    assert NvmlSampler(fake_nvml(ecc=False), index=0).sample().ecc_uncorrected == -1
    assert throttle_names(0x40 | 0x8) == "hardware slowdown, hardware thermal slowdown"


def test_without_nvml_or_with_a_lost_gpu_nothing_is_sampled_and_nothing_breaks():
    absent = types.SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(OSError("libnvidia-ml.so.1 not found")))
    s = NvmlSampler(absent)
    assert s.sample() is None and "libnvidia-ml" in s.unavailable
    lost = NvmlSampler(fake_nvml(fail_after=2), index=0)
    assert lost.sample() is not None and lost.sample() is None and "GPU is lost" in lost.unavailable


def test_heartbeats_carry_the_sample_and_say_minus_one_without_one():
    sent = []
    exp = RankExporter("j", 0, 0, 0, sent.append, heartbeat_s=3600, tcp_flows=False, nvml=fake_nvml(sm=1200))
    row = exp.heartbeat().to_pylist()[0]
    assert (row["gpu_sm_mhz"], row["gpu_power_w"], row["gpu_temp_c"]) == (1200, 650.0, 71)
    bare = RankExporter("j", 1, 0, 0, sent.append, heartbeat_s=3600, tcp_flows=False).heartbeat()
    assert bare.schema.equals(S.HEARTBEAT, check_metadata=False)
    assert bare.to_pylist()[0]["gpu_sm_mhz"] == -1 and bare.to_pylist()[0]["gpu_throttle"] == ""
    exp.close()


def test_the_shard_stores_a_sample_a_minute_per_rank_and_keeps_the_latest_for_evidence():
    from core import codec
    from ray_jobs.hang_monitor import HangReducer
    from tests.fakes import ManualClock

    clock = ManualClock()
    mon = HangReducer(clock=clock, gpu_every_s=60.0)

    def hb(rank, ts, sm):
        exp = RankExporter("j", rank, 0, 0, lambda t: None, heartbeat_s=3600, tcp_flows=False,
                           nvml=fake_nvml(sm=sm))
        row = exp.heartbeat().to_pylist()[0]
        exp.close()
        return codec.from_rows(S.HEARTBEAT, [dict(row, ts_ns=ts)])
    stored = []
    for i in range(30):  # a heartbeat every 5 s from two ranks, rank 1 power-capped
        clock.t = 5.0 * i
        for rank, sm in ((0, 1980), (1, 1140)):
            mon.add("heartbeat", hb(rank, 10**12 + i * 5 * 10**9, sm), now=clock.t)
        stored += [t for u in mon.due(clock.t) for k, t in u.tables.items() if k == "gpu_sample"]
    rows = [r for t in stored for r in t.to_pylist()]
    assert len(stored) == 3 and len(rows) == 6  # at 0, 60 and 120 s, one row per rank each time
    assert {r["rank"]: r["sm_mhz"] for r in rows} == {0: 1980, 1: 1140}
    assert mon.gpu_of("j", 0)[1]["sm_mhz"] == 1140 and mon.gpu_of("j", 0)[1]["throttle"] == ""
