"""Per-destination rate limits (Feishu: 5/s and 100/min per group bot; app limits) as sliding windows,
so no window of that length ever holds more requests than allowed.

A request is counted from the moment its slot is taken, and `settle` moves it to the moment its reply
came back: Feishu counts a request when it arrives, which is somewhere in between, so a request
slowed on its way out (a loaded host) cannot squeeze one more into Feishu's window."""

from __future__ import annotations

import collections
import threading


class RateLimiter:
    """Named windows created on first use; `acquire` takes a slot in every window or in none."""

    def __init__(self) -> None:
        self._sent: dict[tuple[str, float], collections.deque[float]] = {}
        self._lock = threading.Lock()

    def acquire(self, limits: list[tuple[str, float, float]], now: float) -> float:
        """`limits` are (name, requests, per seconds). Returns 0 and records the request when every
        window has room, else the seconds until all would have (recording nothing)."""
        with self._lock:
            windows = []
            wait = 0.0
            for name, requests, per in limits:
                sent = self._sent.setdefault((name, per), collections.deque())
                while sent and sent[0] <= now - per:
                    sent.popleft()
                if len(sent) >= requests:
                    wait = max(wait, sent[len(sent) - int(requests)] + per - now)
                windows.append(sent)
            if wait > 0:
                return wait
            for sent in windows:
                sent.append(now)
            return 0.0

    def settle(self, limits: list[tuple[str, float, float]], taken: float, done: float) -> None:
        """Count the request whose slot was taken at `taken` as made at `done` (when it finished)."""
        with self._lock:
            for name, _requests, per in limits:
                sent = self._sent.get((name, per))
                if not sent:
                    continue
                for index in range(len(sent) - 1, -1, -1):
                    if sent[index] == taken:
                        sent[index] = max(done, taken)
                        break
                if any(a > b for a, b in zip(sent, list(sent)[1:], strict=False)):
                    ordered = sorted(sent)
                    sent.clear()
                    sent.extend(ordered)
