"""The CPU-heavy part of serving trace data, in a process of its own at lower priority.

Cutting a ring window (reading and selecting the records) and gzip-compressing it cost a few
milliseconds of CPU each; done in the agent's own threads, they hold the interpreter lock the
``/metrics`` thread needs, and lowering those threads' priority makes that worse (a thread that holds
the lock and waits for a CPU stalls the scrape). So the trace endpoint hands them to `Workers`: a pool
of `SERVE_WORKERS` process(es) started at nice `SERVE_NICE`, which the system schedules after the
agent's scrapes. The endpoint's threads only check the request, wait for the answer (without the
lock) and send it. The functions run there (`ring_reply`, `dump_reply`) take and return plain values.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from megatrace.exporters.trace_store import Refused, read_bounded
from megatrace.exporters.trace_window import Window, dump_window, ring_window

log = logging.getLogger(__name__)

SERVE_NICE = 10  # added to the agent's niceness for the serving process
SERVE_WORKERS = 1
GZIP_LEVEL = 1  # fast: ring records shrink about as much at level 1 as at 6
GZIP_MIN_BYTES = 1024
RESULT_TIMEOUT_S = 120.0


def gzip_bytes(body: bytes) -> bytes:
    """`body` as a gzip member."""
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
    return compressor.compress(body) + compressor.flush()


def _maybe_gzip(body: bytes, compress: bool) -> tuple[bytes, bool]:
    if compress and len(body) > GZIP_MIN_BYTES:
        return gzip_bytes(body), True
    return body, False


def ring_reply(path: Path, window: Window, limit: int, alive: bool, compress: bool) -> tuple[bytes, bool]:
    """A ring window's file bytes (gzip-compressed when `compress`), and whether they are compressed."""
    body, _ = ring_window(path, window, limit, alive)
    return _maybe_gzip(body, compress)


def dump_reply(path: Path, last: int | None, limit: int, compress: bool) -> tuple[bytes, bool]:
    """A stall dump cut to its newest `last` records (gzip-compressed when `compress`)."""
    return _maybe_gzip(dump_window(read_bounded(path, limit), last), compress)


def stacks_reply(path: Path, limit: int, compress: bool) -> tuple[bytes, bool]:
    """A stacks file as written (gzip-compressed when `compress`)."""
    return _maybe_gzip(read_bounded(path, limit), compress)


def _serving_process_start(nice: int, agent_pid: int) -> None:
    """In the serving process: lower its priority, and end it when the agent is gone (killed outright,
    the agent cannot stop it)."""
    os.nice(nice)

    def watch() -> None:
        while os.getppid() == agent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="agent-watch", daemon=True).start()


class Workers:
    """The serving process pool: started at once (the first request does not wait for it), started
    again if its process dies (that request is answered 503, which clients retry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = self._start()

    @staticmethod
    def _start() -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(
            max_workers=SERVE_WORKERS,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_serving_process_start,
            initargs=(SERVE_NICE, os.getpid()),
        )
        pool.submit(os.getpid)  # spawns the process now
        return pool

    def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` in the serving process; its exceptions are raised here."""
        with self._lock:
            pool = self._pool
        try:
            return pool.submit(function, *args).result(timeout=RESULT_TIMEOUT_S)
        except BrokenProcessPool:
            log.warning("trace endpoint: the serving process died; starting another")
            with self._lock:
                if self._pool is pool:
                    self._pool = self._start()
            raise Refused(503, "busy; try again") from None
        except TimeoutError:
            raise Refused(503, "busy; try again") from None

    def close(self) -> None:
        with self._lock:
            self._pool.shutdown(wait=True, cancel_futures=True)
