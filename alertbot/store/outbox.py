"""The delivery outbox (one row per notification, channel and destination), the attempts at sending
each, and the rows waiting for the Feishu sheet archive.

A notification being sent is leased to its sender: `begin_attempt` sets ``lease_owner`` and
``lease_until``, and another replica takes over only after the lease expired.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from megatrace.alertbot.kinds import OPEN_STATES, ArchiveState, OutboxState, Outcome
from megatrace.alertbot.store.database import Database
from megatrace.alertbot.store.records import (
    ArchiveRow,
    Attempt,
    NewNotification,
    Outbox,
    UnfinishedSend,
    columns,
    from_row,
    names,
)

OPEN = f"({', '.join(repr(state.value) for state in OPEN_STATES)})"


class Outboxes:
    def __init__(self, db: Database) -> None:
        self.db = db

    def _all(self, sql: str, params: Sequence[object] = ()) -> list[Outbox]:
        return [from_row(Outbox, row) for row in self.db.query(sql, params)]

    def enqueue(self, new: NewNotification) -> int | None:
        """Add a notification to the outbox; None when its idempotency key is already there."""
        fields = columns(new) | {"state": OutboxState.PENDING}
        marks = ", ".join("?" for _ in fields)
        return self.db.insert_new(
            f"INSERT INTO outbox ({', '.join(fields)}) VALUES ({marks}) ON CONFLICT DO NOTHING RETURNING id",
            tuple(fields.values()),
        )

    def get(self, outbox_id: int) -> Outbox | None:
        found = self._all("SELECT * FROM outbox WHERE id = ?", (outbox_id,))
        return found[0] if found else None

    def due(self, now: float, limit: int = 200, only: Sequence[int] = ()) -> list[Outbox]:
        """Pending notifications that are due, the most urgent level first (only ids `only` if given)."""
        among = f"AND id IN ({', '.join('?' for _ in only)}) " if only else ""
        return self._all(
            f"SELECT * FROM outbox WHERE state = ? AND not_before <= ? {among}"
            "ORDER BY level, not_before, id LIMIT ?",
            (OutboxState.PENDING, now, *only, limit),
        )

    def next_due(self) -> float | None:
        row = self.db.one("SELECT MIN(not_before) AS n FROM outbox WHERE state = ?", (OutboxState.PENDING,))
        return None if row is None or row["n"] is None else float(row["n"])

    def find(self, **where: object) -> list[Outbox]:
        """The rows whose columns equal `where` (all rows without it), oldest first."""
        unknown = sorted(set(where) - set(names(Outbox)))
        if unknown:
            raise ValueError(f"outbox: no column {', '.join(unknown)}")
        clause = " AND ".join(f"{name} = ?" for name in where) or "1 = 1"
        return self._all(f"SELECT * FROM outbox WHERE {clause} ORDER BY id", tuple(where.values()))

    def card_episodes(self, message_id: str) -> list[int]:
        """The alerts whose card (or card update) was sent as message `message_id`."""
        rows = self.db.query(
            "SELECT DISTINCT episode_id FROM outbox WHERE message_id = ? AND episode_id IS NOT NULL",
            (message_id,),
        )
        return [int(row["episode_id"]) for row in rows]

    def update(self, outbox_id: int, **fields: object) -> None:
        self.db.update("outbox", outbox_id, fields, names(Outbox))

    def begin_attempt(
        self,
        outbox_id: int,
        now: float,
        payload: dict[str, object],
        owner: str = "",
        lease_until: float | None = None,
    ) -> int | None:
        """Claim a pending row and record that its send is starting (committed before the request
        leaves), freezing the payload; the row is leased to `owner` until `lease_until`. None when
        the row is no longer pending: another process sharing the database (another replica,
        ``alertbot report --send`` beside the bot) claimed it first."""
        with self.db.transaction():
            claimed = self.db.run(
                "UPDATE outbox SET state = ?, attempts = attempts + 1, payload = ?, "
                "lease_owner = ?, lease_until = ? WHERE id = ? AND state = ?",
                (
                    OutboxState.SENDING,
                    json.dumps(payload, ensure_ascii=False),
                    owner,
                    lease_until,
                    outbox_id,
                    OutboxState.PENDING,
                ),
            )
            if not claimed:
                return None
            sql = "INSERT INTO attempts (outbox_id, started_at) VALUES (?, ?) RETURNING id"
            return self.db.insert(sql, (outbox_id, now))

    def finish_attempt(self, attempt_id: int, now: float, outcome: Outcome, detail: str) -> None:
        self.db.run(
            "UPDATE attempts SET finished_at = ?, outcome = ?, detail = ? WHERE id = ?",
            (now, outcome, detail[:2000], attempt_id),
        )

    def unfinished_sends(self, expired_before: float | None = None) -> list[UnfinishedSend]:
        """Notifications in state ``sending`` whose last attempt started but never recorded a result
        (the process died); with `expired_before`, only those whose lease ran out by then (a live
        replica may be sending the others)."""
        lease = "" if expired_before is None else "AND (o.lease_until IS NULL OR o.lease_until < ?) "
        rows = self.db.query(
            "SELECT o.*, a.id AS attempt_id, a.started_at AS attempt_started FROM outbox o "
            "JOIN attempts a ON a.outbox_id = o.id "
            f"WHERE o.state = ? AND a.finished_at IS NULL {lease}ORDER BY o.id",
            (OutboxState.SENDING, *(() if expired_before is None else (expired_before,))),
        )
        return [
            UnfinishedSend(from_row(Outbox, row), int(row["attempt_id"]), float(row["attempt_started"]))
            for row in rows
        ]

    def queue_depth(self) -> int:
        return self.db.count(f"SELECT COUNT(*) AS n FROM outbox WHERE state IN {OPEN}")

    def dead_letters(self) -> list[Outbox]:
        return self._all("SELECT * FROM outbox WHERE state = ? ORDER BY id", (OutboxState.DEAD,))

    def attempts_of(self, outbox_id: int) -> list[Attempt]:
        rows = self.db.query("SELECT * FROM attempts WHERE outbox_id = ? ORDER BY id", (outbox_id,))
        return [from_row(Attempt, row) for row in rows]

    # -- sheet archive ------------------------------------------------------------------------

    def add_archive(self, episode_id: int, event: str, row: Sequence[object], now: float) -> None:
        self.db.run(
            "INSERT INTO archive (episode_id, event, row, state, created_at) VALUES (?, ?, ?, ?, ?)",
            (episode_id, event, json.dumps(list(row), ensure_ascii=False), ArchiveState.PENDING, now),
        )

    def pending_archive(self, limit: int) -> list[ArchiveRow]:
        rows = self.db.query(
            "SELECT * FROM archive WHERE state IN (?, ?) ORDER BY id LIMIT ?",
            (ArchiveState.PENDING, ArchiveState.SENDING, limit),
        )
        return [from_row(ArchiveRow, row) for row in rows]

    def set_archive(self, ids: Sequence[int], state: ArchiveState, error: str | None = None) -> None:
        started = 1 if state == ArchiveState.SENDING else 0
        with self.db.transaction():
            for archive_id in ids:
                self.db.run(
                    "UPDATE archive SET state = ?, last_error = ?, attempts = attempts + ? WHERE id = ?",
                    (state, error, started, archive_id),
                )
