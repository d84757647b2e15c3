"""Urgent calls about an app message: phone the people of an escalation step; when the paid quota is
exhausted fall back to SMS, then in-app. Never routed to directly (a page queues its call through
`megatrace.alertbot.oncall`), and a call a crash left in doubt is not dialed again: calls happen at
most once per escalation step."""

from __future__ import annotations

import logging

from megatrace.alertbot.channels.base import MINUTE, SECOND, Channel, Context, Message, Window
from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.feishu import QUOTA_EXHAUSTED, SendResult
from megatrace.alertbot.kinds import AfterCrash, Outcome
from megatrace.alertbot.store.records import Outbox, UnfinishedSend

log = logging.getLogger(__name__)
URGENT_ORDER = ("urgent_phone", "urgent_sms", "urgent_app")


class UrgentChannel(Channel):
    name = "urgent"
    places_calls = True

    def limits(self, cfg: AlertbotConfig, row: Outbox) -> list[Window]:
        d = cfg.delivery
        return [("app", d.app_per_second, SECOND), ("app", d.app_per_minute, MINUTE)]

    def send(self, ctx: Context, row: Outbox, message: Message) -> SendResult:
        if ctx.app is None:
            return SendResult(Outcome.FATAL, "the Feishu app is not configured")
        listed = message.get("users")
        users = (
            [str(u) for u in listed]
            if isinstance(listed, list) and listed
            else list(ctx.cfg.feishu.app.oncall)
        )
        for kind in URGENT_ORDER:
            result = ctx.app.urgent(str(message["message_id"]), kind, users)
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
                    return SendResult(Outcome.FATAL, detail)
                return SendResult(Outcome.SENT, detail, data={"method": kind, "invalid": invalid})
            return result
        return SendResult(Outcome.FATAL, "phone, SMS and in-app urgent quota all exhausted")

    def after_crash(self, ctx: Context, sent: UnfinishedSend) -> AfterCrash:
        log.error("phone call %s was in flight when its replica stopped; not dialed again", sent.outbox.id)
        return AfterCrash.ABANDON
