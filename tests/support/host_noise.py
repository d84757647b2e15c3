"""Deliberate host noise for recorded runs, as a shared or busy node imposes it: CPU hogs and memory pressure.

`HostNoise` is a context manager: it starts `hogs` processes that each spin for `duty` of every 100 ms
and sleep the rest, from `start_s` seconds after entering; with `memory_mib` it makes a cgroup v1
memory cgroup (below this process's own) whose ``memory.limit_in_bytes`` is that many MiB, for the job
to run in (`cgroup`): the kernel reclaims the job's page cache (its trace rings are file-backed) under
that limit. While it runs it samples the 1-minute load average; `summary()` gives what was reached.
Hogs inherit this process's niceness: run the recording under ``nice`` and the noise keeps its share
relative to the job while other work keeps priority.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
HOG = (
    "import sys, time\n"
    "duty = float(sys.argv[1])\n"
    "while True:\n"
    "    end = time.monotonic() + 0.1 * duty\n"
    "    while time.monotonic() < end:\n"
    "        pass\n"
    "    time.sleep(0.1 * (1 - duty))\n"
)


def own_memory_cgroup() -> Path:
    """This process's cgroup v1 memory controller folder (where a child cgroup may be made)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return MEMORY_ROOT / path.lstrip("/")
    raise RuntimeError("no cgroup v1 memory controller for this process (see /proc/self/cgroup)")


@dataclass
class HostNoise:
    """CPU hogs and a memory limit for one recorded run (see the module's docstring)."""

    name: str
    hogs: int = 0
    duty: float = 0.0
    start_s: float = 0.0
    memory_mib: int = 0
    cgroup: Path | None = None
    loads: list[float] = field(default_factory=list)
    memory_limit_hits: int = 0
    memory_peak_mib: int = 0
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> HostNoise:
        if self.memory_mib:
            self.cgroup = own_memory_cgroup() / f"megatrace-noise-{self.name}"
            self.cgroup.mkdir(exist_ok=True)
            (self.cgroup / "memory.limit_in_bytes").write_text(str(self.memory_mib << 20))
        self._threads = [
            threading.Thread(target=self._sample, daemon=True),
            threading.Thread(target=self._start_hogs, daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def _start_hogs(self) -> None:
        if not self.hogs or self._stop.wait(self.start_s):
            return
        for _ in range(self.hogs):
            self._procs.append(subprocess.Popen([sys.executable, "-c", HOG, str(self.duty)]))

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            self.loads.append(os.getloadavg()[0])

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        for proc in self._procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if self.cgroup is not None:
            self.memory_limit_hits = int((self.cgroup / "memory.failcnt").read_text())
            self.memory_peak_mib = int((self.cgroup / "memory.max_usage_in_bytes").read_text()) >> 20
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()

    def summary(self) -> dict:
        """The plan and what it did: load average (1 min) reached, memory limit hits and peak use."""
        out = {"hogs": self.hogs, "duty": self.duty, "start_s": self.start_s, "memory_mib": self.memory_mib}
        out["load_max"] = round(max(self.loads, default=os.getloadavg()[0]), 2)
        out["load_mean"] = round(sum(self.loads) / len(self.loads), 2) if self.loads else out["load_max"]
        if self.cgroup is not None:
            out["memory_limit_hits"] = self.memory_limit_hits
            out["memory_peak_mib"] = self.memory_peak_mib
        return out
