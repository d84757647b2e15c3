"""Fault injection for tests and demos: make one rank really hang, or really run slower.

A hang blocks the training thread forever just before a collective, so the other ranks block inside
it for real. A slow rank sleeps, before each collective, the given percentage of the time it spent
since its previous collective, so everything it does takes that much longer.
"""

from __future__ import annotations

import sys
import threading
import time

from megatrace.tracer.settings import FaultSettings


def hang_forever(reason: str) -> None:
    """Block the calling thread for good (the process stays alive until killed)."""
    print(f"megatrace fault injection: {reason}; hanging", file=sys.stderr, flush=True)
    forever = threading.Event()
    while True:
        forever.wait(3600)


class FaultPlan:
    """The faults that apply to one rank; `before_call` runs before each of its traced collectives."""

    def __init__(self, settings: FaultSettings, rank: int) -> None:
        hangs = settings.hang_rank == rank
        self.hang_at_call = settings.hang_at_call if hangs else 0
        self.hang_at_step = settings.hang_at_step if hangs else -1
        self.slow_fraction = settings.slow_pct / 100.0 if settings.slow_rank == rank else 0.0
        self.previous_ns = 0

    @property
    def active(self) -> bool:
        return bool(self.hang_at_call or self.hang_at_step >= 0 or self.slow_fraction)

    def before_call(self, call_number: int, step: int) -> None:
        """Apply the faults before this rank's `call_number`-th collective (1-based) in step `step`."""
        if self.hang_at_call and call_number >= self.hang_at_call:
            hang_forever(f"hang before collective {call_number}")
        if self.hang_at_step >= 0 and step >= self.hang_at_step:
            hang_forever(f"hang after step {step}, before collective {call_number}")
        if self.slow_fraction:
            now = time.monotonic_ns()
            if self.previous_ns:
                time.sleep(self.slow_fraction * (now - self.previous_ns) / 1e9)
            self.previous_ns = time.monotonic_ns()
