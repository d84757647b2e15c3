"""Webhooks as received (the inbox the worker processes) and alerts set aside (quarantine)."""

from __future__ import annotations

import json

from megatrace.alertbot.store.database import Database
from megatrace.alertbot.store.records import InboxItem, Quarantined, from_row


class Inbox:
    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, source: str, body: str, now: float) -> int:
        sql = "INSERT INTO inbox (received_at, source, body) VALUES (?, ?, ?) RETURNING id"
        return self.db.insert(sql, (now, source, body))

    def unprocessed(self, limit: int = 200) -> list[InboxItem]:
        rows = self.db.query("SELECT * FROM inbox WHERE processed_at IS NULL ORDER BY id LIMIT ?", (limit,))
        return [from_row(InboxItem, row) for row in rows]

    def claim(self, inbox_id: int, now: float) -> bool:
        """Mark a stored webhook processed; False when another replica did."""
        sql = "UPDATE inbox SET processed_at = ? WHERE id = ? AND processed_at IS NULL"
        return self.db.run(sql, (now, inbox_id)) == 1

    def mark(self, inbox_id: int, now: float, error: str | None = None) -> None:
        self.db.run("UPDATE inbox SET processed_at = ?, error = ? WHERE id = ?", (now, error, inbox_id))

    def quarantine(
        self, source: str, alert: object, reason: str, now: float, inbox_id: int | None = None
    ) -> int:
        """Keep an alert that cannot be processed, with the reason, for people to look at."""
        text = json.dumps(alert, ensure_ascii=True, default=repr)
        return self.db.insert(
            "INSERT INTO quarantine (quarantined_at, source, inbox_id, alert, reason) "
            "VALUES (?, ?, ?, ?, ?) RETURNING id",
            (now, source, inbox_id, text, reason[:2000]),
        )

    def quarantined(self) -> list[Quarantined]:
        return [from_row(Quarantined, row) for row in self.db.query("SELECT * FROM quarantine ORDER BY id")]

    def quarantine_count(self) -> int:
        return self.db.count("SELECT COUNT(*) AS n FROM quarantine")
