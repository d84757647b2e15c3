"""A channel as a user adds one: a generic JSON webhook with its own settings, in this one file.

It posts the neutral notification (title, facts, culprit, links) as JSON to a configured URL, for the
configured levels, signing each body with the configured secret (``X-Megatrace-Signature``, HMAC-SHA256
in hex). Registering it is one row in ``megatrace.alertbot.channels.CHANNELS``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json

import requests

from megatrace.alertbot.channels import Channel, Context, Message
from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.feishu import SendResult
from megatrace.alertbot.kinds import Outcome
from megatrace.alertbot.store.records import Outbox


@dataclasses.dataclass
class WebhookSettings:
    """``channels.webhook`` in the bot's configuration."""

    url: str = ""
    levels: list[str] = dataclasses.field(default_factory=list)
    secret: str = dataclasses.field(default="", metadata={"secret": True})
    timeout_s: float = 5.0


class WebhookChannel(Channel):
    name = "webhook"
    settings = WebhookSettings

    @staticmethod
    def configured(cfg: AlertbotConfig) -> WebhookSettings:
        found = cfg.channels.get("webhook")
        return found if isinstance(found, WebhookSettings) else WebhookSettings()

    def destinations(self, cfg: AlertbotConfig, level: str) -> list[str]:
        settings = self.configured(cfg)
        return [settings.url] if settings.url and level in settings.levels else []

    def send(self, ctx: Context, row: Outbox, message: Message) -> SendResult:
        settings = self.configured(ctx.cfg)
        body = json.dumps(message, sort_keys=True).encode()
        signature = hmac.new(settings.secret.encode(), body, hashlib.sha256).hexdigest()
        headers = {"Content-Type": "application/json", "X-Megatrace-Signature": signature}
        try:
            answer = ctx.session.post(row.destination, data=body, headers=headers, timeout=settings.timeout_s)
        except requests.RequestException as exc:
            return SendResult(Outcome.RETRY, f"{type(exc).__name__}: network error")
        if answer.status_code >= 500:
            return SendResult(Outcome.RETRY, f"HTTP {answer.status_code}")
        if answer.status_code >= 300:
            return SendResult(Outcome.FATAL, f"HTTP {answer.status_code}")
        return SendResult(Outcome.SENT, "posted")
