"""Delivery of queued notifications: rate-limit → render (frozen on first attempt) → send → retry with
backoff and jitter, or dead-letter. Also recovery of sends a crash left in doubt, and the sheet
archive flush. How each channel sends, updates, limits and recovers is its module's business
(`megatrace.alertbot.channels`); this loop only goes through `CHANNELS`.

Crash safety: an attempt is committed as started before its request leaves; after a crash each
channel says whether the send in doubt arrived, is re-sent, or is abandoned (calls are never
dialed twice). An update of a sent card (a verdict, a resolve, an on-call action) waits for that
card, and is dropped when the card was never sent.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import requests

from megatrace.alertbot.actions import oncall_context
from megatrace.alertbot.cards import CardRenderer, placement_text
from megatrace.alertbot.channels import CHANNELS, Channel, ConsoleSink, Context
from megatrace.alertbot.channels.sheet import flush_archive
from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.feishu import FeishuApp, SendResult
from megatrace.alertbot.incident import load as load_incident
from megatrace.alertbot.metrics import BotMetrics
from megatrace.alertbot.oncall import first_call
from megatrace.alertbot.ratelimit import Limiter, RateLimiter
from megatrace.alertbot.store import OPEN_STATES, Store

log = logging.getLogger(__name__)

PHONED_KINDS = ("firing", "storm")
NEVER_PHONED = ("P3",)
UPDATE_KINDS = ("card-update", "verdict", "resolved")


def is_update(row: Any) -> bool:
    """Whether `row` shows a new state of a card sent before (its `parent_id`) rather than a message."""
    return row["parent_id"] is not None and row["kind"] in UPDATE_KINDS


def backoff(attempts: int, base: float, cap: float, retry_after: float | None, rng: random.Random) -> float:
    """Seconds to wait before the next attempt: exponential with jitter, at least what Feishu asked."""
    delay = min(cap, base * 2 ** max(0, attempts - 1))
    delay = delay / 2 + rng.uniform(0, delay / 2)
    if retry_after is not None:
        delay = max(delay, retry_after + rng.uniform(0, 0.5))
    return delay


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
        return Context(self.cfg, self.store, self.app, self.console, self.session)

    @staticmethod
    def channel(row: Any) -> Channel:
        return CHANNELS[row["channel"]]

    # -- what to send -------------------------------------------------------------------------------

    def render(self, row: Any, now: float) -> dict[str, Any] | None:
        """The message for a queued row (None: nothing to send any more)."""
        if row["payload"]:
            return json.loads(row["payload"])
        kind, channel = row["kind"], self.channel(row)
        if kind == "storm":
            self.store.seal_storm(row["storm_id"], now)
            members = self.store.storm_members(row["storm_id"])
            storm = self.store.storm(row["storm_id"])
            return channel.render(
                self.renderer.storm_card(storm, members, self.cfg.dedupe.storm_window_s, row["idem_key"])
            )
        if kind == "storm-resolved":
            storm = self.store.storm(row["storm_id"])
            if storm is None:
                return None
            members = self.store.storm_members(row["storm_id"])
            return channel.render(self.renderer.storm_resolved_card(storm, members, row["idem_key"], now))
        episode = self.store.episode(row["episode_id"])
        if episode is None:
            return None
        incident = (
            load_incident(self.store, episode["incident_id"], placement_text)
            if episode["incident_id"] is not None
            else None
        )
        if incident is not None:  # the page as it was, or the incident's card in its current state
            firing = kind in ("firing", "repeat") or not incident.closed
            shown = kind if kind in ("firing", "repeat") else "firing" if firing else "resolved"
        else:
            firing = episode["status"] == "firing"
            shown = "firing" if kind == "card-update" else kind
        acting = self.cfg.feishu.callback.mode and channel.name == "app"
        oncall = oncall_context(self.store, self.renderer, episode, now) if acting and firing else None
        ref = row["idem_key"]
        if is_update(row):  # the card's own ref where it is replaced; a reply's own, naming the card's
            card_ref = self.store.outbox_row(row["parent_id"])["idem_key"]
            ref = card_ref if channel.edits else f"{ref} (follows {card_ref})"
            if not channel.edits and shown == "firing":
                shown = "verdict"  # a reply: its title says it follows up, not that something new fires
        card = self.renderer.alert_card(
            episode, shown, ref, self.cfg.dedupe.flap_hold_s, now, oncall, incident
        )
        return channel.render(card)

    def send(self, row: Any, message: dict[str, Any]) -> SendResult:
        channel = self.channel(row)
        if is_update(row):
            return channel.update(self.context, row, self.store.outbox_row(row["parent_id"]), message)
        return channel.send(self.context, row, message)

    # -- the loop -------------------------------------------------------------------------------------

    def deliver_due(self, now: float | None = None, limit: int = 200, only: Sequence[int] = ()) -> int:
        """Attempt every due notification (or those of ids `only`) once; returns the number attempted."""
        attempted = 0
        for row in self.store.due_outbox(time.time() if now is None else now, limit, only):
            current = time.time() if now is None else now
            limits = self.channel(row).limits(self.cfg, row)
            wait = self.limiter.acquire(limits, current)
            if wait > 0:
                self.store.set_outbox(row["id"], not_before=current + wait)
                continue
            self.attempt(row, current)
            self.limiter.settle(limits, current, time.time() if now is None else current)
            attempted += 1
        return attempted

    def held_back(self, row: Any, now: float) -> bool:
        """Whether `row` must not go out now: deferred until what it follows went out, or dropped."""
        if row["payload"] is not None:
            return False
        if row["kind"] == "storm-resolved":
            storm = self.store.storm(row["storm_id"])
            if storm is not None and storm["sealed_at"] is None:  # its firing summary goes first
                self.store.set_outbox(row["id"], not_before=now + 1.0)
                return True
        if row["kind"] == "firing":
            episode = self.store.episode(row["episode_id"])
            if episode is not None and episode["status"] == "resolved" and episode["flapping"]:
                self.store.set_outbox(row["id"], state="suppressed", last_error="resolved while held back")
                self.metrics.suppressed.inc()
                return True
        if is_update(row):
            parent = self.store.outbox_row(row["parent_id"])
            if parent is not None and parent["state"] in OPEN_STATES:  # the card goes first
                self.store.set_outbox(row["id"], not_before=now + 1.0)
                return True
            if parent is None or parent["state"] != "sent":
                self.store.set_outbox(row["id"], state="suppressed", last_error="its card was never sent")
                self.metrics.suppressed.inc()
                return True
        return False

    def attempt(self, row: Any, now: float) -> None:
        """Render and claim in one transaction (what the card shows and whether it is frozen are
        decided together: see `Pipeline.incident_changed`), then send outside it."""
        with self.store.transaction():
            if self.held_back(row, now):
                return
            try:
                message = self.render(row, now)
            except Exception as exc:  # a card that cannot be built must not stop the queue
                log.exception("cannot render notification %s", row["id"])
                message, error = None, f"render failed: {exc}"
            else:
                error = "its alert no longer exists"
            if message is None:
                self.store.set_outbox(row["id"], state="dead", last_error=error)
                self.metrics.dead.labels(row["channel"]).inc()
                return
            attempt_id = self.store.begin_attempt(row["id"], now, message, self.owner, now + self.lease_s)
        if attempt_id is None:
            return
        result = self.send(row, message)
        self.finish(self.store.outbox_row(row["id"]), attempt_id, result, time.time())

    def finish(self, row: Any, attempt_id: int, result: SendResult, now: float) -> None:
        channel = row["channel"]
        self.store.finish_attempt(attempt_id, now, result.outcome, result.detail)
        if result.ok:
            message_id = str(result.data.get("message_id", ""))
            self.metrics.sent.labels(channel).inc()
            self.metrics.latency.labels(channel).observe(max(0.0, now - row["created_at"]))
            self.store.set_outbox(
                row["id"], state="sent", sent_at=now, message_id=message_id, last_error=None
            )
            self.after_sent(row, message_id, now)
            return
        self.metrics.failed.labels(channel).inc()
        if result.outcome == "retry" and row["attempts"] < self.cfg.delivery.max_attempts:
            d = self.cfg.delivery
            delay = backoff(row["attempts"], d.backoff_base_s, d.backoff_max_s, result.retry_after, self.rng)
            self.store.set_outbox(
                row["id"], state="pending", not_before=now + delay, last_error=result.detail
            )
            log.warning(
                "delivery %s via %s failed (%s); retrying in %.1fs", row["id"], channel, result.detail, delay
            )
            return
        self.store.set_outbox(row["id"], state="dead", last_error=result.detail)
        self.metrics.dead.labels(channel).inc()
        log.error(
            "DEAD LETTER: %s notification %s via %s to level %s after %d attempts: %s",
            row["kind"],
            row["id"],
            channel,
            row["level"],
            row["attempts"],
            result.detail,
        )

    def after_sent(self, row: Any, message_id: str, now: float) -> None:
        """A page sent through a channel that phones gets the on-call people phoned about it
        (escalation step 0, recorded before the call is queued). P3 is never phoned."""
        if not self.channel(row).phones or row["kind"] not in PHONED_KINDS or not message_id:
            return
        if row["level"] in NEVER_PHONED:
            return
        users = first_call(self.cfg, row["level"], now)
        if row["level"] not in self.cfg.feishu.app.phone_levels or not users:
            return
        with self.store.transaction():
            episode = row["episode_id"]
            if episode is not None and not self.store.add_escalation(episode, 0, message_id, users, now):
                return
            self.store.enqueue(
                {
                    "kind": "urgent",
                    "parent_id": row["id"],
                    "episode_id": episode,
                    "storm_id": row["storm_id"],
                    "channel": "urgent",
                    "destination": "oncall",
                    "level": row["level"],
                    "idem_key": f"{row['idem_key']}-urgent",
                    "created_at": now,
                    "not_before": now,
                    "payload": json.dumps({"message_id": message_id, "users": users}),
                }
            )

    # -- crash recovery -------------------------------------------------------------------------------

    def recover(self, now: float | None = None, expired_only: bool = False) -> int:
        """Resolve sends a crash left in doubt (with `expired_only`, those whose sender's lease ran
        out: another replica may still be sending the rest); returns how many were found."""
        rows = (
            self.store.in_doubt(time.time() if now is None else now)
            if expired_only
            else self.store.in_doubt()
        )
        for row in rows:
            outcome = self.channel(row).after_crash(self.context, row)
            current = time.time() if now is None else now
            if outcome == "abandon":
                self.store.finish_attempt(
                    row["attempt_id"], current, "interrupted", "process stopped mid-call"
                )
                self.store.set_outbox(row["id"], state="in-doubt", last_error="call may have been placed")
            elif outcome == "sent":
                self.store.finish_attempt(
                    row["attempt_id"], current, "sent", "found in chat history after restart"
                )
                self.store.set_outbox(row["id"], state="sent", sent_at=current)
                self.metrics.sent.labels(row["channel"]).inc()
            else:
                self.store.finish_attempt(
                    row["attempt_id"], current, "interrupted", "process stopped mid-send"
                )
                self.store.set_outbox(row["id"], state="pending", not_before=current)
        return len(rows)

    # -- sheet archive --------------------------------------------------------------------------------

    def flush_archive(self) -> int:
        """Append pending archive rows to the Feishu sheet in batches; returns rows appended."""
        return flush_archive(self.context, self.metrics)
