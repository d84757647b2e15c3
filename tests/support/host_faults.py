"""Faults applied from outside to one rank's process, as a shared or misconfigured node applies them.

- `RankCgroup` (context manager `rank_cgroup`): a cgroup made for one rank, cgroup v1 (one folder per
  controller, below this process's own) or v2 (one folder below the root, controllers enabled there),
  chosen by `cgroup_version()`. It takes the rank's process (`join`) and limits it: a CPU quota (v1
  ``cpu.cfs_quota_us``, v2 ``cpu.max``), a memory limit (v1 ``memory.limit_in_bytes``, v2 ``memory.high``)
  or a read rate on a block device (v1 ``blkio.throttle.read_bps_device``, v2 ``io.max``); it reads back
  what the kernel did (throttled periods, limit hits, bytes read). On exit its processes go back to
  the parent and the folders are removed, whatever happened.
- `CpuHogs`: processes spinning on one CPU (``taskset``); `pin` pins a process and its threads.
- `loop_disk`: an ext4 file system on a loop device (a disk whose reads a cgroup can throttle).
- `held_lock` / `fifo`: a lock another process holds, a FIFO nobody reads.
- `ProcWatch`: samples ranks' /proc counters (run-queue delay, major faults, switches, bytes read).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.host_noise import HOG

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = {"cpu": "cpu", "memory": "memory", "io": "blkio"}  # v2 name -> v1 hierarchy


def cgroup_version(root: Path = CGROUP_ROOT) -> int:
    """2 where the unified hierarchy is mounted at `root` (``cgroup.controllers`` there), else 1."""
    return 2 if (root / "cgroup.controllers").exists() else 1


def own_cgroup(hierarchy: str) -> Path:
    """This process's cgroup folder in the v1 `hierarchy` (``cpu``, ``memory``, ``blkio``), from
    /proc/self/cgroup."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _hid, controllers, path = line.split(":", 2)
        if hierarchy in controllers.split(","):
            return CGROUP_ROOT / hierarchy / path.lstrip("/")
    raise RuntimeError(f"no cgroup v1 {hierarchy} hierarchy in /proc/self/cgroup")


def _keyed(text: str) -> dict[str, int]:
    """``key value`` lines (cpu.stat, memory.stat, memory.events) as a dict."""
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].lstrip("-").isdigit()}


@dataclass
class RankCgroup:
    """A cgroup for one rank: `folders` maps each controller (v2 names: cpu, memory, io) to its folder."""

    version: int
    folders: dict[str, Path]

    def _file(self, controller: str, name: str) -> Path:
        return self.folders[controller] / name

    def join(self, pid: int) -> None:
        """Move `pid` (all its threads) into the cgroup."""
        for folder in dict.fromkeys(self.folders.values()):
            (folder / "cgroup.procs").write_text(str(pid))

    def limit_cpu(self, quota_us: int, period_us: int = 100_000) -> None:
        """At most `quota_us` of CPU time every `period_us`."""
        if self.version == 2:
            self._file("cpu", "cpu.max").write_text(f"{quota_us} {period_us}")
            return
        self._file("cpu", "cpu.cfs_period_us").write_text(str(period_us))
        self._file("cpu", "cpu.cfs_quota_us").write_text(str(quota_us))

    def lift_cpu_limit(self) -> None:
        """No quota any more (v1 ``cpu.cfs_quota_us`` -1, v2 ``cpu.max`` max)."""
        if self.version == 2:
            self._file("cpu", "cpu.max").write_text("max")
            return
        self._file("cpu", "cpu.cfs_quota_us").write_text("-1")

    def cpu_stat(self) -> dict[str, int]:
        """``cpu.stat``: nr_periods and nr_throttled on both versions (throttled_time ns on v1,
        throttled_usec on v2)."""
        return _keyed(self._file("cpu", "cpu.stat").read_text())

    def limit_memory(self, limit_bytes: int) -> None:
        """Reclaim the cgroup's memory above `limit_bytes` (v1 hard limit; v2 ``memory.high``, the
        throttle-and-reclaim limit)."""
        name = "memory.high" if self.version == 2 else "memory.limit_in_bytes"
        self._file("memory", name).write_text(str(limit_bytes))

    def memory_used(self) -> tuple[int, int]:
        """(bytes charged, of them page cache)."""
        if self.version == 2:
            stat = _keyed(self._file("memory", "memory.stat").read_text())
            return int(self._file("memory", "memory.current").read_text()), stat.get("file", 0)
        stat = _keyed(self._file("memory", "memory.stat").read_text())
        return int(self._file("memory", "memory.usage_in_bytes").read_text()), stat.get("cache", 0)

    def memory_limit_hits(self) -> int:
        """How often the limit was hit: v1 ``memory.failcnt``; v2 ``memory.events`` high + max."""
        if self.version == 2:
            events = _keyed(self._file("memory", "memory.events").read_text())
            return events.get("high", 0) + events.get("max", 0)
        return int(self._file("memory", "memory.failcnt").read_text())

    def memory_refaults(self) -> int:
        """Pages evicted under the limit and read back (``memory.stat`` workingset_refault*)."""
        stat = _keyed(self._file("memory", "memory.stat").read_text())
        return sum(v for k, v in stat.items() if k.startswith("workingset_refault"))

    def throttle_reads(self, device: str, bytes_per_s: int) -> None:
        """Reads from block device `device` (``MAJ:MIN``) at most `bytes_per_s`."""
        if self.version == 2:
            self._file("io", "io.max").write_text(f"{device} rbps={bytes_per_s}")
            return
        self._file("io", "blkio.throttle.read_bps_device").write_text(f"{device} {bytes_per_s}")

    def bytes_read(self, device: str) -> int:
        """Bytes the cgroup's processes read from `device` (v1 throttle accounting, v2 ``io.stat``)."""
        if self.version == 2:
            for line in self._file("io", "io.stat").read_text().splitlines():
                if line.startswith(device + " "):
                    return _keyed("\n".join(f.replace("=", " ") for f in line.split()[1:])).get("rbytes", 0)
            return 0
        for line in self._file("io", "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == device and parts[1] == "Read":
                return int(parts[2])
        return 0

    def remove(self) -> None:
        """Put the cgroup's processes back in the parent, then remove the folders (retrying while
        exiting tasks linger)."""
        for folder in dict.fromkeys(self.folders.values()):
            if not folder.exists():
                continue
            for _ in range(50):
                for pid in (folder / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (folder.parent / "cgroup.procs").write_text(pid)
                try:
                    folder.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                raise RuntimeError(f"could not remove the test cgroup {folder}")


@contextlib.contextmanager
def rank_cgroup(controllers: tuple[str, ...] = ("cpu", "memory", "io")) -> Iterator[RankCgroup]:
    """A new ``megatrace-test-…`` cgroup with `controllers` (v2 names), below this process's own cgroup;
    removed on exit."""
    version = cgroup_version()
    name = f"megatrace-test-{uuid.uuid4().hex[:10]}"
    made: list[Path] = []
    group = RankCgroup(version, {})
    try:
        if version == 2:  # below the root: the only v2 cgroup that may hold processes and children alike
            (CGROUP_ROOT / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in controllers))
            folder = CGROUP_ROOT / name
            folder.mkdir()
            made.append(folder)
            group.folders = dict.fromkeys(controllers, folder)
        else:
            for controller in controllers:
                folder = own_cgroup(V1_CONTROLLERS[controller]) / name
                folder.mkdir()
                made.append(folder)
                group.folders[controller] = folder
        yield group
    finally:
        group.folders = {str(i): path for i, path in enumerate(made)}
        group.remove()


def pin(pid: int, cpu: int) -> None:
    """Pin process `pid` and all its threads to `cpu` (``taskset -a -p``)."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True, capture_output=True)


@dataclass
class CpuHogs:
    """`count` processes spinning without pause on `cpu` from `start()`, each in its own session (as
    another program on the node: with the scheduler's autogroups a session shares the CPU as one) at
    niceness `nice`, task and autogroup alike (below 0: a busier neighbour than the rank, whatever
    else loads the machine); a context manager that kills them on exit."""

    cpu: int
    count: int
    nice: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)
    spent: list[float] = field(default_factory=list)

    def start(self) -> None:
        for _ in range(self.count):
            argv = ["taskset", "-c", str(self.cpu), sys.executable, "-c", HOG, "1.0"]
            proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=lambda: os.nice(self.nice))
            self.procs.append(proc)
            with contextlib.suppress(OSError):  # kernels without CONFIG_SCHED_AUTOGROUP lack the file
                Path(f"/proc/{proc.pid}/autogroup").write_text(str(self.nice))

    def cpu_seconds(self) -> list[float]:
        """CPU time each hog has used so far."""
        return [cpu_seconds(proc.pid) for proc in self.procs]

    def stop(self) -> None:
        """Kill the hogs (their CPU time stays readable in `spent`)."""
        self.spent = self.cpu_seconds() if self.procs and not self.spent else self.spent
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []

    def __enter__(self) -> CpuHogs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process `pid` has used, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class LoopDisk:
    """An ext4 file system on a loop device: `device` (/dev/loopN), `numbers` (``MAJ:MIN``), `mount`."""

    device: str
    numbers: str
    mount: Path


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def loop_disk(folder: Path, size_mib: int = 400) -> Iterator[LoopDisk]:
    """Make an image file in `folder`, attach it to a free loop device (direct I/O: the backing file's
    page cache does not answer for the disk), format and mount it; undone on exit."""
    image, mount = folder / "disk.img", folder / "disk"
    with open(image, "wb") as out:
        out.truncate(size_mib << 20)
    mount.mkdir()
    device = ""
    mounted = False
    try:
        device = _run("losetup", "--find", "--show", "--direct-io=on", str(image))
        _run("mkfs.ext4", "-q", "-F", device)
        _run("mount", device, str(mount))
        mounted = True
        rdev = os.stat(device).st_rdev
        yield LoopDisk(device, f"{os.major(rdev)}:{os.minor(rdev)}", mount)
    finally:
        for _ in range(50 if mounted else 0):  # killed ranks may still hold files open for a moment
            if subprocess.run(["umount", str(mount)], check=False, capture_output=True).returncode == 0:
                mounted = False
                break
            time.sleep(0.1)
        if mounted:  # still busy: detach it now, the kernel lets go of it once its last user does
            subprocess.run(["umount", "--lazy", str(mount)], check=False, capture_output=True)
        if device:
            subprocess.run(["losetup", "-d", device], check=False, capture_output=True)
        image.unlink()


def write_uncached(path: Path, size: int) -> None:
    """A file of `size` pseudo-random bytes, on disk and out of the page cache (so a reader faults it in)."""
    with open(path, "wb") as out:
        chunk = os.urandom(1 << 20)
        for _ in range(size >> 20):
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
        os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


@contextlib.contextmanager
def held_lock(path: Path) -> Iterator[int]:
    """Hold an exclusive ``flock`` on `path` (as a stale process would) until exit."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def lock_waiters(path: Path) -> set[int]:
    """Pids blocked waiting for a lock on `path` (the ``->`` lines of /proc/locks for its inode)."""
    st = os.stat(path)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    waiters = set()
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        at = parts.index("->") if "->" in parts else -1  # "N: -> FLOCK ADVISORY WRITE pid inode …"
        if at >= 0 and parts[at + 5] == inode:
            waiters.add(int(parts[at + 4]))
    return waiters


def waiting_in(pid: int) -> str:
    """The kernel function process `pid`'s main thread sleeps in (/proc/<pid>/wchan; "" while it runs)."""
    text = Path(f"/proc/{pid}/wchan").read_text().strip()
    return "" if text == "0" else text


@dataclass
class ProcCounters:
    """Cumulative /proc counters of one process."""

    time_s: float = 0.0
    cpu_ns: int = 0
    runq_ns: int = 0
    major_faults: int = 0
    nonvoluntary_switches: int = 0
    read_bytes: int = 0


def proc_counters(pid: int) -> ProcCounters:
    """`pid`'s counters now: /proc/<pid>/schedstat, stat (majflt), status, io."""
    proc = Path(f"/proc/{pid}")
    cpu_ns, runq_ns, _slices = (int(v) for v in (proc / "schedstat").read_text().split())
    majflt = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[9])
    status = _keyed((proc / "status").read_text().replace(":", ""))
    io = _keyed((proc / "io").read_text().replace(":", ""))
    return ProcCounters(
        time.monotonic(), cpu_ns, runq_ns, majflt, status["nonvoluntary_ctxt_switches"], io["read_bytes"]
    )


@dataclass
class ProcWatch:
    """Samples the counters of `pids` (rank → pid) every `every_s` from `start()`; `first` and `last`
    hold each rank's earliest and latest reading (the last one from before the process ended),
    `io_waits` how many samples found its main thread waiting for I/O (state D)."""

    pids: dict[int, int]
    every_s: float = 0.25
    first: dict[int, ProcCounters] = field(default_factory=dict)
    last: dict[int, ProcCounters] = field(default_factory=dict)
    io_waits: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        for rank, pid in self.pids.items():
            with contextlib.suppress(OSError, ValueError, KeyError):
                now = proc_counters(pid)
                self.first.setdefault(rank, now)
                self.last[rank] = now
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                self.io_waits[rank] = self.io_waits.get(rank, 0) + (state == "D")

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def delta(self, rank: int) -> ProcCounters:
        """What rank `rank`'s counters moved by while watched."""
        a, b = self.first[rank], self.last[rank]
        return ProcCounters(
            b.time_s - a.time_s,
            b.cpu_ns - a.cpu_ns,
            b.runq_ns - a.runq_ns,
            b.major_faults - a.major_faults,
            b.nonvoluntary_switches - a.nonvoluntary_switches,
            b.read_bytes - a.read_bytes,
        )
