"""Run a command (the test suite) beside CPU hogs that keep the machine's load average at or above a
floor, as on a shared developer machine; sample the load during the run and print it at the end.

``python -m tests.support.loaded [--floor 4] [--settle-s 180] -- COMMAND…`` starts busy-loop processes
(one per CPU to begin with), waits until the one-minute load average reaches the floor, runs COMMAND,
and every few seconds adds a hog while the load is below the floor plus a margin. The hogs are
stopped when COMMAND ends, whatever way it ends: by this process's ``finally``, and, should this
process be killed outright, by the kernel (each hog asks to be killed when its parent dies, and
checks its parent as well). The exit status is COMMAND's, or 1 when the load fell below the floor
while it ran (then the run did not test what it claims to).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

HOG = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
except (AttributeError, OSError):
    pass
n = 0
while True:
    n += 1
    if n % 5_000_000 == 0 and os.getppid() != parent:
        sys.exit(0)
"""
SAMPLE_S = 5.0
MARGIN = 1.0  # hogs are added while the load is below floor + margin...
ADD_EVERY_S = 30.0  # ...one at a time, as the one-minute average needs a while to show each
MAX_HOGS = 32


class Hogs:
    """Busy-loop processes at normal priority, children of this process."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.added_at = 0.0

    def add(self) -> None:
        if len(self.procs) < MAX_HOGS:
            argv = [sys.executable, "-c", HOG, str(os.getpid())]
            self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
            self.added_at = time.monotonic()

    def add_below(self, load: float, level: float) -> None:
        """Add a hog when `load` is below `level` and the last one had time to show in it."""
        if load < level and time.monotonic() - self.added_at >= ADD_EVERY_S:
            self.add()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()


def sampler(hogs: Hogs, floor: float, samples: list[float], done: threading.Event) -> None:
    """Record the one-minute load average every SAMPLE_S; add a hog while it is below floor + MARGIN."""
    while not done.wait(SAMPLE_S):
        load = os.getloadavg()[0]
        samples.append(load)
        hogs.add_below(load, floor + MARGIN)


def run(command: Sequence[str], floor: float, settle_s: float) -> int:
    hogs = Hogs()
    samples: list[float] = []
    done = threading.Event()
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally below
    try:
        for _ in range(os.cpu_count() or 2):
            hogs.add()
        deadline = time.monotonic() + settle_s
        while os.getloadavg()[0] < floor and time.monotonic() < deadline:
            time.sleep(2.0)
            hogs.add_below(os.getloadavg()[0], floor)
        print(
            f"loaded: load average {os.getloadavg()[0]:.1f} with {len(hogs.procs)} hogs; running "
            f"{' '.join(command)}",
            flush=True,
        )
        watcher = threading.Thread(target=sampler, args=(hogs, floor, samples, done), daemon=True)
        watcher.start()
        run_started = time.monotonic()
        status = subprocess.run(list(command)).returncode
        elapsed = time.monotonic() - run_started
    finally:
        done.set()
        hogs.stop()
    low = min(samples) if samples else os.getloadavg()[0]
    print(
        f"loaded: {len(samples)} samples of the 1-minute load average during the run: min {low:.1f}, "
        f"median {statistics.median(samples) if samples else low:.1f}, max {max(samples, default=low):.1f} "
        f"(floor {floor:g}); {len(hogs.procs)} hogs; run {elapsed:.0f} s, {time.monotonic() - started:.0f} s "
        f"with settling; exit status {status}",
        flush=True,
    )
    if low < floor:
        print(f"loaded: the load fell to {low:.1f}, below the floor of {floor:g}", file=sys.stderr)
        return status or 1
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.loaded", description=__doc__)
    parser.add_argument("--floor", type=float, default=4.0, help="load average to keep (default 4)")
    parser.add_argument("--settle-s", type=float, default=180.0, help="longest wait for the floor first")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND…")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to run is required (after --)")
    return run(command, args.floor, args.settle_s)


if __name__ == "__main__":
    sys.exit(main())
