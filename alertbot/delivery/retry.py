"""Stage 5, retry or dead-letter: record how an attempt ended; a transient failure is tried again after
an exponential backoff with jitter (at least what Feishu asked for), until attempts run out."""

from __future__ import annotations

import logging
import random

from megatrace.alertbot.config import DeliveryConfig
from megatrace.alertbot.feishu import SendResult
from megatrace.alertbot.kinds import OutboxState, Outcome
from megatrace.alertbot.metrics import BotMetrics
from megatrace.alertbot.store import Store
from megatrace.alertbot.store.records import Outbox

log = logging.getLogger(__name__)


def backoff(attempts: int, base: float, cap: float, retry_after: float | None, rng: random.Random) -> float:
    """Seconds to wait before the next attempt: exponential with jitter, at least what Feishu asked."""
    delay = min(cap, base * 2 ** max(0, attempts - 1))
    delay = delay / 2 + rng.uniform(0, delay / 2)
    if retry_after is not None:
        delay = max(delay, retry_after + rng.uniform(0, 0.5))
    return delay


def settle(
    store: Store,
    metrics: BotMetrics,
    config: DeliveryConfig,
    rng: random.Random,
    row: Outbox,
    attempt_id: int,
    result: SendResult,
    now: float,
) -> str | None:
    """Record the attempt's end; the message id when it was sent (else None)."""
    store.outbox.finish_attempt(attempt_id, now, result.outcome, result.detail)
    channel = row.channel
    if result.ok:
        message_id = str(result.data.get("message_id", ""))
        metrics.sent.labels(channel).inc()
        metrics.latency.labels(channel).observe(max(0.0, now - row.created_at))
        store.outbox.update(
            row.id, state=OutboxState.SENT, sent_at=now, message_id=message_id, last_error=None
        )
        return message_id
    metrics.failed.labels(channel).inc()
    if result.outcome == Outcome.RETRY and row.attempts < config.max_attempts:
        delay = backoff(row.attempts, config.backoff_base_s, config.backoff_max_s, result.retry_after, rng)
        store.outbox.update(
            row.id, state=OutboxState.PENDING, not_before=now + delay, last_error=result.detail
        )
        log.warning(
            "delivery %s via %s failed (%s); retrying in %.1fs", row.id, channel, result.detail, delay
        )
        return None
    store.outbox.update(row.id, state=OutboxState.DEAD, last_error=result.detail)
    metrics.dead.labels(channel).inc()
    log.error(
        "DEAD LETTER: %s notification %s via %s to level %s after %d attempts: %s",
        row.kind,
        row.id,
        channel,
        row.level,
        row.attempts,
        result.detail,
    )
    return None
