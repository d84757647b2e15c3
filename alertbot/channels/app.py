"""Messages sent by the Feishu app into a chat per level: interactive cards (updated in place through
``PATCH /open-apis/im/v1/messages/{message_id}``) and files. Feishu drops a repeated `uuid`, so a send
left in doubt is simply sent again. A page sent here can be followed by an urgent call; its cards
carry the on-call buttons, and the weekly report is posted here."""

from __future__ import annotations

import json
from pathlib import Path

from megatrace.alertbot.channels.base import MINUTE, SECOND, Context, FeishuCardChannel, Message, Window
from megatrace.alertbot.config import AlertbotConfig, app_configured
from megatrace.alertbot.feishu import SendResult
from megatrace.alertbot.kinds import Outcome
from megatrace.alertbot.store.records import Outbox


def card_of(message: Message) -> dict[str, object]:
    """The card of an interactive message (its envelope built by `card_message`)."""
    card = message.get("card")
    if not isinstance(card, dict):
        raise ValueError("an interactive message without its card")
    return card


class AppChannel(FeishuCardChannel):
    name = "app"
    edits_messages = True
    pages = True
    receives_reports = True
    takes_actions = True

    def destinations(self, cfg: AlertbotConfig, level: str) -> list[str]:
        chat = cfg.feishu.app.chats.get(level)
        return [chat] if chat and app_configured(cfg) else []

    def limits(self, cfg: AlertbotConfig, row: Outbox) -> list[Window]:
        d = cfg.delivery
        windows = [("app", d.app_per_second, SECOND), ("app", d.app_per_minute, MINUTE)]
        if row.parent_id is None:  # a new message in the chat, not an edit of one
            windows.append((f"chat:{row.destination}", d.chat_per_second, SECOND))
        return windows

    def send(self, ctx: Context, row: Outbox, message: Message) -> SendResult:
        if ctx.app is None:
            return SendResult(Outcome.FATAL, "the Feishu app is not configured")
        if message["msg_type"] == "file":
            return self.send_file(ctx, row, message)
        result = ctx.app.send_message(
            row.destination, str(message["msg_type"]), card_of(message), row.idem_key
        )
        if result.ok and not result.data.get("message_id"):
            return SendResult(Outcome.FATAL, "Feishu answered without data.message_id")
        return result

    def update(self, ctx: Context, row: Outbox, parent: Outbox, message: Message) -> SendResult:
        if ctx.app is None:
            return SendResult(Outcome.FATAL, "the Feishu app is not configured")
        if not parent.message_id:
            return SendResult(Outcome.FATAL, "the card to update has no message id")
        return ctx.app.update_message(parent.message_id, card_of(message))

    def send_file(self, ctx: Context, row: Outbox, message: Message) -> SendResult:
        """Weekly report: upload the workbook once, then post it as a file message."""
        if ctx.app is None:
            return SendResult(Outcome.FATAL, "the Feishu app is not configured")
        if not message.get("file_key"):
            uploaded = ctx.app.upload_file(Path(str(message["path"])))
            if not uploaded.ok:
                return uploaded
            message["file_key"] = uploaded.data.get("file_key", "")
            ctx.store.outbox.update(row.id, payload=json.dumps(message, ensure_ascii=False))
        return ctx.app.send_message(
            row.destination, "file", {"file_key": str(message["file_key"])}, row.idem_key
        )
