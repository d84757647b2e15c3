"""GPU collector: NVML readings of every GPU on the node, per scrape, plus XID counts and pod attribution.

NVML is reached through one seam, the `nvml` module object (``pynvml`` in production, a test double
in tests). A reading NVML does not support is omitted, never faked; a GPU that is lost reports
``megatrace_gpu_up=0`` and the other GPUs keep serving. Series are labelled ``gpu`` (index) and ``uuid``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from megatrace.exporters.collector_settings import setting
from megatrace.exporters.families import FamilySet
from megatrace.exporters.guard import CollectorDown
from megatrace.exporters.podresources import PodLookup, configured_lookup, socket_setting
from megatrace.exporters.xid import XidWatcher

if TYPE_CHECKING:
    from megatrace.exporters.settings import ExporterConfig

log = logging.getLogger(__name__)

# Bits of nvmlDeviceGetCurrentClocksEventReasons, as exported in the `reason` label.
CLOCK_EVENT_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)

# XIDs exported as 0 from the start on every watched GPU, so that `increase()` sees their first event.
ALERTED_XIDS: tuple[int, ...] = (13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 74, 79, 92, 94, 95, 119, 120)

NVLINK_ERRORS: tuple[tuple[str, str], ...] = (
    ("replay", "NVML_NVLINK_ERROR_DL_REPLAY"),
    ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY"),
    ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
    ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
)

# (kind "gauge"/"counter", name after megatrace_gpu_, help, labels, value)
Reading = tuple[str, str, str, dict[str, str], float]


def load_nvml() -> ModuleType:
    """The real NVML bindings (the nvidia-ml-py package)."""
    import pynvml

    return pynvml


def _down_reason(exc: Exception) -> str:
    return f"NVML not available ({exc})"


class GpuLost(Exception):
    """NVML says the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)."""


@dataclass
class Gpu:
    """One GPU slot: its index, its handle (None until NVML hands one out) and its UUID once known."""

    index: int
    handle: Any = None
    uuid: str = ""


class GpuCollector:
    """Reads every GPU through `nvml` at each scrape; owns the XID watcher thread."""

    def __init__(self, nvml: Any = None, pods: PodLookup | None = None, xid_wait_ms: int = 500) -> None:
        self.nvml = nvml if nvml is not None else load_nvml()
        self.pods = pods
        self.xid_wait_ms = xid_wait_ms
        self.xid: XidWatcher | None = None
        self._gpus: list[Gpu] | None = None
        self._driver = ""
        self._announced = ""  # why NVML could not start with the agent, as logged then
        self._lock = threading.Lock()

    def start(self) -> None:
        """Open NVML and watch for XIDs now: NVML reports no event that happened before it was asked to.

        Without this, XIDs between the agent's start and its first scrape would be lost. A failure is
        logged; each scrape tries again.
        """
        try:
            self._init()
        except self.nvml.NVMLError as exc:
            self._announced = _down_reason(exc)
            log.warning(
                '%s: no GPU series, collector_up{collector="gpu"} 0 (normal on a node without GPUs); '
                "retrying at each scrape",
                self._announced,
            )

    def _init(self) -> list[Gpu]:
        with self._lock:
            if self._gpus is None:
                nvml = self.nvml
                nvml.nvmlInit()
                try:
                    self._driver = _text(nvml.nvmlSystemGetDriverVersion())
                    gpus = [Gpu(index) for index in range(nvml.nvmlDeviceGetCount())]
                except nvml.NVMLError:
                    nvml.nvmlShutdown()
                    raise
                for gpu in gpus:
                    self._open(gpu)
                self.xid = XidWatcher(
                    nvml, {gpu.handle: gpu.index for gpu in gpus if gpu.handle is not None}, self.xid_wait_ms
                )
                self.xid.start()
                self._gpus = gpus
            return self._gpus

    def _open(self, gpu: Gpu) -> bool:
        """Get the GPU's handle and UUID; False while NVML cannot hand them out."""
        try:
            handle = self.nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            gpu.uuid = _text(self.nvml.nvmlDeviceGetUUID(handle))
        except self.nvml.NVMLError as exc:
            log.warning("GPU %d unavailable: %s", gpu.index, exc)
            return False
        gpu.handle = handle
        return True

    def collect(self) -> Iterator[Metric]:
        try:
            gpus = self._init()
        except self.nvml.NVMLError as exc:
            reason = _down_reason(exc)
            raise CollectorDown(reason, announced=reason == self._announced) from None
        families = FamilySet("gpu")
        xids = self.xid.snapshot() if self.xid is not None else {}
        watched = set(self.xid.watched) if self.xid is not None else set()
        pods = self.pods() if self.pods is not None else {}
        for gpu in gpus:
            readings = self._read_gpu(gpu)
            labels = {"gpu": str(gpu.index), "uuid": gpu.uuid}
            families.gauge(
                "up",
                "1 when NVML answers for the GPU, 0 when it is lost.",
                labels,
                0.0 if readings is None else 1.0,
            )
            for kind, name, doc, sample_labels, value in readings or ():
                getattr(families, kind)(name, doc, sample_labels, value)
            self._xid_series(families, labels, xids.get(gpu.index), gpu.index in watched)
            pod = pods.get(gpu.uuid)
            if pod is not None:
                namespace, name, container = pod
                families.gauge(
                    "pod_info",
                    "The Kubernetes pod holding the GPU (from the kubelet PodResources API).",
                    {**labels, "namespace": namespace, "pod": name, "container": container},
                    1.0,
                )
        return iter(families.families())

    def _read_gpu(self, gpu: Gpu) -> list[Reading] | None:
        """All readings of one GPU, or None when it is down (lost, or no handle to be had)."""
        if gpu.handle is None and not self._open(gpu):
            return None
        try:
            return self._read(gpu.handle, {"gpu": str(gpu.index), "uuid": gpu.uuid})
        except GpuLost:
            log.warning("GPU %d (%s) is lost", gpu.index, gpu.uuid)
            return None

    @staticmethod
    def _xid_series(families: FamilySet, labels: dict[str, str], counts: Any, watched: bool) -> None:
        if not watched and counts is None:
            return
        seen = counts.by_xid if counts is not None else {}
        for xid in sorted(set(ALERTED_XIDS) | set(seen)):
            families.counter(
                "xid_errors_total",
                "XID critical errors reported by the driver since the agent started, per XID value.",
                {**labels, "xid": str(xid)},
                seen.get(xid, 0),
            )
        families.gauge(
            "last_xid_timestamp_seconds",
            "Unix time of the GPU's last XID error (0: none since the agent started).",
            labels,
            counts.last_timestamp if counts is not None else 0.0,
        )

    def _call(self, name: str, *args: Any) -> Any:
        """Call an NVML function; None when unsupported or failing, GpuLost when the GPU is gone."""
        nvml = self.nvml
        function = getattr(nvml, name, None)
        if function is None:
            return None
        try:
            return function(*args)
        except nvml.NVMLError_GpuIsLost as exc:
            raise GpuLost() from exc
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
            return None
        except nvml.NVMLError as exc:
            log.debug("%s%s failed: %s", name, args[1:], exc)
            return None

    def _read(self, handle: Any, labels: dict[str, str]) -> list[Reading]:
        nvml = self.nvml
        out: list[Reading] = []

        def gauge(name: str, doc: str, value: float | None, extra: dict[str, str] | None = None) -> None:
            if value is not None:
                out.append(("gauge", name, doc, {**labels, **(extra or {})}, float(value)))

        def counter(name: str, doc: str, value: float | None, extra: dict[str, str] | None = None) -> None:
            if value is not None:
                out.append(("counter", name, doc, {**labels, **(extra or {})}, float(value)))

        name = self._call("nvmlDeviceGetName", handle)
        pci = self._call("nvmlDeviceGetPciInfo", handle)
        gauge(
            "info",
            "GPU identity.",
            1.0,
            {
                "name": _text(name) if name is not None else "",
                "pci_bus_id": _text(pci.busId) if pci is not None else "",
                "driver_version": self._driver,
            },
        )
        util = self._call("nvmlDeviceGetUtilizationRates", handle)
        if util is not None:
            gauge(
                "utilization_ratio",
                "Fraction of the last sample period a kernel was running.",
                util.gpu / 100,
            )
            gauge(
                "memory_utilization_ratio",
                "Fraction of the last sample period device memory was being read or written.",
                util.memory / 100,
            )
        memory = self._call("nvmlDeviceGetMemoryInfo", handle)
        if memory is not None:
            gauge("memory_used_bytes", "Device memory in use.", memory.used)
            gauge("memory_total_bytes", "Device memory installed.", memory.total)
        gauge(
            "temperature_celsius",
            "GPU core temperature.",
            self._call("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU),
        )
        gauge("power_watts", "Power draw.", _scaled(self._call("nvmlDeviceGetPowerUsage", handle), 1e-3))
        gauge(
            "power_limit_watts",
            "Power limit the driver enforces.",
            _scaled(self._call("nvmlDeviceGetEnforcedPowerLimit", handle), 1e-3),
        )
        counter(
            "energy_joules_total",
            "Energy used since the driver was loaded.",
            _scaled(self._call("nvmlDeviceGetTotalEnergyConsumption", handle), 1e-3),
        )
        for clock, constant in (("sm", nvml.NVML_CLOCK_SM), ("memory", nvml.NVML_CLOCK_MEM)):
            gauge(
                f"{clock}_clock_hertz",
                f"Current {clock} clock.",
                _scaled(self._call("nvmlDeviceGetClockInfo", handle, constant), 1e6),
            )
            gauge(
                f"{clock}_clock_max_hertz",
                f"Maximum {clock} clock.",
                _scaled(self._call("nvmlDeviceGetMaxClockInfo", handle, constant), 1e6),
            )
        reasons = self._call("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if reasons is None:
            reasons = self._call("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        if reasons is not None:
            for reason, bit in CLOCK_EVENT_REASONS:
                gauge(
                    "clock_event_active",
                    "1 while the reason holds the clocks down (NVML clock event / throttle reasons).",
                    1.0 if reasons & bit else 0.0,
                    {"reason": reason},
                )
        self._read_memory_errors(handle, counter, gauge)
        self._read_nvlink(handle, counter, gauge)
        counter(
            "pcie_replays_total",
            "PCIe replays (link-level retransmissions).",
            self._call("nvmlDeviceGetPcieReplayCounter", handle),
        )
        return out

    def _read_memory_errors(
        self, handle: Any, counter: Callable[..., None], gauge: Callable[..., None]
    ) -> None:
        nvml = self.nvml
        for error_type, type_constant in (
            ("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
            for counter_type, counter_constant in (
                ("volatile", nvml.NVML_VOLATILE_ECC),
                ("aggregate", nvml.NVML_AGGREGATE_ECC),
            ):
                counter(
                    "ecc_errors_total",
                    "ECC memory errors; volatile: since the driver loaded, aggregate: over the GPU's life.",
                    self._call("nvmlDeviceGetTotalEccErrors", handle, type_constant, counter_constant),
                    {"error_type": error_type, "counter_type": counter_type},
                )
        for cause, constant in (
            ("multiple_single_bit_ecc", nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
            ("double_bit_ecc", nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
        ):
            pages = self._call("nvmlDeviceGetRetiredPages", handle, constant)
            counter(
                "retired_pages_total",
                "Memory pages retired, per cause.",
                len(pages) if pages is not None else None,
                {"cause": cause},
            )
        gauge(
            "retired_pages_pending",
            "1 when page retirements wait for the next driver reload.",
            self._call("nvmlDeviceGetRetiredPagesPendingStatus", handle),
        )
        rows = self._call("nvmlDeviceGetRemappedRows", handle)
        if rows is not None:
            correctable, uncorrectable, pending, failure = rows
            for error_type, value in (("correctable", correctable), ("uncorrectable", uncorrectable)):
                counter(
                    "remapped_rows_total",
                    "Memory rows remapped, per error type.",
                    value,
                    {"error_type": error_type},
                )
            gauge(
                "remapped_rows_pending",
                "1 when a row remapping waits for a GPU reset.",
                1.0 if pending else 0.0,
            )
            gauge("remapped_rows_failure", "1 when a row remapping failed.", 1.0 if failure else 0.0)

    def _read_nvlink(self, handle: Any, counter: Callable[..., None], gauge: Callable[..., None]) -> None:
        nvml = self.nvml
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            state = self._call("nvmlDeviceGetNvLinkState", handle, link)
            if state is None:
                continue
            link_label = {"link": str(link)}
            gauge("nvlink_active", "1 when the NVLink link is active.", 1.0 if state else 0.0, link_label)
            for error, constant in NVLINK_ERRORS:
                counter(
                    "nvlink_errors_total",
                    "NVLink data-link errors per link and kind (replay, recovery, crc_flit, crc_data).",
                    self._call("nvmlDeviceGetNvLinkErrorCounter", handle, link, getattr(nvml, constant)),
                    {**link_label, "error": error},
                )

    def close(self) -> None:
        """Stop the XID thread and release NVML."""
        with self._lock:
            if self.xid is not None:
                self.xid.stop()
                self.xid = None
            if self._gpus is not None:
                self.nvml.nvmlShutdown()
                self._gpus = None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


@dataclass(frozen=True)
class GpuSettings:
    """The GPU collector's keys."""

    podresources_socket: str = socket_setting()
    xid_wait_ms: int = setting(500, "timeout of each NVML event wait of the XID watcher", metavar="MS")

    def problems(self, enabled: bool) -> list[str]:
        return ["key 'xid_wait_ms': must be at least 1"] if self.xid_wait_ms < 1 else []


SETTINGS = GpuSettings


def build(settings: GpuSettings, agent: ExporterConfig, nvml: Any = None) -> GpuCollector:
    """The agent's GPU collector (`collectors` table entry "gpu"), started."""
    gpu = GpuCollector(
        nvml, pods=configured_lookup(settings.podresources_socket), xid_wait_ms=settings.xid_wait_ms
    )
    gpu.start()
    return gpu
