"""A test double of the `pynvml` module (nvidia-ml-py) that behaves as NVML documents.

`FakeNvml` has the same function names, argument lists and return shapes as pynvml (it returns
pynvml's own ctypes structures where pynvml does), raises pynvml's own `NVMLError` subclasses
(`NVMLError_Uninitialized` before `nvmlInit`, `NVMLError_NotSupported`, `NVMLError_GpuIsLost`,
`NVMLError_Timeout` from `nvmlEventSetWait_v2`, ...), and delivers XID events injected with
`inject_xid` to the event sets registered for them. Constants and exception classes are pynvml's.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import pynvml

NVML_FUNCTIONS = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
)


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass
class FakeGpu:
    """One simulated GPU; `unsupported` names pynvml functions that answer NVML_ERROR_NOT_SUPPORTED."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    bus_id: str = "00000000:18:00.0"
    utilization_gpu: int = 97
    utilization_memory: int = 41
    memory_total: int = 85_520_809_984
    memory_used: int = 62_336_000_000
    temperature: int = 61
    power_mw: int = 532_114
    power_limit_mw: int = 700_000
    energy_mj: int = 91_803_447_123
    clocks_mhz: dict[int, int] = field(
        default_factory=lambda: {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}
    )
    max_clocks_mhz: dict[int, int] = field(
        default_factory=lambda: {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}
    )
    clock_event_reasons: int = 0
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    retired_pages: dict[int, list[int]] = field(default_factory=dict)
    retired_pages_pending: int = pynvml.NVML_FEATURE_DISABLED
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    nvlinks: list[int] = field(default_factory=list)
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    pcie_replays: int = 0
    unsupported: set[str] = field(default_factory=set)
    lost: bool = False


@dataclass(frozen=True)
class FakeHandle:
    """What nvmlDeviceGetHandleByIndex returns (an opaque device pointer in pynvml)."""

    index: int


@dataclass
class FakeEventData:
    """Same fields as pynvml.c_nvmlEventData_t."""

    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class FakeEventSet:
    registered: dict[int, int] = field(default_factory=dict)
    events: queue.Queue = field(default_factory=queue.Queue)
    freed: bool = False


class FakeNvml:
    """Module-like double of pynvml for `gpus` on a node with driver `driver_version`."""

    SUPPORTED_EVENTS = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError

    def __init__(
        self, gpus: list[FakeGpu], driver_version: str = "550.90.07", init_error: int | None = None
    ) -> None:
        self.gpus = gpus
        self.driver_version = driver_version
        # An NVML_ERROR_* code nvmlInit fails with (e.g. NVML_ERROR_DRIVER_NOT_LOADED), None to succeed.
        self.init_error = init_error
        self.init_count = 0
        self.calls: list[str] = []
        self.event_sets: list[FakeEventSet] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        """Constants, structures and exception classes are pynvml's own; unknown functions are a bug."""
        if (
            name.startswith("nvml")
            and callable(getattr(pynvml, name, None))
            and not name.startswith("nvmlEventType")
        ):
            raise AttributeError(f"fake_pynvml does not implement {name}")
        return getattr(pynvml, name)

    # -- library --------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        with self._lock:
            if self.init_error is not None:
                raise _error(self.init_error)
            self.init_count += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            if self.init_count == 0:
                raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
            self.init_count -= 1

    def _check(self, function: str) -> None:
        with self._lock:
            self.calls.append(function)
            if self.init_count == 0:
                raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, function: str, handle: FakeHandle) -> FakeGpu:
        self._check(function)
        if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(self.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if function in gpu.unsupported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return self.driver_version

    # -- devices --------------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return FakeHandle(index)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._gpu("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> pynvml.nvmlPciInfo_t:
        gpu = self._gpu("nvmlDeviceGetPciInfo", handle)
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.bus_id.encode()
        info.busIdLegacy = gpu.bus_id.encode()
        domain, bus, rest = gpu.bus_id.split(":")
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
        return info

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> pynvml.c_nvmlUtilization_t:
        gpu = self._gpu("nvmlDeviceGetUtilizationRates", handle)
        return pynvml.c_nvmlUtilization_t(gpu=gpu.utilization_gpu, memory=gpu.utilization_memory)

    def nvmlDeviceGetMemoryInfo(
        self, handle: FakeHandle, version: int | None = None
    ) -> pynvml.c_nvmlMemory_t:
        gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        return pynvml.c_nvmlMemory_t(
            total=gpu.memory_total, free=gpu.memory_total - gpu.memory_used, used=gpu.memory_used
        )

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        gpu = self._gpu("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        return self._gpu("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeHandle) -> int:
        return self._gpu("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetClockInfo", handle)
        if type not in gpu.clocks_mhz:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.clocks_mhz[type]

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeHandle, type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetMaxClockInfo", handle)
        if type not in gpu.max_clocks_mhz:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.max_clocks_mhz[type]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clock_event_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, errorType: int, counterType: int) -> int:
        gpu = self._gpu("nvmlDeviceGetTotalEccErrors", handle)
        return gpu.ecc.get((errorType, counterType), 0)

    def nvmlDeviceGetRetiredPages(self, device: FakeHandle, sourceFilter: int) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetRetiredPages", device)
        return list(gpu.retired_pages.get(sourceFilter, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: FakeHandle) -> int:
        return self._gpu("nvmlDeviceGetRetiredPagesPendingStatus", device).retired_pages_pending

    def nvmlDeviceGetRemappedRows(self, device: FakeHandle) -> tuple[int, int, int, int]:
        return self._gpu("nvmlDeviceGetRemappedRows", device).remapped_rows

    def nvmlDeviceGetNvLinkState(self, device: FakeHandle, link: int) -> int:
        gpu = self._gpu("nvmlDeviceGetNvLinkState", device)
        if not gpu.nvlinks:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.nvlinks):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlinks[link]

    def nvmlDeviceGetNvLinkErrorCounter(self, device: FakeHandle, link: int, counter: int) -> int:
        gpu = self._gpu("nvmlDeviceGetNvLinkErrorCounter", device)
        if not 0 <= link < len(gpu.nvlinks):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        return self._gpu("nvmlDeviceGetPcieReplayCounter", handle).pcie_replays

    # -- events ---------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._check("nvmlEventSetCreate")
        event_set = FakeEventSet()
        with self._lock:
            self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, eventTypes: int, eventSet: FakeEventSet) -> None:
        self._gpu("nvmlDeviceRegisterEvents", handle)
        if eventTypes & ~self.SUPPORTED_EVENTS:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            eventSet.registered[handle.index] = eventSet.registered.get(handle.index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: FakeEventSet, timeoutms: int) -> FakeEventData:
        self._check("nvmlEventSetWait_v2")
        if eventSet.freed:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        try:
            return eventSet.events.get(timeout=timeoutms / 1000)
        except queue.Empty:
            raise _error(pynvml.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        self._check("nvmlEventSetFree")
        eventSet.freed = True

    # -- test controls --------------------------------------------------------------------------
    def inject_xid(self, index: int, xid: int) -> int:
        """The driver reports XID `xid` on GPU `index`; returns how many event sets received it."""
        delivered = 0
        with self._lock:
            for event_set in self.event_sets:
                wanted = event_set.registered.get(index, 0) & pynvml.nvmlEventTypeXidCriticalError
                if wanted and not event_set.freed:
                    event_set.events.put(
                        FakeEventData(FakeHandle(index), pynvml.nvmlEventTypeXidCriticalError, xid)
                    )
                    delivered += 1
        return delivered
