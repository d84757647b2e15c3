"""lark-oapi's websocket client (long-connection mode) made to hold against a peer that sends what it
should not: a client configuration that would stop it (never reconnect, reconnect after years, ping
without pause, a value that is no number), a message in parts past their whole or of an absurd
number of parts, and a connection lost for good. Every such frame costs only itself, with one log
line; the client keeps reconnecting, every `reconnect_interval` at most, for as long as the bot runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from typing import Any

import lark_oapi

log = logging.getLogger(__name__)

MAX_PARTS = 64  # a callback is a few KiB; Feishu splits large messages into a handful of parts
# (smallest, largest) seconds a peer may set, and the seconds used where it sends no number
PING_INTERVAL_S = (5.0, 600.0)
RECONNECT_INTERVAL_S = (1.0, 120.0)
RECONNECT_NONCE_S = (0.0, 30.0)


def bounded(value: Any, limits: tuple[float, float], current: float) -> float:
    """`value` as seconds within `limits`; `current` when it is no finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return current
    low, high = limits
    return min(high, max(low, float(value)))


class GuardedClient(lark_oapi.ws.Client):
    """`lark_oapi.ws.Client` with the peer's settings bounded, message parts checked, and reconnection
    that never gives up."""

    _reconnect_interval: float
    _reconnect_nonce: float
    _ping_interval: float

    def _configure(self, conf: Any) -> None:
        self._reconnect_count = -1  # for ever: a bot that stops listening misses every card action
        self._reconnect_interval = bounded(
            getattr(conf, "ReconnectInterval", None), RECONNECT_INTERVAL_S, self._reconnect_interval
        )
        self._reconnect_nonce = bounded(
            getattr(conf, "ReconnectNonce", None), RECONNECT_NONCE_S, self._reconnect_nonce
        )
        self._ping_interval = bounded(
            getattr(conf, "PingInterval", None), PING_INTERVAL_S, self._ping_interval
        )

    def _combine(self, msg_id: str, sum_: int, seq: int, bs: bytes) -> bytes | None:
        if not 1 < sum_ <= MAX_PARTS or not 0 <= seq < sum_:
            log.warning(
                "Feishu long connection: dropped part %d of %d of message %.64r (at most %d parts)",
                seq,
                sum_,
                msg_id,
                MAX_PARTS,
            )
            return None
        return super()._combine(msg_id, sum_, seq, bs)

    async def _reconnect(self) -> None:
        """Connect again, every reconnect interval, until it works (the SDK gives up after the count
        its peer sets, or at the first refusal of the app's credentials)."""
        await asyncio.sleep(random.random() * self._reconnect_nonce)  # jitter, as the SDK does
        while True:
            try:
                await self._connect()
                return
            except Exception as exc:
                log.warning(
                    "Feishu long connection: reconnecting failed (%s); trying again in %gs",
                    str(exc)[:200],
                    self._reconnect_interval,
                )
            await asyncio.sleep(self._reconnect_interval)
