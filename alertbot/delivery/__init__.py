"""Delivery of queued notifications as a chain of small stages, as Alertmanager's notify pipeline:

    rate-limit → hold back → render → send → retry or dead-letter → after-send hooks

- rate-limit (`ratelimit`): a slot in every window the channel names, or the row waits;
- hold back (`hold`): a row that follows another (an update, a storm's resolve) waits for it;
- render (`render`): the neutral notification by a renderer chosen by kind, then the channel's
  message; frozen into the row by the claim that starts the attempt;
- send: the channel's `send` (or `update` of the card it follows);
- retry or dead-letter (`retry`): backoff with jitter, or given up;
- after-send hooks (`AFTER_SEND`): what follows a delivered message (the on-call module's page call).

The rate-limit stage runs before the transaction (a wait must not hold the database's write lock);
hold back, render and the claim run in one transaction (what a card shows and whether it is frozen
are decided together, see `Pipeline.incident_changed`); the send runs outside it.

Crash safety: an attempt is committed as started before its request leaves; after a crash each
channel says whether the send in doubt arrived, is re-sent, or is abandoned (`recover`; calls are
never dialed twice). The sheet archive is flushed in batches beside this chain (`flush_archive`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence

import requests

from megatrace.alertbot.cards import CardRenderer
from megatrace.alertbot.channels import CHANNELS, Channel, ConsoleSink, Context, Message
from megatrace.alertbot.channels.sheet import flush_archive
from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.delivery.hold import held_back
from megatrace.alertbot.delivery.render import RenderContext, render
from megatrace.alertbot.delivery.retry import settle
from megatrace.alertbot.feishu import FeishuApp, SendResult
from megatrace.alertbot.kinds import AfterCrash, OutboxState, Outcome
from megatrace.alertbot.metrics import BotMetrics
from megatrace.alertbot.oncall import page_after_sent
from megatrace.alertbot.ratelimit import Limiter, RateLimiter
from megatrace.alertbot.store import Store
from megatrace.alertbot.store.records import Outbox

__all__ = ["AFTER_SEND", "ConsoleSink", "Delivery"]

log = logging.getLogger(__name__)

# What runs after a message was delivered: (store, config, its row, its message id, now).
AfterSend = Callable[[Store, AlertbotConfig, Outbox, str, float], None]
AFTER_SEND: tuple[AfterSend, ...] = (page_after_sent,)


@dataclasses.dataclass
class Delivery:
    store: Store
    cfg: AlertbotConfig
    renderer: CardRenderer
    metrics: BotMetrics
    app: FeishuApp | None
    console: ConsoleSink
    limiter: Limiter = dataclasses.field(default_factory=RateLimiter)
    session: requests.Session = dataclasses.field(default_factory=requests.Session)
    rng: random.Random = dataclasses.field(default_factory=random.Random)
    owner: str = ""  # this replica, holding the lease of what it sends
    lease_s: float = 60.0

    @property
    def context(self) -> Context:
        return Context(self.cfg, self.store, self.app, self.console, self.session, self.renderer)

    @staticmethod
    def channel(row: Outbox) -> Channel:
        return CHANNELS[row.channel]

    def render(self, row: Outbox, now: float) -> Message | None:
        """The message for a queued row (None: nothing to send any more)."""
        return render(RenderContext(self.store, self.cfg, self.renderer), self.context, row, now)

    def send(self, row: Outbox, message: Message) -> SendResult:
        channel = self.channel(row)
        parent = self.store.outbox.get(row.parent_id) if row.is_update and row.parent_id is not None else None
        if parent is not None:
            return channel.update(self.context, row, parent, message)
        return channel.send(self.context, row, message)

    # -- the chain ------------------------------------------------------------------------------------

    def deliver_due(self, now: float | None = None, limit: int = 200, only: Sequence[int] = ()) -> int:
        """Attempt every due notification (or those of ids `only`) once; returns the number attempted."""
        attempted = 0
        for row in self.store.outbox.due(time.time() if now is None else now, limit, only):
            current = time.time() if now is None else now
            limits = self.channel(row).limits(self.cfg, row)
            wait = self.limiter.acquire(limits, current)
            if wait > 0:
                self.store.outbox.update(row.id, not_before=current + wait)
                continue
            self.attempt(row, current)
            self.limiter.settle(limits, current, time.time() if now is None else current)
            attempted += 1
        return attempted

    def attempt(self, row: Outbox, now: float) -> None:
        """One notification through hold back, render and the claim (one transaction), then send,
        retry or dead-letter, and the after-send hooks."""
        with self.store.transaction():
            if held_back(self.store, self.metrics, row, now):
                return
            try:
                message = self.render(row, now)
            except Exception as exc:  # a card that cannot be built must not stop the queue
                log.exception("cannot render notification %s", row.id)
                message, error = None, f"render failed: {exc}"
            else:
                error = "its alert no longer exists"
            if message is None:
                self.store.outbox.update(row.id, state=OutboxState.DEAD, last_error=error)
                self.metrics.dead.labels(row.channel).inc()
                return
            attempt_id = self.store.outbox.begin_attempt(row.id, now, message, self.owner, now + self.lease_s)
        if attempt_id is None:
            return
        result = self.send(row, message)
        claimed = self.store.outbox.get(row.id)
        if claimed is None:
            return
        done = time.time()
        message_id = settle(
            self.store, self.metrics, self.cfg.delivery, self.rng, claimed, attempt_id, result, done
        )
        if message_id is not None:
            for hook in AFTER_SEND:
                hook(self.store, self.cfg, claimed, message_id, done)

    # -- crash recovery -------------------------------------------------------------------------------

    def recover(self, now: float | None = None, expired_only: bool = False) -> int:
        """Resolve sends a crash left in doubt (with `expired_only`, those whose sender's lease ran
        out: another replica may still be sending the rest); returns how many were found."""
        unfinished = self.store.outbox.unfinished_sends(
            (time.time() if now is None else now) if expired_only else None
        )
        for sent in unfinished:
            row = sent.outbox
            outcome = self.channel(row).after_crash(self.context, sent)
            current = time.time() if now is None else now
            finish = self.store.outbox.finish_attempt
            if outcome == AfterCrash.ABANDON:
                finish(sent.attempt_id, current, Outcome.INTERRUPTED, "process stopped mid-call")
                self.store.outbox.update(
                    row.id, state=OutboxState.IN_DOUBT, last_error="call may have been placed"
                )
            elif outcome == AfterCrash.SENT:
                finish(sent.attempt_id, current, Outcome.SENT, "found in chat history after restart")
                self.store.outbox.update(row.id, state=OutboxState.SENT, sent_at=current)
                self.metrics.sent.labels(row.channel).inc()
            else:
                finish(sent.attempt_id, current, Outcome.INTERRUPTED, "process stopped mid-send")
                self.store.outbox.update(row.id, state=OutboxState.PENDING, not_before=current)
        return len(unfinished)

    # -- sheet archive --------------------------------------------------------------------------------

    def flush_archive(self) -> int:
        """Append pending archive rows to the Feishu sheet in batches; returns rows appended."""
        return flush_archive(self.context, self.metrics)
