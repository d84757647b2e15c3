"""Messages sent by the Feishu app into a chat per level: interactive cards (updated in place through
``PATCH /open-apis/im/v1/messages/{message_id}``) and files. Feishu drops a repeated `uuid`, so a send
left in doubt is simply sent again. A page sent here can be followed by an urgent call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatrace.alertbot.channels.base import MINUTE, SECOND, Channel, Context, Window
from megatrace.alertbot.config import AlertbotConfig, app_configured
from megatrace.alertbot.feishu import SendResult


class AppChannel(Channel):
    name = "app"
    edits = True
    phones = True

    def destinations(self, cfg: AlertbotConfig, level: str) -> list[str]:
        chat = cfg.feishu.app.chats.get(level)
        return [chat] if chat and app_configured(cfg) else []

    def limits(self, cfg: AlertbotConfig, row: Any) -> list[Window]:
        d = cfg.delivery
        windows = [("app", d.app_per_second, SECOND), ("app", d.app_per_minute, MINUTE)]
        if row["parent_id"] is None:  # a new message in the chat, not an edit of one
            windows.append((f"chat:{row['destination']}", d.chat_per_second, SECOND))
        return windows

    def send(self, ctx: Context, row: Any, message: dict[str, Any]) -> SendResult:
        if ctx.app is None:
            return SendResult("fatal", "the Feishu app is not configured")
        if message["msg_type"] == "file":
            return self.send_file(ctx, row, message)
        result = ctx.app.send_message(
            row["destination"], message["msg_type"], message["card"], row["idem_key"]
        )
        if result.ok and not result.data.get("message_id"):
            return SendResult("fatal", "Feishu answered without data.message_id")
        return result

    def update(self, ctx: Context, row: Any, parent: Any, message: dict[str, Any]) -> SendResult:
        if ctx.app is None:
            return SendResult("fatal", "the Feishu app is not configured")
        if not parent["message_id"]:
            return SendResult("fatal", "the card to update has no message id")
        return ctx.app.update_message(parent["message_id"], message["card"])

    def send_file(self, ctx: Context, row: Any, message: dict[str, Any]) -> SendResult:
        """Weekly report: upload the workbook once, then post it as a file message."""
        assert ctx.app is not None
        if not message.get("file_key"):
            uploaded = ctx.app.upload_file(Path(message["path"]))
            if not uploaded.ok:
                return uploaded
            message["file_key"] = uploaded.data.get("file_key", "")
            ctx.store.set_outbox(row["id"], payload=json.dumps(message, ensure_ascii=False))
        return ctx.app.send_message(
            row["destination"], "file", {"file_key": message["file_key"]}, row["idem_key"]
        )
