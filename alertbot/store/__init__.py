"""The alert bot's durable state: received webhooks, alert episodes, incidents and storms, the
delivery outbox and its attempts, sheet rows to archive, drill-downs, quarantined alerts, and what
replicas coordinate on.

Callers see `Store`, a Protocol: one repository per aggregate (`inbox`, `episodes`, `incidents`,
`outbox`, `coordination`), each returning the frozen records of `records`, plus the transaction
that spans them. `open_store` gives the configured one: SQLite (`sqlite`) for a single replica,
PostgreSQL (`postgres`) for several sharing one database. Their SQL is the same; `dialect` holds
what differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from megatrace.alertbot.store.coordination import Coordination
from megatrace.alertbot.store.database import Database, StoreError
from megatrace.alertbot.store.episodes import Episodes
from megatrace.alertbot.store.inbox import Inbox
from megatrace.alertbot.store.incidents import Incidents
from megatrace.alertbot.store.migrations import MIGRATIONS
from megatrace.alertbot.store.outbox import Outboxes
from megatrace.alertbot.store.retention import purge
from megatrace.alertbot.store.sqlite import open_sqlite
from megatrace.logsetup import redact

__all__ = ["MIGRATIONS", "SqlStore", "Store", "StoreError", "open_store", "sqlite_store"]


class Store(Protocol):
    """What the bot's modules use of the store."""

    db: Database
    inbox: Inbox
    episodes: Episodes
    incidents: Incidents
    outbox: Outboxes
    coordination: Coordination

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        """Errors of the database itself (not of one alert's data): they abort a whole batch."""
        ...

    def transaction(self) -> contextlib.AbstractContextManager[None]: ...

    def savepoint(self) -> contextlib.AbstractContextManager[None]: ...

    def purge(self, before: float) -> dict[str, int]: ...

    def close(self) -> None: ...


class SqlStore:
    """The repositories over one `Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.inbox = Inbox(db)
        self.episodes = Episodes(db)
        self.incidents = Incidents(db)
        self.outbox = Outboxes(db)
        self.coordination = Coordination(db)

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        return self.db.errors

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the block atomically; nested blocks join the outermost transaction."""
        with self.db.transaction():
            yield

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """Inside a transaction: undo only this block's changes when it raises."""
        with self.db.savepoint():
            yield

    def purge(self, before: float) -> dict[str, int]:
        """Delete finished history older than `before`; open work is never deleted."""
        return purge(self.db, before)

    def close(self) -> None:
        self.db.close()


def sqlite_store(path: str | Path, synchronous: str = "FULL", read_only: bool = False) -> SqlStore:
    """The store in the SQLite file at `path` (see `sqlite.open_sqlite`)."""
    return SqlStore(open_sqlite(path, synchronous, read_only))


def open_store(url: str, path: str | Path, synchronous: str = "FULL") -> SqlStore:
    """The configured store: PostgreSQL when `url` is given (``postgresql://…``), else SQLite at `path`."""
    if not url:
        return sqlite_store(path, synchronous)
    import psycopg

    from megatrace.alertbot.store.postgres import open_postgres

    try:
        return SqlStore(open_postgres(url))
    except psycopg.Error as exc:
        reason = redact(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise StoreError(f"store.url: cannot open the PostgreSQL database: {reason}") from None
