"""The console channel: each message as one JSON line in a file or on stdout (no Feishu configured
for a level, or `make demo`). Updates of an incident are written as further lines naming the kind."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

from megatrace.alertbot.channels.base import Channel, Context
from megatrace.alertbot.feishu import SendResult


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


class ConsoleChannel(Channel):
    """Also the fallback of every level that has no other channel (see `channels.routes`)."""

    name = "console"
    edits = True

    def send(self, ctx: Context, row: Any, message: dict[str, Any]) -> SendResult:
        ctx.console.write({"channel": self.name, "level": row["level"], "kind": row["kind"], **message})
        return SendResult("sent", "written to console")

    def update(self, ctx: Context, row: Any, parent: Any, message: dict[str, Any]) -> SendResult:
        record = {"channel": self.name, "level": row["level"], "kind": row["kind"], **message}
        ctx.console.write(record | {"replaces": parent["idem_key"]})
        return SendResult("sent", "written to console")
