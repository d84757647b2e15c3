"""Per-destination rate limits (Feishu: 5/s and 100/min per group bot; app limits) as sliding windows,
so no window of that length ever holds more requests than allowed. `RateLimiter` keeps them in the
process; `SharedRateLimiter` keeps them in the database, so that replicas sharing one (PostgreSQL)
stay together under Feishu's limits (which count per chat and per app, not per replica).

A request is counted from the moment its slot is taken, and `settle` moves it to the moment its reply
came back: Feishu counts a request when it arrives, which is somewhere in between, so a request
slowed on its way out (a loaded host) cannot squeeze one more into Feishu's window."""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Protocol

from megatrace.alertbot.store import Store
from megatrace.alertbot.store.coordination import Window


class Limiter(Protocol):
    def acquire(self, limits: Sequence[Window], now: float) -> float: ...

    def settle(self, limits: Sequence[Window], taken: float, done: float) -> None: ...


class RateLimiter:
    """Named windows created on first use; `acquire` takes a slot in every window or in none."""

    def __init__(self) -> None:
        self._sent: dict[tuple[str, float], collections.deque[float]] = {}
        self._lock = threading.Lock()

    def acquire(self, limits: Sequence[Window], now: float) -> float:
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

    def settle(self, limits: Sequence[Window], taken: float, done: float) -> None:
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


class SharedRateLimiter:
    """`RateLimiter`'s windows as rows of the shared database (`Store.take_rate_slots`): a slot is
    taken under the store's write lock, so two replicas cannot both take the last one. Replicas'
    clocks must agree to well under a second (NTP), as the windows compare their times."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._taken: dict[tuple[float, tuple[Window, ...]], list[int]] = {}
        self._lock = threading.Lock()

    def acquire(self, limits: Sequence[Window], now: float) -> float:
        wait, ids = self.store.coordination.take_rate_slots(limits, now)
        if ids:
            with self._lock:
                self._taken[(now, tuple(limits))] = ids
        return wait

    def settle(self, limits: Sequence[Window], taken: float, done: float) -> None:
        with self._lock:
            ids = self._taken.pop((taken, tuple(limits)), [])
        self.store.coordination.settle_rate_slots(ids, max(done, taken))
