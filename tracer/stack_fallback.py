"""The stacks of a rank whose watchdog cannot run: faulthandler's timer, re-armed by the watchdog.

A training thread stuck in C while holding the GIL stops every Python thread, the watchdog too, so
no stall dump can be written. The watchdog therefore keeps `faulthandler.dump_traceback_later`
armed, re-arming it on every tick with a timeout a bit over the stall threshold: if the watchdog is
starved that long, faulthandler's own C thread (it needs no GIL) appends every thread's stack to
``<job dir>/rank-<N>.<pid>.stacks``. That file starts with a ``# megatrace-stacks`` line (rank, pid,
main thread id) and ``# thread`` lines naming threads; faulthandler's text follows, one block per
firing, each starting "Timeout (…)!". `read_stacks_file` reads the newest block.

faulthandler keeps one such timer per process. A process that arms its own through
`faulthandler.dump_traceback_later` after the tracer started is seen (the module function is
wrapped) and the watchdog stops arming from then on; one armed before the tracer started cannot be
seen (faulthandler has no way to ask), and is replaced: ``MEGATRACE_TRACE_STACKS_FALLBACK=0`` keeps
the tracer off the timer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from megatrace.tracer.stacks import ThreadStack, parse_faulthandler, thread_names

log = logging.getLogger("megatrace.tracer")
STACKS_MAGIC = "# megatrace-stacks"
STACKS_SUFFIX = ".stacks"
STACKS_VERSION = 1
_TIMEOUT_LINE = re.compile(r"Timeout \([0-9:.]+\)!")


def stacks_path(job_dir: Path, rank: int, pid: int) -> Path:
    """Where process `pid`, rank `rank`, has faulthandler write its stacks."""
    return Path(job_dir) / f"rank-{rank}.{pid}{STACKS_SUFFIX}"


def fallback_timeout_s(stall_ns: int) -> float:
    """The timer's timeout: the stall threshold plus a tenth of it, at least one second more."""
    stall_s = stall_ns / 1e9
    return stall_s + max(1.0, stall_s / 10)


_timer_lock = threading.Lock()
_timer_taken_by_user = False
_timer_owner: StackFallback | None = None
_real_dump_later: Callable[..., None] = faulthandler.dump_traceback_later


def _user_dump_later(*args: Any, **kwargs: Any) -> None:
    """`faulthandler.dump_traceback_later` as this process's code sees it once the tracer runs: the
    user's call goes through, and the tracer's watchdog stops re-arming the timer."""
    global _timer_taken_by_user
    with _timer_lock:
        if not _timer_taken_by_user and _timer_owner is not None:
            log.warning(
                "megatrace tracer: this process arms faulthandler.dump_traceback_later itself; the "
                "tracer's stack fallback (for a thread stuck holding the GIL) is off from now on"
            )
        _timer_taken_by_user = True
        _real_dump_later(*args, **kwargs)


def _field(value: str) -> str:
    return quote(value, safe="") if value else "-"


class StackFallback:
    """One process's faulthandler timer and its stacks file; `start` once, `tick` from the watchdog's
    loop, `stop` at the end (removes the file if faulthandler never wrote to it)."""

    def __init__(self, job_dir: Path, rank: int, stall_ns: int) -> None:
        self.path = stacks_path(job_dir, rank, os.getpid())
        self.job = Path(job_dir).name
        self.rank = rank
        self.timeout_s = fallback_timeout_s(stall_ns)
        self._fd: int | None = None
        self._named: dict[int, str] = {}
        self._lock = threading.Lock()

    def start(self) -> bool:
        """Create the stacks file and arm the timer; False (logged) when it cannot be: another
        fallback of this process or the process itself holds the timer, or the file cannot be made."""
        global _timer_owner
        with _timer_lock:
            if _timer_owner is not None or _timer_taken_by_user:
                log.warning(
                    "megatrace tracer: faulthandler's timer is taken; no stack fallback for rank %d",
                    self.rank,
                )
                return False
            try:
                fd = os.open(
                    self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644
                )
            except OSError as exc:
                log.warning("megatrace tracer: no stack fallback: cannot create %s: %s", self.path, exc)
                return False
            _timer_owner = self
            faulthandler.dump_traceback_later = _user_dump_later  # type: ignore[assignment]
        main = threading.main_thread().ident or 0
        header = (
            f"{STACKS_MAGIC} version={STACKS_VERSION} job={_field(self.job)} rank={self.rank} "
            f"pid={os.getpid()} main=0x{main:016x} timeout_s={self.timeout_s:g}\n"
        )
        with self._lock:
            self._fd = fd
            self._write(header)
        self.tick()
        return True

    def _write(self, text: str) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._fd, text.encode("ascii", "backslashreplace"))

    def tick(self) -> None:
        """Name threads not named yet in the file, and re-arm the timer (the watchdog runs: no stall
        that only faulthandler could see)."""
        with self._lock:
            if self._fd is None:
                return
            names = thread_names()
            new = {ident: name for ident, name in names.items() if self._named.get(ident) != name}
            if new:
                self._write("".join(f"# thread id=0x{i:016x} name={_field(n)}\n" for i, n in new.items()))
                self._named.update(new)
            with _timer_lock:
                if not _timer_taken_by_user:
                    _real_dump_later(self.timeout_s, repeat=False, file=self._fd, exit=False)

    def fired(self) -> bool:
        """Whether faulthandler has written stacks into the file."""
        try:
            text = self.path.read_text(encoding="ascii", errors="replace")
        except OSError:
            return False
        return any(_TIMEOUT_LINE.fullmatch(line) for line in text.splitlines())

    def stop(self) -> None:
        """Disarm the timer, close the file, and remove it when faulthandler never wrote to it."""
        global _timer_owner
        with self._lock:
            if self._fd is None:
                return
            with _timer_lock:
                if not _timer_taken_by_user:
                    faulthandler.cancel_dump_traceback_later()
                _timer_owner = None
            os.close(self._fd)
            self._fd = None
        if not self.fired():
            with contextlib.suppress(OSError):
                self.path.unlink()


@dataclasses.dataclass(frozen=True)
class StacksFile:
    """What a stacks file holds: its rank, and the stacks of the newest firing (empty: none)."""

    job: str
    rank: int
    pid: int
    firings: int
    stacks: tuple[ThreadStack, ...]


class StacksFileError(ValueError):
    """A stacks file that cannot be read; the message names the file and line."""


def read_stacks_file(path: str | Path) -> StacksFile:
    """The stacks of the newest firing in a stacks file (none when faulthandler never wrote)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise StacksFileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if not lines or not lines[0].startswith(STACKS_MAGIC):
        raise StacksFileError(f"{path}: not a Megatrace stacks file (first line must start {STACKS_MAGIC!r})")
    head = dict(token.partition("=")[::2] for token in lines[0][len(STACKS_MAGIC) :].split())
    try:
        rank, pid, main = int(head["rank"]), int(head["pid"]), int(head["main"], 16)
    except (KeyError, ValueError):
        raise StacksFileError(f"{path}:1: needs rank=, pid= and main= (hex)") from None
    firings = [number for number, line in enumerate(lines) if _TIMEOUT_LINE.fullmatch(line)]
    names: dict[int, str] = {}
    for line in lines[1 : firings[-1] if firings else 1]:
        if line.startswith("# thread "):
            fields = dict(token.partition("=")[::2] for token in line[len("# thread ") :].split())
            with contextlib.suppress(KeyError, ValueError):
                name = fields.get("name", "-")
                names[int(fields["id"], 16)] = "" if name == "-" else unquote(name)
    stacks = parse_faulthandler("\n".join(lines[firings[-1] + 1 :]), names, main) if firings else ()
    job = head.get("job", "-")
    return StacksFile("" if job == "-" else unquote(job), rank, pid, len(firings), stacks)
