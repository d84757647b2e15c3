"""Logging for every megatrace command: one setup, human-readable or JSON lines, secrets masked.

Components register secret values (tokens, webhook URLs, passwords) with `register_secret`; every
record's final text has them replaced by ``***`` whatever handler formats it.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from datetime import UTC, datetime

_SECRETS: set[str] = set()
_SECRETS_LOCK = threading.Lock()
MASK = "***"


def register_secret(value: str | None) -> None:
    """Mask `value` in all log output from now on (values shorter than 4 characters are ignored),
    also as JSON and ``repr`` write it (escaped quotes, backslashes, non-ASCII)."""
    if value and len(value) >= 4:
        forms = {
            value,
            json.dumps(value)[1:-1],
            json.dumps(value, ensure_ascii=False)[1:-1],
            repr(value)[1:-1],
            ascii(value)[1:-1],
        }
        with _SECRETS_LOCK:
            _SECRETS.update(forms)


def redact(text: str) -> str:
    """Return `text` with every registered secret replaced by the mask."""
    with _SECRETS_LOCK:
        secrets = sorted(_SECRETS, key=len, reverse=True)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


class RedactingFormatter(logging.Formatter):
    """Human-readable lines: time, level, logger, message; secrets masked."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus any `extra` fields; secrets masked."""

    _STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return redact(json.dumps(entry, default=str))


def setup_logging(level: str = "info", fmt: str = "text", stream=None) -> None:
    """Configure the root logger once for the process (calling again replaces the handler)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else RedactingFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
