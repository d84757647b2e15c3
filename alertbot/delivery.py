"""Delivery of queued notifications: rate-limit → render (frozen on first attempt) → send → retry with
backoff and jitter, or dead-letter. Also the sheet archive flush and recovery of sends a crash left
in doubt.

Crash safety: an attempt is committed as started before its request leaves. On restart, app
messages are simply re-sent (Feishu drops a repeated `uuid`); group-bot posts are looked up in the
chat's history through the app when the bot's `chat_id` is known, and re-sent only when absent.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import requests

from megatrace.alertbot.actions import oncall_context
from megatrace.alertbot.cards import CardRenderer
from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.feishu import QUOTA_EXHAUSTED, FeishuApp, SendResult, post_group_bot
from megatrace.alertbot.metrics import BotMetrics
from megatrace.alertbot.oncall import first_call
from megatrace.alertbot.ratelimit import RateLimiter
from megatrace.alertbot.store import Store

log = logging.getLogger(__name__)

URGENT_ORDER = ("urgent_phone", "urgent_sms", "urgent_app")
PHONED_KINDS = ("firing", "storm")
SECOND, MINUTE = 1.25, 61.0
REF = re.compile(r"megatrace ref [\w-]+")


class ConsoleSink:
    """Writes each message as one JSON line (what would be sent, to whom) to a file or stdout."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, sort_keys=True)
        with self._lock:
            if self.path in ("", "-"):
                self._emit(sys.stdout, line)
            else:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as handle:
                    self._emit(handle, line)

    @staticmethod
    def _emit(stream: TextIO, line: str) -> None:
        stream.write(line + "\n")
        stream.flush()


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
    limiter: RateLimiter = dataclasses.field(default_factory=RateLimiter)
    session: requests.Session = dataclasses.field(default_factory=requests.Session)
    rng: random.Random = dataclasses.field(default_factory=random.Random)
    owner: str = ""  # this replica, holding the lease of what it sends
    lease_s: float = 60.0

    # -- what to send -------------------------------------------------------------------------------

    def limits(self, row: Any) -> list[tuple[str, float, float]]:
        """Sliding windows for a row's destination, padded (SECOND, MINUTE) so that network jitter
        cannot make Feishu count more requests in its window than it allows."""
        d = self.cfg.delivery
        if row["channel"] == "bot":
            name = f"bot:{row['destination']}"
            return [(name, d.bot_per_second, SECOND), (name, d.bot_per_minute, MINUTE)]
        if row["channel"] in ("app", "urgent", "app-update"):
            limits = [("app", d.app_per_second, SECOND), ("app", d.app_per_minute, MINUTE)]
            if row["channel"] == "app":
                limits.append((f"chat:{row['destination']}", d.chat_per_second, SECOND))
            return limits
        return []

    def render(self, row: Any, now: float) -> dict[str, Any] | None:
        """The message for a queued row (None: nothing to send any more)."""
        if row["payload"]:
            return json.loads(row["payload"])
        kind = row["kind"]
        if kind == "storm":
            self.store.seal_storm(row["storm_id"], now)
            members = self.store.storm_members(row["storm_id"])
            storm = self.store.storm(row["storm_id"])
            card = self.renderer.storm_card(storm, members, self.cfg.dedupe.storm_window_s, row["idem_key"])
            return {"msg_type": "interactive", "card": card}
        if kind == "storm-resolved":
            storm = self.store.storm(row["storm_id"])
            if storm is None:
                return None
            members = self.store.storm_members(row["storm_id"])
            return {
                "msg_type": "interactive",
                "card": self.renderer.storm_resolved_card(storm, members, row["idem_key"], now),
            }
        episode = self.store.episode(row["episode_id"])
        if episode is None:
            return None
        acting = self.cfg.feishu.callback.mode and row["channel"] in ("app", "app-update")
        oncall = (
            oncall_context(self.store, self.renderer, episode, now)
            if acting and episode["status"] == "firing"
            else None
        )
        shown = "firing" if kind == "card-update" else kind
        card = self.renderer.alert_card(
            episode, shown, row["idem_key"], self.cfg.dedupe.flap_hold_s, now, oncall
        )
        return {"msg_type": "interactive", "card": card}

    # -- how to send it -----------------------------------------------------------------------------

    def send(self, row: Any, message: dict[str, Any]) -> SendResult:
        channel = row["channel"]
        if channel == "console":
            self.console.write({"channel": "console", "level": row["level"], "kind": row["kind"], **message})
            return SendResult("sent", "written to console")
        if channel == "bot":
            bot = self.cfg.feishu.group_bots[row["destination"]]
            return post_group_bot(self.session, bot.webhook, bot.secret, message, self.cfg.feishu.timeout_s)
        if self.app is None:
            return SendResult("fatal", "the Feishu app is not configured")
        if channel == "urgent":
            return self.urgent(message)
        if channel == "app-update":
            return self.app.update_message(row["destination"], message["card"])
        if message["msg_type"] == "file":
            return self.send_file(row, message)
        result = self.app.send_message(
            row["destination"], message["msg_type"], message["card"], row["idem_key"]
        )
        if result.ok and not result.data.get("message_id"):
            return SendResult("fatal", "Feishu answered without data.message_id")
        return result

    def send_file(self, row: Any, message: dict[str, Any]) -> SendResult:
        """Weekly report: upload the workbook once, then post it as a file message."""
        assert self.app is not None
        if not message.get("file_key"):
            uploaded = self.app.upload_file(Path(message["path"]))
            if not uploaded.ok:
                return uploaded
            message["file_key"] = uploaded.data.get("file_key", "")
            self.store.set_outbox(row["id"], payload=json.dumps(message, ensure_ascii=False))
        return self.app.send_message(
            row["destination"], "file", {"file_key": message["file_key"]}, row["idem_key"]
        )

    def urgent(self, message: dict[str, Any]) -> SendResult:
        """Phone the people of this escalation step; when the paid quota is exhausted fall back to
        SMS, then in-app."""
        assert self.app is not None
        users = list(message.get("users") or self.cfg.feishu.app.oncall)
        for kind in URGENT_ORDER:
            result = self.app.urgent(message["message_id"], kind, users)
            if result.code == QUOTA_EXHAUSTED:
                log.warning("Feishu %s quota exhausted; falling back", kind)
                continue
            if result.ok:
                invalid = result.data.get("invalid_user_id_list") or []
                if invalid:
                    log.error("Feishu did not %s these on-call users (invalid ids): %s", kind, invalid)
                reached = len(users) - len(invalid)
                detail = f"{kind}: {reached} of {len(users)} reached; invalid {invalid}"
                if not reached:
                    return SendResult("fatal", detail)
                return SendResult("sent", detail, data={"method": kind, "invalid": invalid})
            return result
        return SendResult("fatal", "phone, SMS and in-app urgent quota all exhausted")

    # -- the loop -------------------------------------------------------------------------------------

    def deliver_due(self, now: float | None = None, limit: int = 200, only: Sequence[int] = ()) -> int:
        """Attempt every due notification (or those of ids `only`) once; returns the number attempted."""
        attempted = 0
        for row in self.store.due_outbox(time.time() if now is None else now, limit, only):
            current = time.time() if now is None else now
            limits = self.limits(row)
            wait = self.limiter.acquire(limits, current)
            if wait > 0:
                self.store.set_outbox(row["id"], not_before=current + wait)
                continue
            self.attempt(row, current)
            self.limiter.settle(limits, current, time.time() if now is None else current)
            attempted += 1
        return attempted

    def attempt(self, row: Any, now: float) -> None:
        if row["kind"] == "storm-resolved" and row["payload"] is None:
            storm = self.store.storm(row["storm_id"])
            if storm is not None and storm["sealed_at"] is None:  # its firing summary goes first
                self.store.set_outbox(row["id"], not_before=now + 1.0)
                return
        if row["kind"] == "firing" and row["payload"] is None:
            episode = self.store.episode(row["episode_id"])
            if episode is not None and episode["status"] == "resolved" and episode["flapping"]:
                self.store.set_outbox(row["id"], state="suppressed", last_error="resolved while held back")
                self.metrics.suppressed.inc()
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
        """A page sent through the app gets the on-call people phoned about it (escalation step 0,
        recorded before the call is queued)."""
        if row["channel"] != "app" or row["kind"] not in PHONED_KINDS or not message_id:
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

    def posted_already(self, row: Any) -> bool:
        """Whether a group-bot post left in doubt is in its chat (looked up through the app)."""
        bot = self.cfg.feishu.group_bots.get(row["destination"])
        if row["channel"] != "bot" or bot is None or not bot.chat_id or self.app is None:
            return False
        result = self.app.chat_messages(bot.chat_id, row["attempt_started"] - 60)
        if not result.ok:
            log.warning("cannot check chat history for in-doubt delivery %s: %s", row["id"], result.detail)
            return False
        found = REF.search(row["payload"] or "")
        ref = found.group(0) if found else row["idem_key"]
        return any(ref in json.dumps(item, ensure_ascii=False) for item in result.data.get("items", []))

    def recover(self, now: float | None = None, expired_only: bool = False) -> int:
        """Resolve sends a crash left in doubt (with `expired_only`, those whose sender's lease ran
        out: another replica may still be sending the rest); returns how many were found. A phone
        call in doubt is not dialed again: calls happen at most once per escalation step."""
        rows = (
            self.store.in_doubt(time.time() if now is None else now)
            if expired_only
            else self.store.in_doubt()
        )
        for row in rows:
            current = time.time() if now is None else now
            if row["channel"] == "urgent":
                self.store.finish_attempt(
                    row["attempt_id"], current, "interrupted", "process stopped mid-call"
                )
                self.store.set_outbox(row["id"], state="in-doubt", last_error="call may have been placed")
                log.error("phone call %s was in flight when its replica stopped; not dialed again", row["id"])
                continue
            if self.posted_already(row):
                self.store.finish_attempt(
                    row["attempt_id"], current, "sent", "found in chat history after restart"
                )
                self.store.set_outbox(row["id"], state="sent", sent_at=current)
                self.metrics.sent.labels(row["channel"]).inc()
                continue
            if row["channel"] == "bot" and not self.cfg.feishu.group_bots[row["destination"]].chat_id:
                log.warning(
                    "delivery %s was in flight when the bot stopped; re-sending (may repeat)", row["id"]
                )
            self.store.finish_attempt(row["attempt_id"], current, "interrupted", "process stopped mid-send")
            self.store.set_outbox(row["id"], state="pending", not_before=current)
        return len(rows)

    # -- sheet archive --------------------------------------------------------------------------------

    def flush_archive(self) -> int:
        """Append pending archive rows to the Feishu sheet in batches; returns rows appended."""
        sheet = self.cfg.feishu.sheet
        if not sheet.spreadsheet_token or self.app is None:
            return 0
        appended = 0
        while rows := self.store.pending_archive(sheet.batch_size):
            ids = [r["id"] for r in rows]
            self.store.set_archive(ids, "sending")
            result = self.app.append_rows(
                sheet.spreadsheet_token, sheet.sheet_id, [json.loads(r["row"]) for r in rows]
            )
            if not result.ok:
                state = "pending" if result.outcome == "retry" else "dead"
                self.store.set_archive(ids, state, result.detail)
                log.error("sheet archive of %d rows failed (%s): %s", len(ids), state, result.detail)
                return appended
            self.store.set_archive(ids, "sent")
            self.metrics.archived.inc(len(ids))
            appended += len(ids)
        return appended
