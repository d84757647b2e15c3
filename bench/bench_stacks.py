"""The cost of taking every thread's Python stack for a stall dump, as the training thread feels it.

64 threads wait 50 frames deep; the main thread, standing in for the training thread, runs a tight
Python loop and records every gap between two iterations, while a second thread (the watchdog's
place) takes all stacks N times. Per capture, the longest gap overlapping it is how long the main
thread was kept off the GIL. Two ways are measured:

- ``capture_stacks``: what the watchdog does for a dump (`megatrace.tracer.stacks`: with garbage
  collection paused, a frame walk that hands the GIL back every half millisecond, then the dump's
  stack lines);
- ``faulthandler``: `faulthandler.dump_traceback(all_threads=True)` into a memfd, then parsed and
  the same lines made (one C call that holds the GIL for the whole dump; the fallback's format).

For comparison: no capture at all (the loop's own gaps: scheduler noise), and a second thread that
runs plain Python for 10 ms (CPython makes it give the GIL up every switch interval, 5 ms). Last, the
capture's longest stretch holding the GIL, in the capturing thread's CPU time (scheduler-proof).

    .venv/bin/python bench/bench_stacks.py [--threads 64] [--depth 50] [--captures 30]

Run it on an idle machine: the figures are wall-clock times.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrace.tracer import stacks as stacks_module
from megatrace.tracer.stacks import capture_stacks, gc_paused, parse_faulthandler, stack_lines, thread_names

GAP_S = 0.0001  # gaps shorter than this are the loop itself


def waiting_thread(release: threading.Event, depth: int) -> None:
    if depth > 1:
        waiting_thread(release, depth - 1)
    else:
        release.wait()


def as_the_watchdog_does() -> None:
    with gc_paused():
        stack_lines(capture_stacks(), "all_reduce", 1)


def with_faulthandler(holds: list[float]) -> Callable[[], None]:
    """The faulthandler way; `holds` gets the CPU time of each `dump_traceback` call (it holds the
    GIL throughout)."""

    def run() -> None:
        fd = os.memfd_create("megatrace-stacks-bench")
        try:
            start = time.thread_time()
            faulthandler.dump_traceback(file=fd, all_threads=True)
            holds.append(time.thread_time() - start)
            size = os.lseek(fd, 0, os.SEEK_CUR)
            text = os.pread(fd, size, 0).decode("ascii", "replace")
        finally:
            os.close(fd)
        main_id = threading.main_thread().ident or 0
        with gc_paused():
            stack_lines(parse_faulthandler(text, thread_names(), main_id), "all_reduce", 1)

    return run


class HoldMeter:
    """Stands in for the `time` module inside `megatrace.tracer.stacks` and records, in CPU time of
    the capturing thread, each stretch it held the GIL between two hand-backs (``time.sleep(0)``):
    the longest is what the main thread could wait on a machine with a free core, whatever the
    scheduler of a loaded one adds."""

    def __init__(self) -> None:
        self.holds: list[float] = []
        self._since = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter()

    def begin(self) -> None:
        self._since = time.thread_time()

    def sleep(self, seconds: float) -> None:
        self.end()
        time.sleep(seconds)
        self.begin()

    def end(self) -> None:
        self.holds.append(time.thread_time() - self._since)


def metered(meter: HoldMeter) -> Callable[[], None]:
    def run() -> None:
        meter.begin()
        as_the_watchdog_does()
        meter.end()

    return run


def busy_python() -> None:
    end = time.perf_counter() + 0.01
    while time.perf_counter() < end:
        pass


def measure(capture: Callable[[], None] | None, captures: int) -> tuple[list[float], list[float]]:
    """(main-thread block per capture, capture time per capture), seconds; with no capture, the
    longest loop gap in windows as long as the captures would take."""
    windows: list[tuple[float, float]] = []
    done = threading.Event()

    def watchdog() -> None:
        for _ in range(captures):
            time.sleep(0.02)
            start = time.perf_counter()
            if capture is None:
                time.sleep(0.01)
            else:
                capture()
            windows.append((start, time.perf_counter()))
        done.set()

    gaps: list[tuple[float, float]] = []
    thread = threading.Thread(target=watchdog, name="bench-watchdog")
    previous = time.perf_counter()
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        if now - previous > GAP_S:
            gaps.append((previous, now))
        previous = now
    thread.join()
    blocks = [max((b - a for a, b in gaps if a < end and b > start), default=0.0) for start, end in windows]
    return blocks, [end - start for start, end in windows]


def ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1e3:6.2f} ms, max {max(values) * 1e3:6.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--captures", type=int, default=30)
    args = parser.parse_args()
    release = threading.Event()
    workers = [
        threading.Thread(target=waiting_thread, args=(release, args.depth), daemon=True)
        for _ in range(args.threads)
    ]
    for worker in workers:
        worker.start()
    while sum(len(stack.frames) >= args.depth for stack in capture_stacks()) < args.threads:
        time.sleep(0.01)
    frames = sum(len(stack.frames) for stack in capture_stacks())
    print(f"{args.threads} threads x {args.depth} frames ({frames} frames in all), {args.captures} runs each")
    print(f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms, Python {sys.version.split()[0]}")
    dump_holds: list[float] = []
    ways = (
        ("no capture", None),
        ("busy Python", busy_python),
        ("capture_stacks", as_the_watchdog_does),
        ("faulthandler", with_faulthandler(dump_holds)),
    )
    for label, capture in ways:
        blocks, times = measure(capture, args.captures)
        took = "" if capture is None else f"; it took {ms(times)}"
        print(f"{label:15s} main thread blocked {ms(blocks)}{took}")
    meter = HoldMeter()
    stacks_module.time = meter  # type: ignore[assignment]
    measure(metered(meter), args.captures)
    print(f"capture_stacks  GIL held between hand-backs, CPU time of the capturing thread: {ms(meter.holds)}")
    print(f"faulthandler    GIL held by dump_traceback, CPU time of the capturing thread: {ms(dump_holds)}")
    release.set()


if __name__ == "__main__":
    main()
