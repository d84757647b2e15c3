"""Removes finished jobs' trace folders from the node's trace directory, by age and by total size.

The trace directory is often a tmpfs (``/run``): left alone, old rings and dumps fill it until a new
job cannot reserve its ring. A job folder ``<trace_dir>/<job>`` may be removed once its job is over
(no rank file has a live writer) and no file in it changed for the grace period; it is removed when
its newest file is older than the retention age, or, oldest first, while the folders together exceed
the size limit. A running job's folder is never removed. What is kept is what the alert bot's
drill-down can still analyze.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from megatrace.exporters.tracer_files import writer_alive
from megatrace.regular_files import is_regular
from megatrace.tracer.ringfile import RingFormatError, RingHeader, read_header

log = logging.getLogger(__name__)

PRUNE_INTERVAL_S = 60.0


@dataclasses.dataclass(frozen=True)
class JobFolder:
    """One job's folder: its size in bytes, when anything in it last changed, whether a rank runs."""

    path: Path
    size: int
    newest: float
    running: bool


def job_running(folder: Path, is_alive: Callable[[Path, RingHeader], bool] = writer_alive) -> bool:
    """Whether any rank of the job still writes its ring (unreadable rings count as not running)."""
    for ring in folder.glob("rank-*.trace"):
        if not is_regular(ring):
            continue
        try:
            header = read_header(ring)
        except RingFormatError:
            continue
        if not header.finished and is_alive(ring, header):
            return True
    return False


def scan(trace_dir: Path, is_alive: Callable[[Path, RingHeader], bool] = writer_alive) -> list[JobFolder]:
    """The job folders directly under `trace_dir` (symbolic links are not followed, nor listed)."""
    folders = []
    try:
        entries = list(os.scandir(trace_dir))
    except OSError:
        return []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        size, newest = 0, 0.0
        for root, _, files in os.walk(entry.path):
            for name in files:
                try:
                    info = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    size += info.st_blocks * 512
                newest = max(newest, info.st_mtime)
        if not newest:  # an empty folder: when it was made or emptied
            newest = entry.stat(follow_symlinks=False).st_mtime
        path = Path(entry.path)
        folders.append(JobFolder(path, size, newest, job_running(path, is_alive)))
    return folders


def prune(
    trace_dir: str | Path,
    max_age_s: float,
    max_bytes: int,
    grace_s: float,
    now: float,
    is_alive: Callable[[Path, RingHeader], bool] = writer_alive,
) -> list[Path]:
    """Remove finished job folders older than `max_age_s`, then the oldest finished ones while all
    folders together exceed `max_bytes` (0: no size limit); returns the folders removed."""
    folders = sorted(scan(Path(trace_dir), is_alive), key=lambda f: f.newest)
    removable = [f for f in folders if not f.running and now - f.newest > grace_s]
    total = sum(f.size for f in folders)
    removed = []
    for folder in removable:
        too_old = now - folder.newest > max_age_s
        too_big = max_bytes > 0 and total > max_bytes
        if not (too_old or too_big):
            continue
        shutil.rmtree(folder.path, ignore_errors=True)
        if folder.path.exists():
            log.warning("trace retention: could not remove all of %s", folder.path)
            continue
        total -= folder.size
        removed.append(folder.path)
        reason = "older than the retention age" if too_old else "over the size limit"
        log.info("trace retention: removed %s (%d bytes, %s)", folder.path, folder.size, reason)
    if max_bytes > 0 and total > max_bytes:
        log.warning(
            "trace retention: %s holds %d bytes, over the limit of %d, in running or recent jobs",
            trace_dir,
            total,
            max_bytes,
        )
    return removed


class RetentionThread:
    """Runs `prune` every `PRUNE_INTERVAL_S` seconds in a daemon thread until `close`."""

    def __init__(self, trace_dir: str, max_age_s: float, max_bytes: int, grace_s: float) -> None:
        self._args = (trace_dir, max_age_s, max_bytes, grace_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trace-retention", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        trace_dir, max_age_s, max_bytes, grace_s = self._args
        while True:
            try:
                prune(trace_dir, max_age_s, max_bytes, grace_s, time.time())
            except OSError as exc:
                log.warning("trace retention: %s", exc)
            if self._stop.wait(PRUNE_INTERVAL_S):
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
