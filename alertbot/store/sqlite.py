"""The bot's database in one SQLite file (WAL mode), for a single replica or a report read beside it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from megatrace.alertbot.store.database import Connection, Database, StoreError
from megatrace.alertbot.store.dialect import SQLITE
from megatrace.alertbot.store.migrations import MIGRATIONS

# ``ON CONFLICT DO NOTHING`` needs 3.24, ``RETURNING`` 3.35.
OLDEST_SQLITE = (3, 35, 0)


def open_sqlite(path: str | Path, synchronous: str = "FULL", read_only: bool = False) -> Database:
    """The SQLite database at `path`, migrated; with `read_only`, an existing one opened for reading
    only (reports beside a bot that is writing it: WAL lets the reader see the last committed state
    without blocking the bot or being blocked)."""
    if sqlite3.sqlite_version_info < OLDEST_SQLITE:
        raise StoreError(f"SQLite {sqlite3.sqlite_version} is too old; the bot needs 3.35 or later")
    path = Path(path)
    if read_only:
        return Database(lambda: _read_only(path), SQLITE, (sqlite3.Error,), str(path))

    def connect() -> Connection:
        if str(path) != ":memory:":
            path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        db.execute("PRAGMA foreign_keys=ON")
        return db

    database = Database(connect, SQLITE, (sqlite3.Error,), str(path))
    database.migrate()
    return database


def _read_only(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise StoreError(f"{path}: no alert bot database here (store.path)")
    uri = f"{path.resolve().as_uri()}?mode=ro"
    db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None, timeout=30)
    db.row_factory = sqlite3.Row
    try:
        version = int(db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0)
    except sqlite3.DatabaseError as exc:
        db.close()
        raise StoreError(f"{path}: not an alert bot database ({exc})") from None
    if version != len(MIGRATIONS):
        db.close()
        raise StoreError(
            f"{path}: schema version {version}, this bot reads {len(MIGRATIONS)}; "
            "run the matching bot version on it first"
        )
    return db
