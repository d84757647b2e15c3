"""The console channel: each message as one JSON line in a file or on stdout (no Feishu configured
for a level, or `make demo`). Updates of an incident are written as further lines naming the kind."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import TextIO

from megatrace.alertbot.channels.base import Context, FeishuCardChannel, Message
from megatrace.alertbot.feishu import SendResult
from megatrace.alertbot.kinds import Outcome
from megatrace.alertbot.store.records import Outbox


class ConsoleSink:
    """Writes each message as one JSON line (what would be sent, to whom) to a file or stdout."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, record: dict[str, object]) -> None:
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


class ConsoleChannel(FeishuCardChannel):
    """Writes the card it would send. Also the fallback of every level that has no other channel (see
    `channels.routes`), and where the weekly report goes when no app chat takes it."""

    name = "console"
    edits_messages = True

    def send(self, ctx: Context, row: Outbox, message: Message) -> SendResult:
        ctx.console.write({"channel": self.name, "level": row.level, "kind": row.kind, **message})
        return SendResult(Outcome.SENT, "written to console")

    def update(self, ctx: Context, row: Outbox, parent: Outbox, message: Message) -> SendResult:
        record = {"channel": self.name, "level": row.level, "kind": row.kind, **message}
        ctx.console.write(record | {"replaces": parent.idem_key})
        return SendResult(Outcome.SENT, "written to console")
