"""Host signals of a rank, sampled from inside it: its own process (/proc/self) and its own cgroup.

The node agent runs without the host's PID namespace, so it cannot read a rank's /proc entries; the
rank reads them itself, from its watchdog thread (never the training thread), and writes each sample
into the ring header's host-signal block (`megatrace.tracer.format`, ``docs/tracer-format.md``). The
cgroup is resolved from /proc/self/cgroup and /proc/self/mountinfo, for cgroup v1 controllers and the
v2 unified hierarchy alike (a cgroup namespace shows the rank's cgroup as "/": its mount's root).
A signal this host does not give is written as -1 and the header's notes say why.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

from megatrace.tracer.format import (
    HOST_SAMPLE_CHECK,
    HOST_SAMPLE_FIELDS,
    HOST_SAMPLE_SERIAL,
    HOST_SAMPLES,
    HOST_SIGNALS_OFFSET,
    HS_CGROUP_VERSION,
    HS_GC_COLLECTIONS,
    HS_GC_NS,
    HS_MAIN_THREAD_ID,
    HS_SAMPLE_COUNT,
    HS_SAMPLE_INTERVAL_NS,
    P_SINCE_NS,
    P_TOTAL_NS,
    PAUSE_KIND_CODES,
)
from megatrace.tracer.pauses import pause_entry
from megatrace.tracer.ringfile import HostSample, RingWriter, host_sample_word

UNAVAILABLE = -1
_SCALARS = HOST_SIGNALS_OFFSET // 8
_DATALOADER = pause_entry(PAUSE_KIND_CODES["dataloader"])
# /proc/<pid>/stat fields after the command's closing parenthesis: state is the first (field 3),
# majflt field 12, delayacct_blkio_ticks field 42.
_STAT_STATE, _STAT_MAJFLT, _STAT_BLKIO_TICKS = 0, 9, 39
_PRESSURE_FILES = (("cpu_pressure_ns", "cpu.pressure"), ("memory_pressure_ns", "memory.pressure"),
                   ("io_pressure_ns", "io.pressure"))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CgroupDirs:
    """Where the rank's cgroup files are: the folder holding cpu.stat, the memory controller's folder,
    the folder holding the pressure files (None where absent), the hierarchy version (0 none found, 1,
    2) and why any of them is missing."""

    version: int = 0
    cpu: Path | None = None
    memory: Path | None = None
    pressure: Path | None = None
    memory_v2: bool = False
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Mount:
    root: str
    point: Path
    fstype: str
    options: frozenset[str]


def _mounts(mountinfo: str) -> list[_Mount]:
    """The cgroup and cgroup2 mounts of a mountinfo text (proc(5): fields before " - ", then fstype,
    source, super options)."""
    mounts = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(after) < 3 or after[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        mounts.append(_Mount(fields[3], Path(point), after[0], frozenset(after[2].split(","))))
    return mounts


def _inside(mount: _Mount, path: str) -> Path | None:
    """The folder of cgroup `path` (as /proc/self/cgroup gives it) under `mount`; None when the path
    lies outside what the mount shows (a cgroup namespace shows its own root as "/")."""
    root = mount.root.rstrip("/")
    if path == "/" or path == root or path.startswith("/.."):
        relative = "" if not path.startswith("/..") else None
    elif root and path.startswith(root + "/"):
        relative = path[len(root) + 1 :]
    elif not root:
        relative = path.lstrip("/")
    else:
        relative = None
    if relative is None:
        return None
    folder = mount.point / relative
    return folder if folder.is_dir() else None


def resolve_cgroup(proc_self: Path = Path("/proc/self")) -> CgroupDirs:
    """The rank's cgroup folders from `proc_self`/cgroup and `proc_self`/mountinfo: cpu.stat from the v1
    cpu controller where one is mounted, else from the unified hierarchy; the same for memory; the
    pressure files from whichever holds them (the unified hierarchy has them; v1 controllers do not)."""
    try:
        membership = (proc_self / "cgroup").read_text()
        mounts = _mounts((proc_self / "mountinfo").read_text())
    except OSError as exc:
        return CgroupDirs(notes=(f"cgroup: cannot read {exc.filename}: {exc.strerror}",))
    v1: dict[str, Path | None] = {}
    unified: Path | None = None
    unified_listed = False
    for line in membership.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            unified_listed = True
            mount = next((m for m in mounts if m.fstype == "cgroup2"), None)
            unified = _inside(mount, path) if mount else None
            continue
        for controller in controllers.split(","):
            if controller in ("cpu", "memory"):
                mount = next((m for m in mounts if m.fstype == "cgroup" and controller in m.options), None)
                v1[controller] = _inside(mount, path) if mount else None
    notes: list[str] = []
    cpu = v1.get("cpu") or _with(unified, "cpu.stat")
    memory = v1.get("memory") or _with(unified, "memory.events")
    memory_v2 = v1.get("memory") is None and memory is not None
    if cpu is None:
        notes.append("cpu.stat: the cgroup's cpu controller is not mounted or not enabled here")
    if memory is None:
        notes.append("memory: the cgroup's memory controller is not mounted or not enabled here")
    pressure = _with(unified, "cpu.pressure") or _with(v1.get("cpu"), "cpu.pressure")
    if pressure is None:
        why = (
            "cgroup v1 has no per-cgroup pressure"
            if v1 and not unified_listed
            else "the kernel gives no pressure files for the rank's cgroup (PSI off, or no unified cgroup)"
        )
        notes.append(f"cpu.pressure, memory.pressure, io.pressure: {why}")
    version = 1 if any(v1.values()) else 2 if unified is not None else 0
    if unified_listed and unified is None:
        notes.append("cgroup2: the rank's cgroup is not visible under the mounted unified hierarchy")
    return CgroupDirs(version, cpu, memory, pressure, memory_v2, tuple(notes))


def _with(folder: Path | None, name: str) -> Path | None:
    return folder if folder is not None and (folder / name).exists() else None


def _keyed(path: Path) -> dict[str, int]:
    """A flat keyed file ("name value" per line: cpu.stat, memory.events, memory.oom_control)."""
    values = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            values[parts[0]] = int(parts[1])
    return values


def pressure_some_total_ns(path: Path) -> int:
    """The "some" total of a PSI file, ns (``some avg10=.. avg60=.. avg300=.. total=US``)."""
    for line in path.read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "some":
            for field in fields[1:]:
                key, _, value = field.partition("=")
                if key == "total":
                    return int(value) * 1000
    raise ValueError(f"{path}: no 'some ... total=' line")


class HostSampler:
    """Reads one `HostSample` of this process and its cgroup and writes it into a ring's header."""

    def __init__(
        self,
        writer: RingWriter,
        interval_ns: int,
        proc_self: Path = Path("/proc/self"),
        main_tid: int | None = None,
        cgroup: CgroupDirs | None = None,
        delayacct: bool | None = None,
    ) -> None:
        self.writer = writer
        self.header = writer.header
        self.interval_ns = interval_ns
        self.proc_self = proc_self
        self.main_tid = threading.main_thread().native_id if main_tid is None else main_tid
        self.cgroup = resolve_cgroup(proc_self) if cgroup is None else cgroup
        self.delayacct = _delayacct_on() if delayacct is None else delayacct
        self.io_waits = 0
        self.tick_ns = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        self.notes: tuple[str, ...] = ()
        self._notes_written: tuple[str, ...] | None = None
        h = self.header
        h[_SCALARS + HS_CGROUP_VERSION] = self.cgroup.version
        h[_SCALARS + HS_MAIN_THREAD_ID] = threading.main_thread().ident or 0
        h[_SCALARS + HS_SAMPLE_INTERVAL_NS] = interval_ns

    def read(self, now_ns: int | None = None) -> HostSample:
        """One sample now; counters that cannot be read are -1 (and `notes` says why)."""
        notes = list(self.cgroup.notes)
        values = dict.fromkeys(HOST_SAMPLE_FIELDS, UNAVAILABLE)
        values["time_ns"] = time.time_ns() if now_ns is None else now_ns
        task = self.proc_self / "task" / str(self.main_tid)
        for reader in (self._schedstat, self._switches, self._stat, self._io, self._cgroup_cpu,
                       self._cgroup_memory, self._pressure):  # fmt: skip
            try:
                reader(task, values, notes)
            except (OSError, ValueError, IndexError, KeyError) as exc:
                notes.append(f"{reader.__name__.strip('_')}: cannot read: {exc}")
        h = self.header
        values["gc_collections"] = h[_SCALARS + HS_GC_COLLECTIONS]
        values["gc_ns"] = h[_SCALARS + HS_GC_NS]
        since = h[_DATALOADER + P_SINCE_NS]
        values["dataloader_ns"] = h[_DATALOADER + P_TOTAL_NS] + (
            max(0, values["time_ns"] - since) if since else 0
        )
        self.notes = tuple(notes)
        return HostSample(**values)

    def _schedstat(self, task: Path, values: dict[str, int], notes: list[str]) -> None:
        on_cpu, waiting, _ = (task / "schedstat").read_text().split()
        values["cpu_ns"], values["runq_ns"] = int(on_cpu), int(waiting)

    def _switches(self, task: Path, values: dict[str, int], notes: list[str]) -> None:
        for line in (task / "status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "voluntary_ctxt_switches":
                values["voluntary_switches"] = int(value)
            elif key == "nonvoluntary_ctxt_switches":
                values["nonvoluntary_switches"] = int(value)

    def _stat(self, task: Path, values: dict[str, int], notes: list[str]) -> None:
        process = (self.proc_self / "stat").read_text().rpartition(")")[2].split()
        values["major_faults"] = int(process[_STAT_MAJFLT])
        main = (task / "stat").read_text().rpartition(")")[2].split()
        if main[_STAT_STATE] == "D":
            self.io_waits += 1
        values["main_io_wait_samples"] = self.io_waits
        if self.delayacct:
            values["blkio_delay_ns"] = int(main[_STAT_BLKIO_TICKS]) * self.tick_ns
        else:
            notes.append("blkio_delay_ns: delay accounting is off (/proc/sys/kernel/task_delayacct is 0)")

    def _io(self, task: Path, values: dict[str, int], notes: list[str]) -> None:
        values["read_bytes"] = _keyed_colon(self.proc_self / "io")["read_bytes"]

    def _cgroup_cpu(self, task: Path, values: dict[str, int], notes: list[str]) -> None:
        if self.cgroup.cpu is None:
            return
        stat = _keyed(self.cgroup.cpu / "cpu.stat")
        values["cfs_periods"] = stat["nr_periods"]
        values["cfs_throttled_periods"] = stat["nr_throttled"]
        if "throttled_usec" in stat:
            values["cfs_throttled_ns"] = stat["throttled_usec"] * 1000
        else:
            values["cfs_throttled_ns"] = stat["throttled_time"]

    def _cgroup_memory(self, task: Path, values: dict[str, int], notes: list[str]) -> None:
        folder = self.cgroup.memory
        if folder is None:
            return
        if self.cgroup.memory_v2:
            events = _keyed(folder / "memory.events")
            values["memory_limit_hits"] = events["max"]
            values["memory_high_events"] = events["high"]
            values["oom_kills"] = events["oom_kill"]
            return
        values["memory_limit_hits"] = int((folder / "memory.failcnt").read_text())
        values["oom_kills"] = _keyed(folder / "memory.oom_control").get("oom_kill", UNAVAILABLE)
        notes.append("memory_high_events: cgroup v1 has no memory.high")

    def _pressure(self, task: Path, values: dict[str, int], notes: list[str]) -> None:
        folder = self.cgroup.pressure
        if folder is None:
            return
        for field, name in _PRESSURE_FILES:
            try:
                values[field] = pressure_some_total_ns(folder / name)
            except (OSError, ValueError) as exc:
                notes.append(f"{name}: {getattr(exc, 'strerror', None) or exc}")

    def write(self, sample: HostSample) -> None:
        """Write `sample` as the next slot of the header's ring (readers skip it until it is whole)."""
        h = self.header
        number = h[_SCALARS + HS_SAMPLE_COUNT] + 1
        base = host_sample_word((number - 1) % HOST_SAMPLES)
        h[base + HOST_SAMPLE_CHECK] = 0
        for index, field in enumerate(HOST_SAMPLE_FIELDS, start=1):
            h[base + index] = getattr(sample, field)
        h[base + HOST_SAMPLE_CHECK] = number
        h[base + HOST_SAMPLE_SERIAL] = number
        h[_SCALARS + HS_SAMPLE_COUNT] = number
        if self.notes != self._notes_written:
            self.writer.set_host_notes(self.notes)
            self._notes_written = self.notes

    def sample(self) -> HostSample:
        """Read one sample and write it (the watchdog's tick)."""
        sample = self.read()
        self.write(sample)
        return sample


def _keyed_colon(path: Path) -> dict[str, int]:
    """A "name: value" file (/proc/self/io)."""
    values = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().isdigit():
            values[key] = int(value)
    return values


def _delayacct_on() -> bool:
    try:
        return Path("/proc/sys/kernel/task_delayacct").read_text().strip() == "1"
    except OSError:
        return False
