"""Where a stalled rank is stuck: its main thread's innermost frames that are its own code.

Frames of torch itself, of Megatrace's tracer machinery and of the standard library's waiting
plumbing (threading, selectors, queue) say how a rank waits, not where: `where_stuck` skips them and
names the innermost frames left, e.g. "in `save_checkpoint` → `torch.serialization.save`
(checkpoint.py:88)" or "in `train` → `take_lock` (locks.py:12)".
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path, PurePath

import megatrace.tracer
from megatrace.tracer.stacks import Frame, ThreadStack, main_stack

MAX_STUCK_FRAMES = 5
_TORCH = re.compile(r"[/\\](site|dist)-packages[/\\]torch[/\\]")
_STDLIB_PLUMBING = re.compile(r"[/\\]python3\.\d+[/\\](threading|selectors|queue)\.py$")
# the tracer's own machinery (how a collective is recorded, how the watchdog looks), not user code;
# its fault injection and example jobs stand in for user code and are kept
_TRACER_MODULES = frozenset(
    {"autoload", "native", "pause_hooks", "pauses", "recorder", "runtime", "stack_fallback", "stacks",
     "watchdog", "wrappers"}
)  # fmt: skip
_TRACER_DIR = Path(megatrace.tracer.__file__).resolve().parent
# functions that only wrap the call a rank made (torch's logging and no-grad decorators): the call
# named is the first one below them
_DECORATOR_FUNCTIONS = frozenset({"wrapper", "inner", "_fn", "decorate_context", "wrapped"})


@dataclasses.dataclass(frozen=True)
class StuckAt:
    """The main thread's innermost frames that are not internals (innermost first, at most
    MAX_STUCK_FRAMES), and a one-line description."""

    frames: tuple[Frame, ...]
    text: str


def is_internal(frame: Frame) -> bool:
    """Whether `frame` is torch, Megatrace tracer machinery or standard-library waiting plumbing."""
    path = frame.file
    if _TORCH.search(path) or _STDLIB_PLUMBING.search(path):
        return True
    pure = PurePath(path)
    if pure.suffix != ".py" or pure.stem not in _TRACER_MODULES:
        return False
    return pure.parent.parts[-2:] == ("megatrace", "tracer") or pure.parent == _TRACER_DIR


def _where(frame: Frame) -> str:
    return f"{PurePath(frame.file).name}:{frame.line}"


def _is_tracer(frame: Frame) -> bool:
    return is_internal(frame) and not (_TORCH.search(frame.file) or _STDLIB_PLUMBING.search(frame.file))


def qualified(frame: Frame) -> str:
    """A torch or standard-library frame's function with its module (``torch.serialization.save``,
    ``queue.get``); other frames' function alone."""
    parts = PurePath(frame.file).with_suffix("").parts
    if _TORCH.search(frame.file):
        module = parts[max(i for i, part in enumerate(parts) if part == "torch") :]
    elif _STDLIB_PLUMBING.search(frame.file):
        module = parts[-1:]
    else:
        return frame.function
    return ".".join([*(part for part in module if part != "__init__"), frame.function])


def where_stuck(stacks: tuple[ThreadStack, ...], in_flight: str = "") -> StuckAt | None:
    """Where the main thread in `stacks` is stuck; None without a main thread or without any frame
    of its own. The text names the innermost own frame's function and the call it is stuck in (the
    outermost torch / standard-library frame it called, decorators passed over), or else its caller,
    with the innermost own frame's file and line; `in_flight` (the collective in flight on the rank,
    if any) is added."""
    main = main_stack(stacks)
    if main is None:
        return None
    own = [index for index, frame in enumerate(main.frames) if not is_internal(frame)]
    if not own:
        return None
    frames = tuple(main.frames[index] for index in own[:MAX_STUCK_FRAMES])
    inner = frames[0]
    called = [
        frame
        for frame in main.frames[: own[0]]
        if not _is_tracer(frame) and frame.function not in _DECORATOR_FUNCTIONS
    ]
    if called:
        chain = f"`{inner.function}` → `{qualified(called[-1])}`"
    elif len(frames) > 1:
        chain = f"`{frames[1].function}` → `{inner.function}`"
    else:
        chain = f"`{inner.function}`"
    text = f"in {chain} ({_where(inner)})"
    if in_flight:
        text += f", collective `{in_flight}` in flight"
    return StuckAt(frames, text)
