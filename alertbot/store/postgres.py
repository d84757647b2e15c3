"""The bot's database on PostgreSQL (psycopg 3), for several replicas sharing one database.

The connection runs in autocommit mode, so the store's own ``BEGIN``/``COMMIT`` make the
transactions; a write transaction holds a transaction-level advisory lock (see `dialect.POSTGRESQL`),
which goes with the transaction when a replica's connection dies.
"""

from __future__ import annotations

import psycopg
from psycopg.rows import dict_row

from megatrace.alertbot.store.database import Connection, Database
from megatrace.alertbot.store.dialect import POSTGRESQL

CONNECT_TIMEOUT_S = 5


def open_postgres(url: str) -> Database:
    """The database at the libpq URL `url` (``postgresql://user:pw@host/db``), migrated. A connect
    that gets no answer gives up after CONNECT_TIMEOUT_S (unless the URL sets ``connect_timeout``), so
    a database partitioned away fails a round, not hangs it."""
    timeout = None if "connect_timeout" in url else CONNECT_TIMEOUT_S

    def connect() -> Connection:
        if timeout is None:
            return psycopg.connect(url, autocommit=True, row_factory=dict_row)
        return psycopg.connect(url, autocommit=True, row_factory=dict_row, connect_timeout=timeout)

    database = Database(connect, POSTGRESQL, (psycopg.Error,), "PostgreSQL", lost=_lost)
    database.migrate()
    return database


def _lost(connection: Connection) -> bool:
    return isinstance(connection, psycopg.Connection) and (connection.closed or connection.broken)
