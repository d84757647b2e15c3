"""GPU collector driven by the pynvml test double: readings, NotSupported, lost GPUs, XID events."""

from __future__ import annotations

import inspect
import time

import pynvml
import pytest

from megatrace.exporters.cli import build_collectors
from megatrace.exporters.gpu import ALERTED_XIDS, GpuCollector
from megatrace.exporters.guard import GuardedCollectors
from megatrace.exporters.settings import load
from tests.exporters.exposition import names, promtool_check, render, samples, value
from tests.support.fake_pynvml import NVML_FUNCTIONS, FakeGpu, FakeNvml

CORRECTED, UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
VOLATILE, AGGREGATE = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC


def busy_gpu() -> FakeGpu:
    return FakeGpu(
        uuid="GPU-0f2c1a7e-5b1d-4c3e-9a41-3d0c2b1e9f10",
        bus_id="00000000:18:00.0",
        utilization_gpu=97,
        utilization_memory=41,
        memory_total=85_520_809_984,
        memory_used=62_336_000_000,
        temperature=61,
        power_mw=532_114,
        power_limit_mw=700_000,
        energy_mj=91_803_447_123,
        clock_event_reasons=(
            pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
        ),
        ecc={(CORRECTED, VOLATILE): 3, (CORRECTED, AGGREGATE): 12, (UNCORRECTED, AGGREGATE): 1},
        retired_pages={pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [0x1F000, 0x2A000]},
        retired_pages_pending=pynvml.NVML_FEATURE_ENABLED,
        remapped_rows=(4, 1, 1, 0),
        nvlinks=[1, 0],
        nvlink_errors={
            (0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 7,
            (1, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 2,
        },
        pcie_replays=5,
    )


def second_gpu() -> FakeGpu:
    return FakeGpu(uuid="GPU-7a9d33b0-2c51-4f0e-8e6d-1b2a3c4d5e6f", bus_id="00000000:2A:00.0")


@pytest.fixture
def collector_for():
    made: list[GpuCollector] = []

    def make(nvml: FakeNvml, **kwargs) -> GpuCollector:
        collector = GpuCollector(nvml, xid_wait_ms=20, **kwargs)
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.close()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_every_reading_in_base_units(collector_for) -> None:
    gpu = busy_gpu()
    text = render(collector_for(FakeNvml([gpu])))
    labels = {"gpu": "0", "uuid": gpu.uuid}

    assert value(text, "megatrace_gpu_up", **labels) == 1
    assert (
        value(
            text,
            "megatrace_gpu_info",
            **labels,
            name="NVIDIA H100 80GB HBM3",
            pci_bus_id="00000000:18:00.0",
            driver_version="550.90.07",
        )
        == 1
    )
    assert value(text, "megatrace_gpu_utilization_ratio", **labels) == pytest.approx(0.97)
    assert value(text, "megatrace_gpu_memory_utilization_ratio", **labels) == pytest.approx(0.41)
    assert value(text, "megatrace_gpu_memory_used_bytes", **labels) == 62_336_000_000
    assert value(text, "megatrace_gpu_memory_total_bytes", **labels) == 85_520_809_984
    assert value(text, "megatrace_gpu_temperature_celsius", **labels) == 61
    assert value(text, "megatrace_gpu_power_watts", **labels) == pytest.approx(532.114)
    assert value(text, "megatrace_gpu_power_limit_watts", **labels) == 700
    assert value(text, "megatrace_gpu_energy_joules_total", **labels) == pytest.approx(91_803_447.123)
    assert value(text, "megatrace_gpu_sm_clock_hertz", **labels) == 1980e6
    assert value(text, "megatrace_gpu_memory_clock_max_hertz", **labels) == 2619e6
    metric = "megatrace_gpu_clock_event_active"
    active = {dict(ls)["reason"]: v for (n, ls), v in samples(text).items() if n == metric}
    assert active == {
        "gpu_idle": 0,
        "applications_clocks_setting": 0,
        "sw_power_cap": 1,
        "hw_slowdown": 0,
        "sync_boost": 0,
        "sw_thermal_slowdown": 0,
        "hw_thermal_slowdown": 1,
        "hw_power_brake_slowdown": 0,
        "display_clock_setting": 0,
    }
    ecc = "megatrace_gpu_ecc_errors_total"
    assert value(text, ecc, **labels, error_type="corrected", counter_type="volatile") == 3
    assert value(text, ecc, **labels, error_type="corrected", counter_type="aggregate") == 12
    assert value(text, ecc, **labels, error_type="uncorrected", counter_type="aggregate") == 1
    assert value(text, "megatrace_gpu_retired_pages_total", **labels, cause="double_bit_ecc") == 2
    assert value(text, "megatrace_gpu_retired_pages_pending", **labels) == 1
    assert value(text, "megatrace_gpu_remapped_rows_total", **labels, error_type="correctable") == 4
    assert value(text, "megatrace_gpu_remapped_rows_total", **labels, error_type="uncorrectable") == 1
    assert value(text, "megatrace_gpu_remapped_rows_pending", **labels) == 1
    assert value(text, "megatrace_gpu_remapped_rows_failure", **labels) == 0
    assert value(text, "megatrace_gpu_nvlink_active", **labels, link="0") == 1
    assert value(text, "megatrace_gpu_nvlink_active", **labels, link="1") == 0
    assert value(text, "megatrace_gpu_nvlink_errors_total", **labels, link="0", error="replay") == 7
    assert value(text, "megatrace_gpu_nvlink_errors_total", **labels, link="1", error="crc_flit") == 2
    assert value(text, "megatrace_gpu_pcie_replays_total", **labels) == 5
    result = promtool_check(text)
    assert result.returncode == 0, result.stdout + result.stderr


def test_not_supported_readings_are_omitted_not_faked(collector_for) -> None:
    gpu = second_gpu()
    gpu.unsupported = {
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetCurrentClocksEventReasons",
    }
    text = render(collector_for(FakeNvml([gpu])))
    exported = names(text)
    for absent in (
        "megatrace_gpu_energy_joules_total",
        "megatrace_gpu_ecc_errors_total",
        "megatrace_gpu_remapped_rows_total",
        "megatrace_gpu_retired_pages_total",
        "megatrace_gpu_nvlink_active",  # no NVLink on this GPU: NVML answers NotSupported
    ):
        assert absent not in exported
    # older drivers: the throttle-reasons call answers when the clock-event one does not
    assert value(text, "megatrace_gpu_clock_event_active", gpu="0", reason="sw_power_cap") == 0
    assert value(text, "megatrace_gpu_temperature_celsius", gpu="0") == 61


def test_lost_gpu_is_down_and_the_others_keep_serving(collector_for) -> None:
    nvml = FakeNvml([busy_gpu(), second_gpu()])
    collector = collector_for(nvml)
    render(collector)
    nvml.gpus[0].lost = True

    text = render(collector)

    lost = {"gpu": "0", "uuid": nvml.gpus[0].uuid}
    assert value(text, "megatrace_gpu_up", **lost) == 0
    assert {n for (n, ls) in samples(text) if ("gpu", "0") in ls} == {
        "megatrace_gpu_up",
        "megatrace_gpu_xid_errors_total",
        "megatrace_gpu_last_xid_timestamp_seconds",
    }
    assert value(text, "megatrace_gpu_up", gpu="1") == 1
    assert value(text, "megatrace_gpu_temperature_celsius", gpu="1") == 61


def test_gpu_lost_before_start_is_down_until_nvml_hands_it_out(collector_for) -> None:
    nvml = FakeNvml([busy_gpu(), second_gpu()])
    nvml.gpus[1].lost = True
    collector = collector_for(nvml)

    text = render(collector)
    assert value(text, "megatrace_gpu_up", gpu="1", uuid="") == 0
    assert value(text, "megatrace_gpu_up", gpu="0") == 1

    nvml.gpus[1].lost = False
    text = render(collector)
    assert value(text, "megatrace_gpu_up", gpu="1", uuid=nvml.gpus[1].uuid) == 1


def test_xid_events_are_counted_per_value_with_the_last_time(collector_for) -> None:
    nvml = FakeNvml([busy_gpu(), second_gpu()])
    collector = collector_for(nvml)
    text = render(collector)
    assert value(text, "megatrace_gpu_xid_errors_total", gpu="1", xid="79") == 0
    assert value(text, "megatrace_gpu_last_xid_timestamp_seconds", gpu="1") == 0
    assert {dict(ls)["xid"] for (n, ls) in samples(text) if n == "megatrace_gpu_xid_errors_total"} == {
        str(x) for x in ALERTED_XIDS
    }

    before = time.time()
    assert nvml.inject_xid(1, 79) == 1
    assert nvml.inject_xid(1, 79) == 1
    assert nvml.inject_xid(0, 31) == 1
    assert nvml.inject_xid(0, 157) == 1
    wait_for(lambda: sum(sum(c.by_xid.values()) for c in collector.xid.snapshot().values()) == 4)
    text = render(collector)
    after = time.time()

    assert value(text, "megatrace_gpu_xid_errors_total", gpu="1", xid="79") == 2
    assert value(text, "megatrace_gpu_xid_errors_total", gpu="1", xid="31") == 0
    assert value(text, "megatrace_gpu_xid_errors_total", gpu="0", xid="31") == 1
    assert value(text, "megatrace_gpu_xid_errors_total", gpu="0", xid="157") == 1
    assert before <= value(text, "megatrace_gpu_last_xid_timestamp_seconds", gpu="1") <= after
    assert "megatrace_gpu_last_xid" not in {n for n in names(text) if n.endswith("_xid")}


def test_gpu_without_xid_events_gets_no_xid_series(collector_for) -> None:
    nvml = FakeNvml([busy_gpu(), second_gpu()])
    nvml.gpus[0].unsupported = {"nvmlDeviceRegisterEvents"}
    text = render(collector_for(nvml))
    assert not [ls for (n, ls) in samples(text) if n.startswith("megatrace_gpu_xid") and ("gpu", "0") in ls]
    assert value(text, "megatrace_gpu_xid_errors_total", gpu="1", xid="48") == 0


def test_xid_thread_stops_cleanly_and_nvml_is_released(collector_for) -> None:
    nvml = FakeNvml([busy_gpu()])
    collector = collector_for(nvml)
    render(collector)
    watcher = collector.xid
    thread = watcher._thread
    assert thread is not None and thread.is_alive()

    collector.close()

    assert not thread.is_alive()
    assert all(event_set.freed for event_set in nvml.event_sets)
    assert nvml.init_count == 0


def test_agent_counts_xids_that_arrive_before_its_first_scrape() -> None:
    """NVML keeps no history of events: the agent registers for XIDs when it starts, not at a scrape."""
    nvml = FakeNvml([busy_gpu(), second_gpu()])
    config = load(None, {"collectors": ["gpu"], "podresources_socket": "", "xid_wait_ms": 20}, environ={})
    guarded = build_collectors(config, nvml=nvml)
    try:
        assert nvml.inject_xid(1, 79) == 1
        watcher = guarded.collectors["gpu"].xid
        wait_for(lambda: watcher.snapshot().get(1) is not None)
        assert value(render(guarded), "megatrace_gpu_xid_errors_total", gpu="1", xid="79") == 1
    finally:
        guarded.close()
    assert nvml.init_count == 0


def test_nvml_that_cannot_start_with_the_agent_is_tried_again_at_each_scrape(collector_for) -> None:
    nvml = FakeNvml([busy_gpu()], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    collector = collector_for(nvml)
    collector.start()
    assert (collector.xid, nvml.inject_xid(0, 79)) == (None, 0)
    nvml.init_error = None
    assert value(render(collector), "megatrace_gpu_up", gpu="0") == 1
    assert nvml.inject_xid(0, 79) == 1


def test_nvml_that_cannot_start_marks_the_collector_down_then_recovers(collector_for) -> None:
    nvml = FakeNvml([busy_gpu()], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    guarded = GuardedCollectors({"gpu": collector_for(nvml)})

    text = render(guarded)
    assert value(text, "megatrace_exporter_collector_up", collector="gpu") == 0
    assert value(text, "megatrace_exporter_collector_errors_total", collector="gpu") == 1
    assert "megatrace_gpu_up" not in names(text)

    nvml.init_error = None
    text = render(guarded)
    assert value(text, "megatrace_exporter_collector_up", collector="gpu") == 1
    assert value(text, "megatrace_exporter_collector_errors_total", collector="gpu") == 1
    assert value(text, "megatrace_gpu_up", gpu="0") == 1


def test_pod_attribution_as_an_info_series(collector_for) -> None:
    gpu = busy_gpu()
    pods = {gpu.uuid: ("ml-train", "llama-70b-worker-3", "trainer")}
    text = render(collector_for(FakeNvml([gpu, second_gpu()]), pods=lambda: pods))
    info = "megatrace_gpu_pod_info"
    owner = {"namespace": "ml-train", "pod": "llama-70b-worker-3", "container": "trainer"}
    assert value(text, info, gpu="0", **owner) == 1
    assert not [ls for (n, ls) in samples(text) if n == info and ("gpu", "1") in ls]


@pytest.mark.parametrize("function", NVML_FUNCTIONS)
def test_double_has_pynvml_signatures(function: str) -> None:
    theirs = [p.name for p in inspect.signature(getattr(pynvml, function)).parameters.values()]
    ours = [p.name for p in inspect.signature(getattr(FakeNvml, function)).parameters.values()][1:]
    assert ours == theirs


def test_double_raises_pynvml_errors() -> None:
    nvml = FakeNvml([busy_gpu()])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    event_set = nvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(event_set, 1)
    nvml.gpus[0].lost = True
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlShutdown()
