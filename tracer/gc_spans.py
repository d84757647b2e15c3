"""Garbage collections of a rank: counted in the ring header, the long ones written as span records.

A `gc.callbacks` hook installed by the tracer runtime (no change to the training code): every
collection adds one to the header's count and its pause to the total (`format.HS_GC_COLLECTIONS`,
`HS_GC_NS`); one that lasted at least MEGATRACE_TRACE_GC_SPAN_MS is also written as a record (op
`format.OP_GC`: peer = the generation, seq = the collection's number on this rank from 0, nbytes =
the objects it collected). The callback runs in whichever thread the collection runs in.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from megatrace.tracer.format import HOST_SIGNALS_OFFSET, HS_GC_COLLECTIONS, HS_GC_NS, OP_GC

_COUNT = HOST_SIGNALS_OFFSET // 8 + HS_GC_COLLECTIONS
_TOTAL_NS = HOST_SIGNALS_OFFSET // 8 + HS_GC_NS


class GcSpans:
    """The hook: counts collections into the ring of the recorder that `recorder_of` returns (None: no
    ring yet, nothing counted) and writes spans of those lasting `span_ns` or more."""

    def __init__(self, recorder_of: Callable[[], Any], span_ns: int) -> None:
        self._recorder_of = recorder_of
        self.span_ns = span_ns
        self._start_ns = 0

    def install(self) -> None:
        """Start counting (once, however often called)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        """Stop counting."""
        while self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start_ns = time.time_ns()
            return
        start = self._start_ns
        recorder = self._recorder_of()
        if recorder is None or not start:
            return
        end = time.time_ns()
        took = end - start
        header = recorder.header
        number = header[_COUNT]
        header[_COUNT] = number + 1
        header[_TOTAL_NS] += took
        if took >= self.span_ns:
            recorder.record_span(OP_GC, info["generation"], number, start, end, info["collected"])
