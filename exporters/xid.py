"""XID error counts from the NVML event API, gathered by a background thread.

`nvmlEventSetWait_v2` blocks, so one thread waits on one event set registered for
``nvmlEventTypeXidCriticalError`` on every GPU and counts events per GPU and XID value; scrapes read a
snapshot. A count per XID (plus the time of the last one) is kept rather than a "last XID" gauge.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


def handle_key(handle: Any) -> Any:
    """A hashable identity for an NVML device handle (a ctypes pointer in pynvml)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


@dataclass
class XidCounts:
    """XID events seen on one GPU since the agent started."""

    by_xid: dict[int, int] = field(default_factory=dict)
    last_timestamp: float = 0.0


class XidWatcher:
    """Counts XID critical-error events of the GPUs in `devices` (handle -> GPU index)."""

    def __init__(
        self,
        nvml: Any,
        devices: Mapping[Any, int],
        wait_ms: int = 500,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.nvml = nvml
        self.wait_ms = wait_ms
        self.clock = clock
        self._index_by_key = {handle_key(handle): index for handle, index in devices.items()}
        self._handles = list(devices)
        self._counts: dict[int, XidCounts] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self.watched: list[int] = []

    def start(self) -> None:
        """Register every GPU that supports XID events and start the waiting thread."""
        nvml = self.nvml
        self._event_set = nvml.nvmlEventSetCreate()
        for handle in self._handles:
            index = self._index_by_key[handle_key(handle)]
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._event_set)
            except nvml.NVMLError as exc:
                log.info("GPU %d: XID events not available (%s)", index, exc)
                continue
            self.watched.append(index)
        if not self.watched:
            self._free()
            return
        self._thread = threading.Thread(target=self._run, name="megatrace-xid", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nvml = self.nvml
        while not self._stop.is_set():
            try:
                event = nvml.nvmlEventSetWait_v2(self._event_set, self.wait_ms)
            except nvml.NVMLError_Timeout:
                continue
            except nvml.NVMLError as exc:
                log.warning("waiting for XID events failed: %s; retrying", exc)
                self._stop.wait(1.0)
                continue
            if event.eventType == nvml.nvmlEventTypeXidCriticalError:
                self._record(event)

    def _record(self, event: Any) -> None:
        index = self._index_by_key.get(handle_key(event.device))
        if index is None:
            log.warning("XID %d on a GPU this agent does not know", event.eventData)
            return
        xid = int(event.eventData)
        log.warning("GPU %d: XID %d", index, xid)
        with self._lock:
            counts = self._counts.setdefault(index, XidCounts())
            counts.by_xid[xid] = counts.by_xid.get(xid, 0) + 1
            counts.last_timestamp = self.clock()

    def snapshot(self) -> dict[int, XidCounts]:
        """A copy of the counts per GPU index (GPUs without events are absent)."""
        with self._lock:
            return {index: XidCounts(dict(c.by_xid), c.last_timestamp) for index, c in self._counts.items()}

    def stop(self) -> None:
        """Stop the thread (within one wait period) and free the event set."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.wait_ms / 1000 + 5)
            self._thread = None
        self._free()

    def _free(self) -> None:
        if self._event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self._event_set)
            except self.nvml.NVMLError as exc:
                log.debug("freeing the XID event set: %s", exc)
            self._event_set = None
