"""A one-line progress bar on stderr for long loads (silent when disabled or not a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts work units and redraws at most ten times a second."""

    def __init__(self, total: int, label: str, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._last = 0.0
        self._drawn = False

    def advance(self, units: int = 1) -> None:
        self.done += units
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            self._draw()

    def _draw(self) -> None:
        frac = min(self.done / self.total, 1.0)
        width = 30
        bar = "#" * int(frac * width)
        self.stream.write(f"\r{self.label} [{bar:<{width}}] {frac:4.0%} ({self.done}/{self.total})")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
