"""Tracer collector: live per-rank counters from the ring files the tracer keeps in the trace directory.

Reads only the header (28 KiB) of each ``<trace_dir>/<job>/rank-<N>.trace`` per scrape. Series carry
``job`` (the training job) and ``rank`` as the file's folder and name give them, and ``local_rank``
(per-communicator series also ``comm``);
Prometheus must scrape with ``honor_labels: true`` so `job` is kept. A rank is alive while its
header says it has not finished and its writer still holds its lock on the file, which works across
PID namespaces (for files from writers that do not lock: while its pid exists in ours).
``megatrace_tracer_rank_finished`` tells a clean exit from a death. Ranks that are no longer alive keep
being exported for a grace period (so ``megatrace_tracer_rank_alive=0`` is seen), then dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from megatrace.exporters.collector_settings import setting
from megatrace.exporters.families import FamilySet
from megatrace.regular_files import is_regular
from megatrace.tracer.format import PAUSE_KIND_NAMES, quantile_upper_ns
from megatrace.tracer.ringfile import RingFormatError, RingHeader, read_header, writer_holds_lock

if TYPE_CHECKING:
    from megatrace.exporters.settings import ExporterConfig

log = logging.getLogger(__name__)

NS = 1e-9


def process_exists(pid: int) -> bool:
    """Whether a process with `pid` exists in this PID namespace."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def writer_alive(path: Path, header: RingHeader) -> bool:
    """Whether the process writing `path` runs: its lock on the file (any PID namespace), else its pid."""
    if header.writer_locks:
        held = writer_holds_lock(path)
        if held is not None:
            return held
    return process_exists(header.pid)


class TracerCollector:
    """Exports every rank file under `trace_dir`; dead or finished ranks vanish after `grace_seconds`."""

    def __init__(
        self,
        trace_dir: str | Path,
        grace_seconds: float = 300.0,
        clock: Callable[[], float] = time.time,
        is_alive: Callable[[Path, RingHeader], bool] = writer_alive,
    ) -> None:
        self.trace_dir = Path(trace_dir)
        self.grace_seconds = grace_seconds
        self.clock = clock
        self.is_alive = is_alive
        self._gone_since: dict[Path, float] = {}
        self._lock = threading.Lock()

    def rank_files(self) -> list[Path]:
        """Ring files of all jobs (regular files only: a FIFO would hang the read), sorted by job folder
        then rank."""
        found = [
            path for path in self.trace_dir.glob("*/rank-*.trace") if _rank_of(path) >= 0 and is_regular(path)
        ]
        return sorted(found, key=lambda p: (p.parent.name, _rank_of(p)))

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        families = FamilySet("tracer")
        seen: set[Path] = set()
        for path in self.rank_files():
            try:
                header = read_header(path)
            except RingFormatError as exc:
                log.debug("skipping %s: %s", path, exc)
                continue
            seen.add(path)
            alive = not header.finished and self.is_alive(path, header)
            if not self._still_exported(path, alive, now):
                continue
            self._export(families, header, path.parent.name, _rank_of(path), alive, now)
        with self._lock:
            for path in set(self._gone_since) - seen:
                del self._gone_since[path]
        return iter(families.families())

    def _still_exported(self, path: Path, alive: bool, now: float) -> bool:
        with self._lock:
            if alive:
                self._gone_since.pop(path, None)
                return True
            since = self._gone_since.setdefault(path, now)
        return now - since <= self.grace_seconds

    @staticmethod
    def _export(families: FamilySet, h: RingHeader, folder: str, rank: int, alive: bool, now: float) -> None:
        # job and rank from where the file is (<trace_dir>/<job>/rank-<N>.trace), never from what it
        # says: a file in another job's folder must not speak for that job
        labels = {"job": folder, "rank": str(rank), "local_rank": str(h.local_rank)}
        for op, calls in sorted(h.calls_by_op.items()):
            if calls:
                op_labels = {**labels, "op": op}
                families.counter(
                    "collective_calls_total", "Collective calls the rank issued, per op.", op_labels, calls
                )
                families.counter(
                    "collective_bytes_total",
                    "Bytes the rank's collectives carried, per op.",
                    op_labels,
                    h.bytes_by_op.get(op, 0),
                )
        families.counter(
            "collective_wait_seconds_total",
            "Time the rank spent waiting for collectives to complete.",
            labels,
            h.wait_ns_total * NS,
        )
        families.gauge(
            "last_progress_timestamp_seconds",
            "Unix time the rank last completed a collective (its start time before the first).",
            labels,
            max(h.last_complete_ns, h.start_time_ns) * NS,
        )
        inflight = _inflight_age(h.oldest_inflight_enqueue_ns, h.finished, now)
        families.gauge(
            "oldest_inflight_seconds",
            "Age of the rank's oldest collective still in flight (0 when none).",
            labels,
            inflight,
        )
        if h.stall_threshold_ns > 0:
            families.gauge(
                "stall_threshold_seconds",
                "The rank's stall sensitivity (MEGATRACE_TRACE_STALL_MS); absent when its file does not say.",
                labels,
                h.stall_threshold_ns * NS,
            )
        families.counter("steps_total", "Training steps the rank completed.", labels, h.step_count)
        if h.step_count:
            families.gauge(
                "last_step_duration_seconds",
                "Duration of the rank's last training step.",
                labels,
                h.last_step_ns * NS,
            )
        families.gauge(
            "rank_alive",
            "1 while the rank's process runs and has not finished, 0 once it exited or died.",
            labels,
            1.0 if alive else 0.0,
        )
        families.gauge(
            "rank_finished",
            "1 once the rank's process exited cleanly (its file says so), else 0.",
            labels,
            1.0 if h.finished else 0.0,
        )
        device = {"gpu": str(h.cuda_device) if h.cuda_device >= 0 else "", "uuid": h.device_uuid}
        families.gauge(
            "rank_info",
            "Static facts about the rank.",
            {**labels, "world_size": str(h.world_size), "pid": str(h.pid), "capture": h.capture, **device},
            1.0,
        )
        for cid, counters in sorted(h.comm_counters.items()):
            comm = {**labels, "comm": str(cid)}
            families.counter(
                "comm_ops_issued_total", "Ops the rank issued on the communicator.", comm, counters.issued
            )
            families.counter("comm_ops_completed_total", "Its ops that completed.", comm, counters.completed)
            age = _inflight_age(counters.inflight_enqueue_ns, h.finished, now)
            families.gauge(
                "comm_oldest_inflight_seconds",
                "Age of the communicator's oldest op still in flight on the rank (0 when none).",
                comm,
                age,
            )
            completed = sum(counters.histogram)
            if completed:
                quantiles = {
                    "0.99": quantile_upper_ns(counters.histogram, counters.max_duration_ns, 0.99) * NS,
                    "1": counters.max_duration_ns * NS,
                }
                families.summary(
                    "comm_op_duration_seconds",
                    "Duration (enqueue to completion) of the communicator's completed ops on the rank: "
                    "0.99 quantile as the upper edge of its log2 bucket (at most the maximum), and maximum.",
                    comm,
                    completed,
                    counters.duration_sum_ns * NS,
                    quantiles,
                )
        _export_pauses(families, h, labels, alive, now)
        _export_host_signals(families, h, labels)


def _export_pauses(
    families: FamilySet, h: RingHeader, labels: dict[str, str], alive: bool, now: float
) -> None:
    """The pause series of a rank whose file has them (format version 3); the current pause only while
    the rank is alive."""
    if h.version < 3:
        return
    for kind in PAUSE_KIND_NAMES.values():
        pause = h.pauses.get(kind)
        if pause is None:
            continue
        kind_labels = {**labels, "kind": kind}
        current = max(0.0, now - pause.since_ns * NS) if pause.since_ns and alive else 0.0
        families.gauge(
            "pause_seconds",
            "How long the rank has been in a pause of this kind now; 0 when not.",
            kind_labels,
            current,
        )
        families.counter("pauses_total", "Pauses of this kind that ended.", kind_labels, pause.ended)
        families.counter(
            "pause_seconds_total",
            "Time the rank spent in ended pauses of this kind.",
            kind_labels,
            pause.total_ns * NS,
        )


# Host-signal series from the newest sample (format version 4), named as node_exporter and cAdvisor name
# the same thing: (name, help, HostSample field, scale, extra labels). A field the rank's host does not
# give (-1) leaves its series out.
_HOST_SERIES: tuple[tuple[str, str, str, float, dict[str, str]], ...] = (
    ("schedstat_running_seconds_total", "Time the rank's main thread ran on a CPU (/proc schedstat).",
     "cpu_ns", NS, {}),
    ("schedstat_waiting_seconds_total", "Time the rank's main thread was runnable but waited for a CPU "
     "(run-queue delay, /proc schedstat).", "runq_ns", NS, {}),
    ("context_switches_total", "Context switches of the rank's main thread, by type.",
     "voluntary_switches", 1.0, {"type": "voluntary"}),
    ("context_switches_total", "Context switches of the rank's main thread, by type.",
     "nonvoluntary_switches", 1.0, {"type": "involuntary"}),
    ("major_page_faults_total", "Major page faults of the rank's process.", "major_faults", 1.0, {}),
    ("fs_reads_bytes_total", "Bytes the rank's process caused to be read from storage (/proc io read_bytes).",
     "read_bytes", 1.0, {}),
    ("blkio_delay_seconds_total", "Time the rank's main thread waited for block I/O (delay accounting).",
     "blkio_delay_ns", NS, {}),
    ("main_thread_io_wait_samples_total", "Host samples that found the rank's main thread in "
     "uninterruptible sleep (state D).", "main_io_wait_samples", 1.0, {}),
    ("cpu_cfs_periods_total", "CFS enforcement periods elapsed in the rank's cgroup.",
     "cfs_periods", 1.0, {}),
    ("cpu_cfs_throttled_periods_total", "CFS periods in which the rank's cgroup was throttled by its CPU "
     "quota.", "cfs_throttled_periods", 1.0, {}),
    ("cpu_cfs_throttled_seconds_total", "Time the rank's cgroup was throttled by its CPU quota.",
     "cfs_throttled_ns", NS, {}),
    ("memory_failcnt_total", "Times the rank's cgroup hit its memory limit.", "memory_limit_hits", 1.0, {}),
    ("memory_high_events_total", "Times the rank's cgroup went over memory.high (cgroup v2).",
     "memory_high_events", 1.0, {}),
    ("oom_events_total", "OOM kills in the rank's cgroup.", "oom_kills", 1.0, {}),
    ("pressure_cpu_waiting_seconds_total", "Time some tasks of the rank's cgroup waited for a CPU (PSI).",
     "cpu_pressure_ns", NS, {}),
    ("pressure_memory_waiting_seconds_total", "Time some tasks of the rank's cgroup waited for memory (PSI).",
     "memory_pressure_ns", NS, {}),
    ("pressure_io_waiting_seconds_total", "Time some tasks of the rank's cgroup waited for I/O (PSI).",
     "io_pressure_ns", NS, {}),
)  # fmt: skip


def _export_host_signals(families: FamilySet, h: RingHeader, labels: dict[str, str]) -> None:
    """The GC counters and the newest host sample of a rank whose file has them (format version 4)."""
    if h.version < 4:
        return
    families.counter("gc_collections_total", "Garbage collections on the rank.", labels, h.gc_collections)
    families.counter(
        "gc_pause_seconds_total", "Time the rank spent in garbage collections.", labels, h.gc_ns * NS
    )
    if not h.host_samples:
        return
    sample = h.host_samples[-1]
    families.gauge(
        "host_sample_timestamp_seconds",
        "Unix time of the rank's newest host sample.",
        labels,
        sample.time_ns * NS,
    )
    for name, doc, field, scale, extra in _HOST_SERIES:
        raw = getattr(sample, field)
        if raw >= 0:
            families.counter(name, doc, {**labels, **extra}, raw * scale)


def _rank_of(path: Path) -> int:
    number = path.stem.removeprefix("rank-")
    return int(number) if number.isascii() and number.isdigit() and len(number) <= 9 else -1


def _inflight_age(enqueue_ns: int, finished: bool, now: float) -> float:
    """Seconds an op enqueued at `enqueue_ns` has been in flight (0 when none, or the rank finished)."""
    return max(0.0, now - enqueue_ns * NS) if enqueue_ns and not finished else 0.0


def trace_dir_setting() -> Any:
    """The ``trace_dir`` key, for the settings of every collector reading the node's trace files."""
    return setting("/run/megatrace", "the tracer's folder on this node", metavar="DIR")


@dataclasses.dataclass(frozen=True)
class TracerSettings:
    """The tracer collector's keys, its finished jobs' retention included."""

    trace_dir: str = trace_dir_setting()
    tracer_grace_seconds: float = setting(
        300.0, "how long finished or dead ranks stay exported", flag="tracer-grace", metavar="SECONDS"
    )
    trace_retention_hours: float = setting(
        72.0, "finished jobs' folders under trace_dir are removed after this many hours (0 keeps them)"
    )
    trace_max_bytes: int = setting(
        2 << 30, "oldest finished jobs' folders go while all hold more than this (0: no size limit)"
    )

    def problems(self, enabled: bool) -> list[str]:
        found = []
        if self.tracer_grace_seconds < 0:
            found.append("key 'tracer_grace_seconds': must not be negative")
        if self.trace_retention_hours < 0:
            found.append("key 'trace_retention_hours': must not be negative (0 keeps them)")
        if self.trace_max_bytes < 0:
            found.append("key 'trace_max_bytes': must not be negative (0: no size limit)")
        return found


SETTINGS = TracerSettings


def build(settings: TracerSettings, agent: ExporterConfig, nvml: object = None) -> TracerCollector:
    """The agent's tracer collector (`collectors` table entry "tracer")."""
    return TracerCollector(settings.trace_dir, settings.tracer_grace_seconds)
