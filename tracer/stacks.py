"""Python stacks of every thread of a rank: captured in-process for stall dumps, parsed from
faulthandler's text, and written to / read from a dump's ``# stacks`` lines.

`capture_stacks` walks `sys._current_frames()` from the watchdog thread and hands the GIL back
between threads, with garbage collection paused, so the training thread waits at most about half a
millisecond at a time (faulthandler's
`dump_traceback` holds the GIL for its whole dump: ~9 ms at 64 threads x 50 frames, see
``bench/bench_stacks.py``). When the training thread holds the GIL in C, no Python thread runs at
all: then faulthandler's own C thread writes the stacks (`megatrace.tracer.stack_fallback`), in the
text that `parse_faulthandler` reads. Limits follow faulthandler's: 100 frames a thread (the
innermost kept), 500 characters a string.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import sys
import threading
import time
from collections.abc import Iterator
from urllib.parse import quote, unquote

MAX_FRAMES = 100
MAX_STRING = 500
# the walk gives the GIL back once it has held it this long (the training thread may be waiting)
_HOLD_S = 0.0005
# and sleeps this long, so that a training thread woken by the release can take it before the walk
# wants it back (a zero sleep let the walk take it straight back: the training thread waited for its
# switch interval, 5 ms, each time)
_BREAK_S = 0.0002


@dataclasses.dataclass(frozen=True)
class Frame:
    """One Python frame: its file, current line and function name."""

    file: str
    line: int
    function: str


@dataclasses.dataclass(frozen=True)
class ThreadStack:
    """One thread's Python stack, innermost frame first (faulthandler's "most recent call first")."""

    thread_id: int
    name: str
    main: bool
    frames: tuple[Frame, ...]
    # more frames than MAX_FRAMES: the outermost were left out
    truncated: bool = False


def thread_names() -> dict[int, str]:
    """Names of the threads `threading` knows, by id (the id faulthandler prints)."""
    return {thread.ident: thread.name for thread in threading.enumerate() if thread.ident is not None}


def _walk(frame: object) -> tuple[tuple[Frame, ...], bool]:
    frames = []
    while frame is not None and len(frames) < MAX_FRAMES:
        code = frame.f_code  # type: ignore[attr-defined]
        line = frame.f_lineno  # type: ignore[attr-defined]
        frames.append(Frame(code.co_filename[:MAX_STRING], line or 0, code.co_name[:MAX_STRING]))
        frame = frame.f_back  # type: ignore[attr-defined]
    return tuple(frames), frame is not None


class _GilBreaks:
    """Hands the GIL back (to the training thread, if it waits) once the caller has held it _HOLD_S."""

    def __init__(self) -> None:
        self.since = time.perf_counter()

    def check(self) -> None:
        if time.perf_counter() - self.since > _HOLD_S:
            time.sleep(_BREAK_S)
            self.since = time.perf_counter()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside the block (it is turned back on after, if it was on): the
    thousands of objects a capture makes would otherwise start collections in the capturing thread,
    each holding the GIL for milliseconds, in one piece."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def capture_stacks() -> tuple[ThreadStack, ...]:
    """Every thread's stack, the main thread first (walked before anything else, so it is coherent);
    the GIL is handed back between threads whenever the walk has held it for about half a
    millisecond, which bounds how long the training thread waits on it. Call it inside `gc_paused`."""
    frames_by_thread = sys._current_frames()
    names = thread_names()
    main_id = threading.main_thread().ident
    order = sorted(frames_by_thread, key=lambda ident: ident != main_id)
    stacks = []
    breaks = _GilBreaks()
    for ident in order:
        frames, truncated = _walk(frames_by_thread.pop(ident))
        stacks.append(ThreadStack(ident, names.get(ident, ""), ident == main_id, frames, truncated))
        breaks.check()
    return tuple(stacks)


def main_stack(stacks: tuple[ThreadStack, ...]) -> ThreadStack | None:
    """The main thread's stack among `stacks`, if it is there."""
    return next((stack for stack in stacks if stack.main), None)


# faulthandler's text (CPython Python/traceback.c): a header per thread, one line per frame, "  ..."
# after MAX_FRAMES frames, "  <no Python frame>" for a thread without any, "..." past 100 threads
_THREAD = re.compile(r"(Current thread|Thread) 0x([0-9a-fA-F]+)(?: \[(.*)\])? \(most recent call first\):")
_STACK = "Stack (most recent call first):"
_FRAME = re.compile(r'  File "(.*)", line (\d+|\?\?\?) in (.*)')


def parse_faulthandler(
    text: str, names: dict[int, str] | None = None, main_id: int = 0
) -> tuple[ThreadStack, ...]:
    """The thread stacks in faulthandler's output `text` (`dump_traceback` or `dump_traceback_later`),
    in its order. `names`: thread names by id (faulthandler prints none before Python 3.14);
    `main_id`: the main thread's id (faulthandler does not mark it). Lines it does not know (the
    "Timeout (…)!" header, a truncation mark) are passed over."""
    names = names or {}
    stacks: list[ThreadStack] = []
    current: list[Frame] | None = None
    ident, name, truncated = 0, "", False

    def close() -> None:
        if current is not None:
            stacks.append(
                ThreadStack(ident, name, bool(main_id) and ident == main_id, tuple(current), truncated)
            )

    for line in text.splitlines():
        header = _THREAD.fullmatch(line)
        if header or line == _STACK:
            close()
            ident = int(header.group(2), 16) if header else main_id
            name = (header.group(3) if header else None) or names.get(ident, "")
            current, truncated = [], False
            continue
        frame = _FRAME.fullmatch(line) if current is not None else None
        if frame and current is not None:
            number = frame.group(2)
            current.append(Frame(frame.group(1), int(number) if number.isdigit() else 0, frame.group(3)))
        elif line == "  ..." and current is not None:
            truncated = True
    close()
    return tuple(stacks)


# ---- the dump's stack section: "# stacks", then per thread "# thread" and its "# frame" lines

STACKS_LINE = "# stacks "
THREAD_LINE = "# thread "
FRAME_LINE = "# frame "
_SAFE = "/<>:@+,()[]"


def _field(value: str) -> str:
    return quote(value, safe=_SAFE) if value else "-"


def _unfield(raw: str) -> str:
    return "" if raw == "-" else unquote(raw)


def stack_lines(stacks: tuple[ThreadStack, ...], in_flight: str, in_flight_since_ns: int) -> list[str]:
    """The dump lines of `stacks`: a ``# stacks`` line (how many threads, which one is main, the op in
    flight if any), then each thread's ``# thread`` line and its ``# frame`` lines, innermost first.
    No lines for no stacks."""
    if not stacks:
        return []
    main = main_stack(stacks)
    lines = [
        STACKS_LINE
        + f"threads={len(stacks)} main=0x{main.thread_id if main else 0:016x} "
        + f"in_flight={_field(in_flight)} in_flight_since_ns={in_flight_since_ns if in_flight else 0}"
    ]
    breaks = _GilBreaks()
    for stack in stacks:
        breaks.check()
        lines.append(
            THREAD_LINE + f"id=0x{stack.thread_id:016x} name={_field(stack.name)} main={int(stack.main)} "
            f"frames={len(stack.frames)} truncated={int(stack.truncated)}"
        )
        lines.extend(
            FRAME_LINE + f"file={_field(f.file)} line={f.line} function={_field(f.function)}"
            for f in stack.frames
        )
    return lines


class StackLinesError(ValueError):
    """A stack line that cannot be read; the message says why (the caller adds where)."""


def _pairs(text: str) -> dict[str, str]:
    pairs = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if not sep:
            raise StackLinesError(f"expected key=value, got {token!r}")
        pairs[key] = value
    return pairs


def _number(pairs: dict[str, str], key: str, base: int = 10) -> int:
    try:
        return int(pairs[key], base)
    except KeyError:
        raise StackLinesError(f"missing {key}=") from None
    except ValueError:
        raise StackLinesError(f"{key}= is not a number: {pairs[key]!r}") from None


@dataclasses.dataclass
class StackSection:
    """A dump's stack section as it is read back, line by line (`add` each ``# stacks``, ``# thread``
    and ``# frame`` line in order). The ``# stacks`` line is checked only: the op in flight it names
    is the header's."""

    _threads: list[tuple[ThreadStack, list[Frame]]] = dataclasses.field(default_factory=list)

    @staticmethod
    def holds(line: str) -> bool:
        """Whether `line` belongs to a stack section."""
        return line.startswith((STACKS_LINE, THREAD_LINE, FRAME_LINE))

    def add(self, line: str) -> None:
        """Read one line of the section; StackLinesError when it is malformed or out of place."""
        if line.startswith(STACKS_LINE):
            _pairs(line[len(STACKS_LINE) :])
        elif line.startswith(THREAD_LINE):
            pairs = _pairs(line[len(THREAD_LINE) :])
            stack = ThreadStack(
                thread_id=_number(pairs, "id", 16),
                name=_unfield(pairs.get("name", "-")),
                main=pairs.get("main") == "1",
                frames=(),
                truncated=pairs.get("truncated") == "1",
            )
            self._threads.append((stack, []))
        else:
            if not self._threads:
                raise StackLinesError("a frame line before any thread line")
            pairs = _pairs(line[len(FRAME_LINE) :])
            self._threads[-1][1].append(
                Frame(
                    _unfield(pairs.get("file", "-")),
                    _number(pairs, "line"),
                    _unfield(pairs.get("function", "-")),
                )
            )

    def stacks(self) -> tuple[ThreadStack, ...]:
        """The threads read so far, with their frames."""
        return tuple(dataclasses.replace(stack, frames=tuple(frames)) for stack, frames in self._threads)
