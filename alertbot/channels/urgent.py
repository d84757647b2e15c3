"""Urgent calls about an app message: phone the people of an escalation step; when the paid quota is
exhausted fall back to SMS, then in-app. Never routed to directly (a page queues its call), and a call
a crash left in doubt is not dialed again: calls happen at most once per escalation step."""

from __future__ import annotations

import logging
from typing import Any

from megatrace.alertbot.channels.base import MINUTE, SECOND, Channel, Context, Window
from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.feishu import QUOTA_EXHAUSTED, SendResult

log = logging.getLogger(__name__)
URGENT_ORDER = ("urgent_phone", "urgent_sms", "urgent_app")


class UrgentChannel(Channel):
    name = "urgent"

    def limits(self, cfg: AlertbotConfig, row: Any) -> list[Window]:
        d = cfg.delivery
        return [("app", d.app_per_second, SECOND), ("app", d.app_per_minute, MINUTE)]

    def send(self, ctx: Context, row: Any, message: dict[str, Any]) -> SendResult:
        if ctx.app is None:
            return SendResult("fatal", "the Feishu app is not configured")
        users = list(message.get("users") or ctx.cfg.feishu.app.oncall)
        for kind in URGENT_ORDER:
            result = ctx.app.urgent(message["message_id"], kind, users)
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

    def after_crash(self, ctx: Context, row: Any) -> str:
        log.error("phone call %s was in flight when its replica stopped; not dialed again", row["id"])
        return "abandon"
