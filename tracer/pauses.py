"""Known pauses of a rank (checkpoint, eval, data loading): their state in the ring header, and records.

`Pauses.begin(kind)` / `Pauses.end(token)` bracket a span; spans of one kind nest (a `torch.save`
inside a distributed checkpoint save is one checkpoint pause), kinds overlap freely. While a kind is
in progress its entry in the header holds since when; when it ends the entry counts it and its time,
and the span is written as a ring record (op `format.OP_PAUSE`, peer = the kind, seq = its number).
Word `W_PAUSE_KIND` names the kind begun last among those in progress, which is what the stall
watchdog's dumps and log line report. Where the rank has no ring yet, nothing is marked.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from megatrace.tracer.format import (
    OP_PAUSE,
    P_ENDED,
    P_SINCE_NS,
    P_TOTAL_NS,
    PAUSE_KIND_CODES,
    PAUSE_WORDS,
    PAUSES_OFFSET,
    W_PAUSE_KIND,
)


def pause_entry(code: int) -> int:
    """Header word index of pause kind `code`'s entry."""
    return PAUSES_OFFSET // 8 + (code - 1) * PAUSE_WORDS


class Pauses:
    """This process's pauses, written through the recorder that `recorder_of` returns (None: no ring)."""

    def __init__(self, recorder_of: Callable[[], Any]) -> None:
        self._recorder_of = recorder_of
        self._lock = threading.Lock()
        self._depth = dict.fromkeys(PAUSE_KIND_CODES.values(), 0)
        self._since = dict.fromkeys(PAUSE_KIND_CODES.values(), 0)
        self._recorder: dict[int, Any] = {}
        self._in_progress: list[int] = []

    def begin(self, kind: str) -> int | None:
        """A pause of `kind` starts now; returns the token to pass to `end` (None: not marked)."""
        code = PAUSE_KIND_CODES[kind]
        recorder = self._recorder_of()
        if recorder is None:
            return None
        with self._lock:
            self._depth[code] += 1
            if self._depth[code] > 1:
                return code
            now = time.time_ns()
            self._since[code] = now
            self._recorder[code] = recorder
            self._in_progress.append(code)
            header = recorder.header
            header[pause_entry(code) + P_SINCE_NS] = now
            header[W_PAUSE_KIND] = code
        return code

    def end(self, token: int | None) -> None:
        """The pause that `begin` returned `token` for ends now (the outermost one of its kind counts)."""
        if token is None:
            return
        with self._lock:
            self._depth[token] -= 1
            if self._depth[token] > 0:
                return
            now = time.time_ns()
            since = self._since[token]
            self._in_progress.remove(token)
            recorder = self._recorder.pop(token)
            if recorder is not self._recorder_of():  # the ring was closed meanwhile
                return
            header = recorder.header
            entry = pause_entry(token)
            header[entry + P_SINCE_NS] = 0
            header[entry + P_ENDED] += 1
            header[entry + P_TOTAL_NS] += now - since
            header[W_PAUSE_KIND] = self._in_progress[-1] if self._in_progress else 0
            recorder.record_span(OP_PAUSE, token, header[entry + P_ENDED] - 1, since, now)

    def in_progress(self, kind: str) -> bool:
        """Whether a pause of `kind` is in progress."""
        return self._depth[PAUSE_KIND_CODES[kind]] > 0

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """A pause of `kind` for the duration of the with-block."""
        token = self.begin(kind)
        try:
            yield
        finally:
            self.end(token)
