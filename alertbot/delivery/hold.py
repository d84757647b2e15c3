"""Stage 1, hold back: whether a due notification must wait for what it follows, or is dropped."""

from __future__ import annotations

from megatrace.alertbot.kinds import OPEN_STATES, EpisodeStatus, NotificationKind, OutboxState
from megatrace.alertbot.metrics import BotMetrics
from megatrace.alertbot.store import Store
from megatrace.alertbot.store.records import Outbox

# How long a notification waits before it is looked at again, while what it follows is not out.
RECHECK_S = 1.0


def held_back(store: Store, metrics: BotMetrics, row: Outbox, now: float) -> bool:
    """Whether `row` must not go out now: deferred until what it follows went out (a storm's resolved
    summary after its firing one, a card's update after the card), or suppressed (a held-back
    flapping alert that resolved, an update of a card never sent). A frozen row always goes."""
    if row.payload is not None:
        return False
    if row.kind == NotificationKind.STORM_RESOLVED and row.storm_id is not None:
        storm = store.episodes.storm(row.storm_id)
        if storm is not None and storm.sealed_at is None:  # its firing summary goes first
            store.outbox.update(row.id, not_before=now + RECHECK_S)
            return True
    if row.kind == NotificationKind.FIRING and row.episode_id is not None:
        episode = store.episodes.get(row.episode_id)
        if episode is not None and episode.status == EpisodeStatus.RESOLVED and episode.flapping:
            return _suppress(store, metrics, row, "resolved while held back")
    if row.is_update and row.parent_id is not None:
        parent = store.outbox.get(row.parent_id)
        if parent is not None and parent.state in OPEN_STATES:  # the card goes first
            store.outbox.update(row.id, not_before=now + RECHECK_S)
            return True
        if parent is None or parent.state != OutboxState.SENT:
            return _suppress(store, metrics, row, "its card was never sent")
    return False


def _suppress(store: Store, metrics: BotMetrics, row: Outbox, why: str) -> bool:
    store.outbox.update(row.id, state=OutboxState.SUPPRESSED, last_error=why)
    metrics.suppressed.inc()
    return True
