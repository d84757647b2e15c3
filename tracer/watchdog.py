"""The stall watchdog: a thread that dumps the rank's ring as text when it stops making progress.

A stall is an op in flight for longer than the sensitivity, or no op issued or completed for longer
than it. One dump per stall episode; also one on SIGUSR1 (any previous handler still runs) and one
at exit. The dump is built from a copy of the ring in this thread, never in the training thread;
stall and signal dumps carry every thread's Python stack (`megatrace.tracer.stacks`). The same thread
samples the rank's host signals into the ring header (`host_signals.HostSampler`) every sampling
interval and before each dump, and keeps faulthandler's timer armed (`megatrace.tracer.stack_fallback`)
for a training thread that holds the GIL so long that this thread cannot run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import signal
import threading
import time
from pathlib import Path

from megatrace.tracer.dumpfile import dump_path, write_dump
from megatrace.tracer.format import PAUSE_KIND_NAMES, W_PAUSE_KIND
from megatrace.tracer.host_signals import HostSampler
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import (
    W_DUMPS_WRITTEN,
    W_FINISHED,
    W_LAST_COMPLETE_NS,
    W_LAST_ENQUEUE_NS,
    W_LAST_STEP_END_NS,
    W_OLDEST_INFLIGHT_ENQUEUE_NS,
    read_ring,
)
from megatrace.tracer.stack_fallback import StackFallback
from megatrace.tracer.stacks import capture_stacks, gc_paused

log = logging.getLogger("megatrace.tracer")
# dumps that carry every thread's stack (the exit dump does not: its main thread is in atexit)
STACK_REASONS = frozenset({"stall", "signal"})


def is_stalled(header: memoryview, now_ns: int, stall_ns: int) -> bool:
    """Whether the counters in `header` show a stall at `now_ns`."""
    if header[W_FINISHED]:
        return False
    oldest = header[W_OLDEST_INFLIGHT_ENQUEUE_NS]
    if oldest and now_ns - oldest > stall_ns:
        return True
    progress = max(header[W_LAST_ENQUEUE_NS], header[W_LAST_COMPLETE_NS], header[W_LAST_STEP_END_NS])
    return bool(header[W_LAST_ENQUEUE_NS]) and now_ns - progress > stall_ns


class Watchdog:
    """Watches one rank's ring header and writes dumps into the job folder."""

    def __init__(
        self,
        recorder: Recorder,
        job_dir: Path,
        rank: int,
        stall_ns: int,
        sampler: HostSampler | None = None,
        stacks_fallback: bool = True,
    ) -> None:
        self.recorder = recorder
        self.sampler = sampler
        self._next_sample_ns = 0
        self.writer = recorder.writer
        self.job_dir = job_dir
        self.rank = rank
        self.stall_ns = stall_ns
        self.interval = max(0.01, min(stall_ns / 4e9, 0.25))
        self.dumps = 0
        self._stop = threading.Event()
        self._dump_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="megatrace-watchdog", daemon=True)
        self._hooked = False
        self._previous_sigusr1: object = None
        self._restore_wakeup_fd = False
        self.fallback: StackFallback | None = None
        if stacks_fallback:
            self.fallback = StackFallback(job_dir, rank, stall_ns)

    def start_thread(self) -> None:
        """Start watching; hook SIGUSR1 when called from the main thread; arm the stack fallback."""
        if threading.current_thread() is threading.main_thread():
            self._hook_sigusr1()
        if self.fallback is not None and not self.fallback.start():
            self.fallback = None
        self._thread.start()

    def _hook_sigusr1(self) -> None:
        previous = signal.getsignal(signal.SIGUSR1)
        via_wakeup_fd = False
        with contextlib.suppress(ValueError, OSError):
            old_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
            if old_fd == -1:
                via_wakeup_fd = True
                self._restore_wakeup_fd = True
            else:
                signal.set_wakeup_fd(old_fd)
        wake_w = self._wake_w

        def on_sigusr1(signum: int, frame: object) -> None:
            if not via_wakeup_fd:
                with contextlib.suppress(OSError):
                    os.write(wake_w, bytes([signal.SIGUSR1]))
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGUSR1, on_sigusr1)
        self._previous_sigusr1 = previous if previous is not None else signal.SIG_DFL
        self._hooked = True

    def _sample_host(self, now_ns: int, force: bool = False) -> None:
        """Sample the host signals when the interval is up (or `force`d: before a dump)."""
        sampler = self.sampler
        if sampler is None or not (force or now_ns >= self._next_sample_ns):
            return
        sampler.sample()
        self._next_sample_ns = now_ns + sampler.interval_ns

    def _run(self) -> None:
        in_stall = False
        while not self._stop.is_set():
            self._sample_host(time.time_ns())
            ready, _, _ = select.select([self._wake_r], [], [], self.interval)
            if self._stop.is_set():
                break
            if ready and self._signalled():
                self.dump("signal")
            self.recorder.publish()
            if self.fallback is not None:
                self.fallback.tick()
            stalled = is_stalled(self.writer.header, time.time_ns(), self.stall_ns)
            if stalled and not in_stall:
                self.dump("stall")
            in_stall = stalled

    def _signalled(self) -> bool:
        try:
            data = os.read(self._wake_r, 512)
        except BlockingIOError:
            return False
        return signal.SIGUSR1 in data

    def dump(self, reason: str) -> Path | None:
        """Write a dump of the ring now; returns its path (None if writing failed, which is logged)."""
        if self.fallback is not None:
            self.fallback.tick()  # a full timeout for the dump itself: a slow one is no starved watchdog
        with self._dump_lock, gc_paused():
            try:
                self.recorder.publish()
                self._sample_host(time.time_ns(), force=True)
                snapshot = read_ring(self.writer.path)
                if reason in STACK_REASONS:
                    snapshot = dataclasses.replace(snapshot, stacks=capture_stacks())
                path = dump_path(self.job_dir, self.rank, os.getpid(), self.dumps)
                write_dump(path, snapshot, reason)
                del snapshot  # its stacks go while collection is still paused
            except (OSError, ValueError) as exc:
                log.warning("megatrace tracer: could not write %s dump: %s", reason, exc)
                return None
            self.dumps += 1
            self.writer.header[W_DUMPS_WRITTEN] = self.dumps
        pause = PAUSE_KIND_NAMES.get(self.writer.header[W_PAUSE_KIND], "")
        during = f" during a {pause} pause" if pause else ""
        log.warning("megatrace tracer: rank %d wrote %s dump %s%s", self.rank, reason, path, during)
        return path

    def stop(self) -> None:
        """Stop the thread (waits briefly for it) and give SIGUSR1 back to its previous handler."""
        if self._hooked and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._previous_sigusr1)  # type: ignore[arg-type]
            if self._restore_wakeup_fd:
                signal.set_wakeup_fd(-1)
            self._hooked = False
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self.fallback is not None:
            self.fallback.stop()
