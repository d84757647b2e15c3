"""Feishu custom group bots: signed webhook posts, one bot per level. A bot cannot edit what it posted,
so an update of an incident is one further post; a post left in doubt by a crash is looked up in the
chat's history through the app when the bot's `chat_id` is known."""

from __future__ import annotations

import json
import logging
import re

from megatrace.alertbot.channels.base import MINUTE, SECOND, Context, FeishuCardChannel, Message, Window
from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.feishu import SendResult, post_group_bot
from megatrace.alertbot.kinds import AfterCrash
from megatrace.alertbot.store.records import Outbox, UnfinishedSend

log = logging.getLogger(__name__)
REF = re.compile(r"megatrace ref [\w-]+")


class GroupBotChannel(FeishuCardChannel):
    name = "bot"

    def destinations(self, cfg: AlertbotConfig, level: str) -> list[str]:
        return [level] if level in cfg.feishu.group_bots else []

    def limits(self, cfg: AlertbotConfig, row: Outbox) -> list[Window]:
        d, key = cfg.delivery, f"bot:{row.destination}"
        return [(key, d.bot_per_second, SECOND), (key, d.bot_per_minute, MINUTE)]

    def send(self, ctx: Context, row: Outbox, message: Message) -> SendResult:
        bot = ctx.cfg.feishu.group_bots[row.destination]
        return post_group_bot(ctx.session, bot.webhook, bot.secret, message, ctx.cfg.feishu.timeout_s)

    def after_crash(self, ctx: Context, sent: UnfinishedSend) -> AfterCrash:
        row = sent.outbox
        bot = ctx.cfg.feishu.group_bots.get(row.destination)
        if bot is None or not bot.chat_id or ctx.app is None:
            log.warning("delivery %s was in flight when the bot stopped; re-sending (may repeat)", row.id)
            return AfterCrash.RESEND
        result = ctx.app.chat_messages(bot.chat_id, sent.attempt_started - 60)
        if not result.ok:
            log.warning("cannot check chat history for in-doubt delivery %s: %s", row.id, result.detail)
            return AfterCrash.RESEND
        found = REF.search(row.payload or "")
        ref = found.group(0) if found else row.idem_key
        posted = any(ref in json.dumps(item, ensure_ascii=False) for item in result.data.get("items", []))
        return AfterCrash.SENT if posted else AfterCrash.RESEND
