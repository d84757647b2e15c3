"""One connection to the bot's database, shared by its threads: transactions, savepoints, queries,
and the migrations. The repositories (`inbox`, `episodes`, `outbox`, `coordination`) run their SQL
through it; the `Dialect` it was opened with says what differs between SQLite and PostgreSQL.

Every write transaction is exclusive across processes (SQLite's ``BEGIN IMMEDIATE``, a PostgreSQL
advisory lock); nested blocks join the outermost one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any, Protocol

from megatrace.alertbot.store.dialect import Dialect, Statement
from megatrace.alertbot.store.migrations import MIGRATIONS
from megatrace.alertbot.store.records import Row

log = logging.getLogger(__name__)


class Cursor(Protocol):
    rowcount: int

    def fetchall(self) -> Sequence[Any]: ...

    def fetchone(self) -> Any: ...


class Connection(Protocol):
    """What both drivers' connections offer (``sqlite3.Connection``, ``psycopg.Connection``)."""

    def execute(self, sql: str, params: Sequence[Any], /) -> Any: ...

    def close(self) -> None: ...


class StoreError(RuntimeError):
    """The database cannot be used (missing, not the bot's, or from another schema version)."""


def _plain(params: Sequence[object]) -> tuple[object, ...]:
    """Parameters as the drivers take them: an enum member as its stored value."""
    return tuple(p.value if isinstance(p, Enum) else p for p in params)


class Database:
    """A connection guarded by a re-entrant lock. `connect` opens a new connection; `lost` tells one
    the server or network dropped, which is replaced before the next statement outside a transaction.
    `errors` are the driver's own: they abort a whole batch, not one alert."""

    def __init__(
        self,
        connect: Callable[[], Connection],
        dialect: Dialect,
        errors: tuple[type[Exception], ...],
        where: str,
        lost: Callable[[Connection], bool] = lambda conn: False,
    ) -> None:
        self.dialect = dialect
        self.errors = errors
        self.where = where
        self._connect = connect
        self._lost = lost
        self._lock = threading.RLock()
        self._depth = 0
        self.connection = connect()

    def close(self) -> None:
        with self._lock:
            self.connection.close()

    def _live(self) -> Connection:
        if self._depth == 0 and self._lost(self.connection):
            log.warning("%s: database connection lost; reconnecting", self.dialect.name)
            self.connection = self._connect()
        return self.connection

    def _execute(self, sql: str, params: Sequence[object] = ()) -> Cursor:
        with self._lock:
            cursor: Cursor = self._live().execute(self.dialect.sql(sql), _plain(params))
            return cursor

    def _statements(self, statements: Sequence[Statement]) -> None:
        for sql, params in statements:
            self._execute(sql, params)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the block atomically, holding the write lock; nested blocks join the outermost."""
        with self._lock:
            outer = self._depth == 0
            if outer:
                try:
                    self._statements(self.dialect.begin_write)
                except BaseException:
                    self._rollback()
                    raise
            self._depth += 1
            try:
                yield
            except BaseException:
                self._depth -= 1
                if outer:
                    self._rollback()
                raise
            self._depth -= 1
            if outer:
                self._execute("COMMIT")

    def _rollback(self) -> None:
        """Undo the open transaction; a dead connection has nothing left to undo."""
        with contextlib.suppress(*self.errors):
            self._execute("ROLLBACK")

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """Inside a transaction: undo only this block's changes when it raises."""
        with self._lock:
            self._execute("SAVEPOINT one_alert")
            try:
                yield
            except BaseException:
                self._execute("ROLLBACK TO SAVEPOINT one_alert")
                self._execute("RELEASE SAVEPOINT one_alert")
                raise
            self._execute("RELEASE SAVEPOINT one_alert")

    def query(self, sql: str, params: Sequence[object] = ()) -> list[Row]:
        with self._lock:
            return list(self._execute(sql, params).fetchall())

    def one(self, sql: str, params: Sequence[object] = ()) -> Row | None:
        with self._lock:
            row: Row | None = self._execute(sql, params).fetchone()
            return row

    def count(self, sql: str, params: Sequence[object] = ()) -> int:
        """The single number a ``SELECT COUNT(…) AS n``-style query returns (as column ``n``)."""
        row = self.one(sql, params)
        return 0 if row is None or row["n"] is None else int(row["n"])

    def run(self, sql: str, params: Sequence[object] = ()) -> int:
        """Execute one write statement in a transaction; the number of rows it changed."""
        with self.transaction():
            return self._execute(sql, params).rowcount

    def insert(self, sql: str, params: Sequence[object] = ()) -> int:
        """Execute an ``INSERT … RETURNING id``; the new row's id."""
        row_id = self.insert_new(sql, params)
        if row_id is None:
            raise StoreError(f"{self.where}: an insert returned no row id")
        return row_id

    def insert_new(self, sql: str, params: Sequence[object] = ()) -> int | None:
        """Execute an ``INSERT … ON CONFLICT DO NOTHING RETURNING id``; the new row's id, None when
        the row was there already."""
        with self.transaction():
            row = self._execute(sql, params).fetchone()
            return None if row is None else int(row["id"])

    def update(self, table: str, row_id: int, fields: dict[str, object], columns: Sequence[str]) -> None:
        """Set `fields` of row `row_id` of `table`; a field that is not one of `columns` is refused
        (column names are never taken from data)."""
        unknown = sorted(set(fields) - set(columns))
        if unknown:
            raise ValueError(f"{table}: no column {', '.join(unknown)}")
        assignments = ", ".join(f"{name} = ?" for name in fields)
        self.run(f"UPDATE {table} SET {assignments} WHERE id = ?", (*fields.values(), row_id))

    # -- schema -------------------------------------------------------------------------------

    def schema_version(self) -> int:
        with self._lock:
            self._execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            return self.count("SELECT MAX(version) AS n FROM schema_version")

    def migrate(self) -> int:
        """Apply the migrations this database has not seen yet; returns the resulting version."""
        with self._lock:
            self._statements(self.dialect.migrate_lock)
            try:
                current = self.schema_version()
                if current > len(MIGRATIONS):
                    raise StoreError(
                        f"{self.where}: schema version {current} is newer than this bot ({len(MIGRATIONS)})"
                    )
                for version, script in enumerate(MIGRATIONS[current:], start=current + 1):
                    with self.transaction():
                        for statement in self.dialect.script(script):
                            self._execute(statement)
                        self._execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
            finally:
                self._statements(self.dialect.migrate_unlock)
            return len(MIGRATIONS)

    def journal_mode(self) -> str:
        if self.dialect.name != "sqlite":
            return self.dialect.name
        row = self.one("PRAGMA journal_mode")
        return "" if row is None else str(row["journal_mode"])
