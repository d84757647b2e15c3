"""The bot's durable state in SQLite: received webhooks, alert episodes, the delivery outbox and its
attempts, sheet rows to archive, drill-downs, quarantined alerts. WAL mode, numbered schema
migrations, retention.

All SQL of the bot lives here. `store_postgres.PostgresStore` runs the same statements on PostgreSQL
for a deployment with several replicas; `open_store` picks one from the configuration. The SQL here
stays in the common subset of both (``?`` parameters, ``INSERT OR IGNORE``; the PostgreSQL store
rewrites those two).

Several replicas share one database safely through three things: every write transaction is
exclusive (SQLite's ``BEGIN IMMEDIATE``, a PostgreSQL advisory lock), a notification being sent is
leased to its sender (`begin_attempt` sets ``lease_owner`` and ``lease_until``; another replica takes
over only after the lease expired), and named leases (`hold_lease`) and job runs (`claim_run`) make
scheduled work happen once per cluster.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE inbox (
        id INTEGER PRIMARY KEY, received_at REAL NOT NULL, source TEXT NOT NULL, body TEXT NOT NULL,
        processed_at REAL, error TEXT);
    CREATE INDEX inbox_pending ON inbox(processed_at);
    CREATE TABLE episodes (
        id INTEGER PRIMARY KEY, fingerprint TEXT NOT NULL, starts_at REAL NOT NULL,
        alertname TEXT NOT NULL, labels TEXT NOT NULL, annotations TEXT NOT NULL,
        generator_url TEXT NOT NULL, external_url TEXT NOT NULL, status TEXT NOT NULL,
        severity TEXT NOT NULL, level TEXT NOT NULL, escalated INTEGER NOT NULL DEFAULT 0,
        recurrence INTEGER NOT NULL DEFAULT 0, recent INTEGER NOT NULL DEFAULT 0,
        flapping INTEGER NOT NULL DEFAULT 0, storm_id INTEGER,
        first_seen REAL NOT NULL, last_seen REAL NOT NULL, ends_at REAL, last_notified REAL,
        duplicates INTEGER NOT NULL DEFAULT 0,
        UNIQUE (fingerprint, starts_at));
    CREATE INDEX episodes_fingerprint ON episodes(fingerprint, first_seen);
    CREATE INDEX episodes_kind ON episodes(alertname, level, first_seen);
    CREATE INDEX episodes_status ON episodes(status);
    CREATE TABLE storms (
        id INTEGER PRIMARY KEY, alertname TEXT NOT NULL, level TEXT NOT NULL,
        opened_at REAL NOT NULL, sealed_at REAL);
    CREATE TABLE outbox (
        id INTEGER PRIMARY KEY, kind TEXT NOT NULL, episode_id INTEGER, storm_id INTEGER,
        drilldown_id INTEGER, parent_id INTEGER, channel TEXT NOT NULL, destination TEXT NOT NULL,
        level TEXT NOT NULL, state TEXT NOT NULL, idem_key TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL, not_before REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
        last_error TEXT, payload TEXT, message_id TEXT, sent_at REAL);
    CREATE INDEX outbox_due ON outbox(state, not_before);
    CREATE TABLE attempts (
        id INTEGER PRIMARY KEY, outbox_id INTEGER NOT NULL, started_at REAL NOT NULL,
        finished_at REAL, outcome TEXT, detail TEXT);
    CREATE INDEX attempts_outbox ON attempts(outbox_id);
    CREATE TABLE archive (
        id INTEGER PRIMARY KEY, episode_id INTEGER NOT NULL, event TEXT NOT NULL, row TEXT NOT NULL,
        state TEXT NOT NULL, created_at REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
        last_error TEXT);
    CREATE INDEX archive_state ON archive(state);
    CREATE TABLE drilldowns (
        id INTEGER PRIMARY KEY, job TEXT NOT NULL, alertname TEXT NOT NULL, episode_id INTEGER NOT NULL,
        requested_at REAL NOT NULL, state TEXT NOT NULL, result TEXT, finished_at REAL);
    CREATE INDEX drilldowns_job ON drilldowns(job, requested_at);
    """,
    """
    CREATE TABLE quarantine (
        id INTEGER PRIMARY KEY, quarantined_at REAL NOT NULL, source TEXT NOT NULL,
        inbox_id INTEGER, alert TEXT NOT NULL, reason TEXT NOT NULL);
    """,
    """
    ALTER TABLE outbox ADD COLUMN lease_owner TEXT;
    ALTER TABLE outbox ADD COLUMN lease_until REAL;
    ALTER TABLE episodes ADD COLUMN claimed_by TEXT;
    ALTER TABLE episodes ADD COLUMN claimed_at REAL;
    ALTER TABLE episodes ADD COLUMN silence_id TEXT;
    ALTER TABLE episodes ADD COLUMN silenced_until REAL;
    CREATE TABLE leases (name TEXT PRIMARY KEY, owner TEXT NOT NULL, until REAL NOT NULL);
    CREATE TABLE job_runs (
        job TEXT NOT NULL, slot TEXT NOT NULL, owner TEXT NOT NULL, started_at REAL NOT NULL,
        lease_until REAL NOT NULL, done_at REAL, PRIMARY KEY (job, slot));
    CREATE TABLE actions (
        id INTEGER PRIMARY KEY, at REAL NOT NULL, actor TEXT NOT NULL, actor_name TEXT NOT NULL,
        action TEXT NOT NULL, episode_id INTEGER, detail TEXT NOT NULL, source TEXT NOT NULL);
    CREATE INDEX actions_at ON actions(at);
    CREATE TABLE callbacks_seen (event_id TEXT PRIMARY KEY, seen_at REAL NOT NULL);
    CREATE TABLE escalations (
        id INTEGER PRIMARY KEY, episode_id INTEGER NOT NULL, step INTEGER NOT NULL, message_id TEXT NOT NULL,
        users TEXT NOT NULL, at REAL NOT NULL, UNIQUE (episode_id, step));
    """,
    # Card updates name the card they replace (parent_id) on its own channel and chat.
    """
    UPDATE outbox SET
        parent_id = (SELECT p.id FROM outbox p
            WHERE p.channel = 'app' AND p.message_id = outbox.destination LIMIT 1),
        destination = COALESCE((SELECT p.destination FROM outbox p
            WHERE p.channel = 'app' AND p.message_id = outbox.destination LIMIT 1), outbox.destination),
        channel = 'app'
        WHERE channel = 'app-update';
    """,
    # One incident per job and level: its hang and slow alerts share one card, which names the culprit.
    """
    CREATE TABLE incidents (
        id INTEGER PRIMARY KEY, job TEXT NOT NULL, level TEXT NOT NULL, opened_at REAL NOT NULL,
        closed_at REAL, lead_episode_id INTEGER NOT NULL, verdict TEXT, verdict_at REAL);
    CREATE INDEX incidents_open ON incidents(job, level, closed_at);
    ALTER TABLE episodes ADD COLUMN incident_id INTEGER;
    """,
    # Feishu's rate windows, shared by the replicas of one database (`ratelimit.SharedRateLimiter`).
    """
    CREATE TABLE rate_slots (id INTEGER PRIMARY KEY, name TEXT NOT NULL, at REAL NOT NULL);
    CREATE INDEX rate_slots_name ON rate_slots(name, at);
    """,
)

OPEN_STATES = ("pending", "sending")


def open_store(url: str, path: str | Path, synchronous: str = "FULL") -> Store:
    """The configured store: PostgreSQL when `url` is given (``postgresql://…``), else SQLite at `path`."""
    if url:
        from megatrace.alertbot.store_postgres import PostgresStore

        return PostgresStore(url)
    return Store(path, synchronous)


class StoreError(Exception):
    """The database cannot be used (missing, not the bot's, or from another schema version)."""


class Store:
    """One SQLite database shared by the bot's threads (a connection guarded by a re-entrant lock).

    `read_only` opens an existing database for reading only (reports), beside a bot that is writing
    it: WAL lets the reader see the last committed state without blocking the bot or being blocked.
    """

    # Errors of the database itself (not of one alert's data): they abort a whole batch.
    errors: tuple[type[Exception], ...] = (sqlite3.Error,)

    def __init__(self, path: str | Path, synchronous: str = "FULL", read_only: bool = False) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self._depth = 0
        if read_only:
            self.db = self._open_read_only()
            return
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.migrate()

    def _open_read_only(self) -> sqlite3.Connection:
        if not self.path.is_file():
            raise StoreError(f"{self.path}: no alert bot database here (store.path)")
        uri = f"{self.path.resolve().as_uri()}?mode=ro"
        db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None, timeout=30)
        db.row_factory = sqlite3.Row
        try:
            version = int(db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0)
        except sqlite3.DatabaseError as exc:
            db.close()
            raise StoreError(f"{self.path}: not an alert bot database ({exc})") from None
        if version != len(MIGRATIONS):
            db.close()
            raise StoreError(
                f"{self.path}: schema version {version}, this bot reads {len(MIGRATIONS)}; "
                "run the matching bot version on it first"
            )
        return db

    def close(self) -> None:
        with self._lock:
            self.db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Run the block atomically; nested blocks join the outermost transaction."""
        with self._lock:
            outer = self._depth == 0
            if outer:
                self.db.execute("BEGIN IMMEDIATE")
            self._depth += 1
            try:
                yield self.db
            except BaseException:
                self._depth -= 1
                if outer:
                    self.db.execute("ROLLBACK")
                raise
            self._depth -= 1
            if outer:
                self.db.execute("COMMIT")

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[sqlite3.Connection]:
        """Inside a transaction: undo only this block's changes when it raises."""
        with self._lock:
            self.db.execute("SAVEPOINT one_alert")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK TO one_alert")
                self.db.execute("RELEASE one_alert")
                raise
            self.db.execute("RELEASE one_alert")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self.db.execute(sql, params).fetchall()

    def one(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        with self._lock:
            return self.db.execute(sql, params).fetchone()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        with self.transaction() as db:
            return db.execute(sql, params)

    # -- schema -------------------------------------------------------------------------------

    def schema_version(self) -> int:
        with self._lock:
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = self.db.execute("SELECT MAX(version) FROM schema_version").fetchone()
            return int(row[0] or 0)

    def migrate(self) -> int:
        """Apply the migrations this database has not seen yet; returns the resulting version."""
        with self._lock:
            current = self.schema_version()
            if current > len(MIGRATIONS):
                raise RuntimeError(
                    f"{self.path}: schema version {current} is newer than this bot ({len(MIGRATIONS)})"
                )
            for version, script in enumerate(MIGRATIONS[current:], start=current + 1):
                statements = [s.strip() for s in script.split(";") if s.strip()]
                with self.transaction() as db:
                    for statement in statements:
                        db.execute(statement)
                    db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
            return len(MIGRATIONS)

    def journal_mode(self) -> str:
        return str(self.one("PRAGMA journal_mode")[0])

    # -- inbox --------------------------------------------------------------------------------

    def add_inbox(self, source: str, body: str, now: float) -> int:
        with self.transaction() as db:
            cur = db.execute(
                "INSERT INTO inbox (received_at, source, body) VALUES (?, ?, ?)", (now, source, body)
            )
            return int(cur.lastrowid)

    def unprocessed_inbox(self, limit: int = 200) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM inbox WHERE processed_at IS NULL ORDER BY id LIMIT ?", (limit,))

    def claim_inbox(self, inbox_id: int, now: float) -> bool:
        """Inside a transaction: mark a stored webhook processed; False when another replica did."""
        with self.transaction() as db:
            cur = db.execute(
                "UPDATE inbox SET processed_at = ? WHERE id = ? AND processed_at IS NULL", (now, inbox_id)
            )
            return bool(cur.rowcount)

    def mark_inbox(self, inbox_id: int, now: float, error: str | None = None) -> None:
        self.execute("UPDATE inbox SET processed_at = ?, error = ? WHERE id = ?", (now, error, inbox_id))

    # -- quarantine ---------------------------------------------------------------------------

    def add_quarantine(
        self, source: str, alert: Any, reason: str, now: float, inbox_id: int | None = None
    ) -> int:
        """Keep an alert that cannot be processed, with the reason, for people to look at."""
        text = json.dumps(alert, ensure_ascii=True, default=repr)
        cur = self.execute(
            "INSERT INTO quarantine (quarantined_at, source, inbox_id, alert, reason) VALUES (?, ?, ?, ?, ?)",
            (now, source, inbox_id, text, reason[:2000]),
        )
        return int(cur.lastrowid)

    def quarantined(self) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM quarantine ORDER BY id")

    def quarantine_count(self) -> int:
        return int(self.one("SELECT COUNT(*) FROM quarantine")[0])

    # -- episodes -----------------------------------------------------------------------------

    def episode(self, episode_id: int) -> sqlite3.Row | None:
        return self.one("SELECT * FROM episodes WHERE id = ?", (episode_id,))

    def find_episode(self, fingerprint: str, starts_at: float) -> sqlite3.Row | None:
        return self.one(
            "SELECT * FROM episodes WHERE fingerprint = ? AND starts_at = ?", (fingerprint, starts_at)
        )

    def count_episodes(self, fingerprint: str, since: float) -> int:
        row = self.one(
            "SELECT COUNT(*) FROM episodes WHERE fingerprint = ? AND first_seen >= ?", (fingerprint, since)
        )
        return int(row[0])

    def count_all_episodes(self, fingerprint: str) -> int:
        return int(self.one("SELECT COUNT(*) FROM episodes WHERE fingerprint = ?", (fingerprint,))[0])

    def count_new_of_kind(self, alertname: str, level: str, since: float) -> int:
        row = self.one(
            "SELECT COUNT(*) FROM episodes WHERE alertname = ? AND level = ? AND first_seen >= ?",
            (alertname, level, since),
        )
        return int(row[0])

    def insert_episode(self, fields: dict[str, Any]) -> int:
        names = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        with self.transaction() as db:
            cur = db.execute(f"INSERT INTO episodes ({names}) VALUES ({marks})", tuple(fields.values()))
            return int(cur.lastrowid)

    def begin_silence(self, episode_id: int, marker: str, now: float, until: float) -> bool:
        """Mark the alert as being silenced (``silence_id`` = `marker` until `until`) unless a
        silence of it is active or being made: True for the one caller that may create it."""
        cur = self.execute(
            "UPDATE episodes SET silence_id = ?, silenced_until = ? WHERE id = ? "
            "AND (silence_id IS NULL OR silenced_until IS NULL OR silenced_until <= ?)",
            (marker, until, episode_id, now),
        )
        return cur.rowcount == 1

    def update_episode(self, episode_id: int, **fields: Any) -> None:
        assignments = ", ".join(f"{name} = ?" for name in fields)
        self.execute(f"UPDATE episodes SET {assignments} WHERE id = ?", (*fields.values(), episode_id))

    def firing_episodes(self) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM episodes WHERE status = 'firing'")

    def episodes_between(self, since: float, until: float) -> list[sqlite3.Row]:
        return self.query(
            "SELECT * FROM episodes WHERE starts_at >= ? AND starts_at < ? ORDER BY starts_at, id",
            (since, until),
        )

    def storm_members(self, storm_id: int) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM episodes WHERE storm_id = ? ORDER BY id", (storm_id,))

    # -- incidents ----------------------------------------------------------------------------

    def open_incident(self, job: str, level: str) -> sqlite3.Row | None:
        return self.one(
            "SELECT * FROM incidents WHERE job = ? AND level = ? AND closed_at IS NULL "
            "ORDER BY id DESC LIMIT 1",
            (job, level),
        )

    def create_incident(self, job: str, level: str, lead_episode_id: int, now: float) -> int:
        cur = self.execute(
            "INSERT INTO incidents (job, level, opened_at, lead_episode_id) VALUES (?, ?, ?, ?)",
            (job, level, now, lead_episode_id),
        )
        return int(cur.lastrowid)

    def incident(self, incident_id: int) -> sqlite3.Row | None:
        return self.one("SELECT * FROM incidents WHERE id = ?", (incident_id,))

    def set_incident(self, incident_id: int, **fields: Any) -> None:
        assignments = ", ".join(f"{name} = ?" for name in fields)
        self.execute(f"UPDATE incidents SET {assignments} WHERE id = ?", (*fields.values(), incident_id))

    def incidents_led_between(self, since: float, until: float) -> list[sqlite3.Row]:
        """Incidents whose first alert started in [since, until)."""
        return self.query(
            "SELECT i.* FROM incidents i JOIN episodes e ON e.id = i.lead_episode_id "
            "WHERE e.starts_at >= ? AND e.starts_at < ? ORDER BY i.id",
            (since, until),
        )

    def incident_members(self, incident_id: int) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM episodes WHERE incident_id = ? ORDER BY id", (incident_id,))

    # -- storms -------------------------------------------------------------------------------

    def open_storm(self, alertname: str, level: str) -> sqlite3.Row | None:
        return self.one(
            "SELECT * FROM storms WHERE alertname = ? AND level = ? AND sealed_at IS NULL "
            "ORDER BY id DESC LIMIT 1",
            (alertname, level),
        )

    def create_storm(self, alertname: str, level: str, now: float) -> int:
        cur = self.execute(
            "INSERT INTO storms (alertname, level, opened_at) VALUES (?, ?, ?)", (alertname, level, now)
        )
        return int(cur.lastrowid)

    def seal_storm(self, storm_id: int, now: float) -> None:
        self.execute("UPDATE storms SET sealed_at = ? WHERE id = ? AND sealed_at IS NULL", (now, storm_id))

    def storm(self, storm_id: int) -> sqlite3.Row | None:
        return self.one("SELECT * FROM storms WHERE id = ?", (storm_id,))

    # -- outbox -------------------------------------------------------------------------------

    def enqueue(self, fields: dict[str, Any]) -> int | None:
        """Add a notification to the outbox; None when its idempotency key is already there."""
        names = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        cur = self.execute(
            f"INSERT OR IGNORE INTO outbox ({names}, state) VALUES ({marks}, 'pending')",
            tuple(fields.values()),
        )
        return int(cur.lastrowid) if cur.rowcount else None

    def outbox_row(self, outbox_id: int) -> sqlite3.Row | None:
        return self.one("SELECT * FROM outbox WHERE id = ?", (outbox_id,))

    def due_outbox(self, now: float, limit: int = 200, only: Sequence[int] = ()) -> list[sqlite3.Row]:
        """Pending notifications that are due, the most urgent level first (only ids `only` if given)."""
        among = f"AND id IN ({', '.join('?' for _ in only)}) " if only else ""
        return self.query(
            f"SELECT * FROM outbox WHERE state = 'pending' AND not_before <= ? {among}"
            "ORDER BY level, not_before, id LIMIT ?",
            (now, *only, limit),
        )

    def next_due(self) -> float | None:
        row = self.one("SELECT MIN(not_before) FROM outbox WHERE state = 'pending'")
        return None if row[0] is None else float(row[0])

    def outbox_for(self, **where: Any) -> list[sqlite3.Row]:
        clause = " AND ".join(f"{name} = ?" for name in where)
        return self.query(f"SELECT * FROM outbox WHERE {clause} ORDER BY id", tuple(where.values()))

    def card_episodes(self, message_id: str) -> list[int]:
        """The alerts whose card (or card update) was sent as message `message_id`."""
        rows = self.query(
            "SELECT DISTINCT episode_id FROM outbox WHERE message_id = ? AND episode_id IS NOT NULL",
            (message_id,),
        )
        return [int(row[0]) for row in rows]

    def set_outbox(self, outbox_id: int, **fields: Any) -> None:
        assignments = ", ".join(f"{name} = ?" for name in fields)
        self.execute(f"UPDATE outbox SET {assignments} WHERE id = ?", (*fields.values(), outbox_id))

    def begin_attempt(
        self,
        outbox_id: int,
        now: float,
        payload: dict[str, Any],
        owner: str = "",
        lease_until: float | None = None,
    ) -> int | None:
        """Claim a pending row and record that its send is starting (committed before the request
        leaves), freezing the payload; the row is leased to `owner` until `lease_until`. None when
        the row is no longer pending: another process sharing the database (another replica,
        ``alertbot report --send`` beside the bot) claimed it first."""
        with self.transaction() as db:
            claimed = db.execute(
                "UPDATE outbox SET state = 'sending', attempts = attempts + 1, payload = ?, "
                "lease_owner = ?, lease_until = ? WHERE id = ? AND state = 'pending'",
                (json.dumps(payload, ensure_ascii=False), owner, lease_until, outbox_id),
            ).rowcount
            if not claimed:
                return None
            cur = db.execute("INSERT INTO attempts (outbox_id, started_at) VALUES (?, ?)", (outbox_id, now))
            return int(cur.lastrowid)

    def finish_attempt(self, attempt_id: int, now: float, outcome: str, detail: str) -> None:
        self.execute(
            "UPDATE attempts SET finished_at = ?, outcome = ?, detail = ? WHERE id = ?",
            (now, outcome, detail[:2000], attempt_id),
        )

    def in_doubt(self, expired_before: float | None = None) -> list[sqlite3.Row]:
        """Outbox rows whose last send started but never recorded a result (the process died); with
        `expired_before`, only those whose lease ran out by then (a live replica may be sending)."""
        lease = "" if expired_before is None else "AND (o.lease_until IS NULL OR o.lease_until < ?) "
        return self.query(
            "SELECT o.*, a.id AS attempt_id, a.started_at AS attempt_started FROM outbox o "
            "JOIN attempts a ON a.outbox_id = o.id "
            f"WHERE o.state = 'sending' AND a.finished_at IS NULL {lease}ORDER BY o.id",
            () if expired_before is None else (expired_before,),
        )

    def queue_depth(self) -> int:
        return int(self.one("SELECT COUNT(*) FROM outbox WHERE state IN ('pending', 'sending')")[0])

    def dead_letters(self) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM outbox WHERE state = 'dead' ORDER BY id")

    def attempts_of(self, outbox_id: int) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM attempts WHERE outbox_id = ? ORDER BY id", (outbox_id,))

    # -- sheet archive ------------------------------------------------------------------------

    def add_archive(self, episode_id: int, event: str, row: list[Any], now: float) -> None:
        self.execute(
            "INSERT INTO archive (episode_id, event, row, state, created_at) VALUES (?, ?, ?, 'pending', ?)",
            (episode_id, event, json.dumps(row, ensure_ascii=False), now),
        )

    def pending_archive(self, limit: int) -> list[sqlite3.Row]:
        return self.query(
            "SELECT * FROM archive WHERE state IN ('pending', 'sending') ORDER BY id LIMIT ?", (limit,)
        )

    def set_archive(self, ids: Sequence[int], state: str, error: str | None = None) -> None:
        with self.transaction() as db:
            db.executemany(
                "UPDATE archive SET state = ?, last_error = ?, "
                "attempts = attempts + CASE WHEN ? = 'sending' THEN 1 ELSE 0 END "
                "WHERE id = ?",
                [(state, error, state, i) for i in ids],
            )

    # -- drill-downs --------------------------------------------------------------------------

    def recent_drilldown(self, job: str, alertname: str, since: float) -> sqlite3.Row | None:
        return self.one(
            "SELECT * FROM drilldowns WHERE job = ? AND alertname = ? AND requested_at >= ? "
            "ORDER BY id DESC LIMIT 1",
            (job, alertname, since),
        )

    def add_drilldown(self, job: str, alertname: str, episode_id: int, now: float) -> int:
        cur = self.execute(
            "INSERT INTO drilldowns (job, alertname, episode_id, requested_at, state) "
            "VALUES (?, ?, ?, ?, 'pending')",
            (job, alertname, episode_id, now),
        )
        return int(cur.lastrowid)

    def pending_drilldowns(self) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM drilldowns WHERE state IN ('pending', 'running') ORDER BY id")

    def set_drilldown(self, drilldown_id: int, **fields: Any) -> None:
        assignments = ", ".join(f"{name} = ?" for name in fields)
        self.execute(f"UPDATE drilldowns SET {assignments} WHERE id = ?", (*fields.values(), drilldown_id))

    def drilldown(self, drilldown_id: int) -> sqlite3.Row | None:
        return self.one("SELECT * FROM drilldowns WHERE id = ?", (drilldown_id,))

    # -- rate windows ---------------------------------------------------------------------------

    def take_rate_slots(
        self, windows: Sequence[tuple[str, float, float]], now: float
    ) -> tuple[float, list[int]]:
        """A slot at `now` in every window (name, requests, per seconds) or in none, atomically for
        every replica: (0, the slots' ids) when each has room, else (seconds until all would, [])."""
        with self.transaction():
            wait = 0.0
            for name, requests, per in windows:
                key = f"{name}/{per:g}"
                self.execute("DELETE FROM rate_slots WHERE name = ? AND at <= ?", (key, now - per))
                newest = self.query(
                    "SELECT at FROM rate_slots WHERE name = ? ORDER BY at DESC LIMIT ?", (key, int(requests))
                )
                if len(newest) >= requests:
                    wait = max(wait, float(newest[-1][0]) + per - now)
            if wait > 0:
                return wait, []
            insert = "INSERT INTO rate_slots (name, at) VALUES (?, ?)"
            return 0.0, [int(self.execute(insert, (f"{n}/{per:g}", now)).lastrowid) for n, _, per in windows]

    def settle_rate_slots(self, ids: Sequence[int], at: float) -> None:
        """Count the slots `ids` as taken at `at` (when their request finished)."""
        if ids:
            marks = ", ".join("?" for _ in ids)
            self.execute(f"UPDATE rate_slots SET at = ? WHERE id IN ({marks})", (at, *ids))

    # -- cluster coordination -------------------------------------------------------------------

    def hold_lease(self, name: str, owner: str, now: float, ttl: float) -> bool:
        """Take or renew the named lease for `owner` until ``now + ttl``; False while another owner
        holds it unexpired."""
        with self.transaction() as db:
            row = db.execute("SELECT owner, until FROM leases WHERE name = ?", (name,)).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO leases (name, owner, until) VALUES (?, ?, ?)", (name, owner, now + ttl)
                )
                return True
            if row[0] != owner and row[1] >= now:
                return False
            db.execute("UPDATE leases SET owner = ?, until = ? WHERE name = ?", (owner, now + ttl, name))
            return True

    def release_lease(self, name: str, owner: str) -> None:
        self.execute("DELETE FROM leases WHERE name = ? AND owner = ?", (name, owner))

    def claim_run(self, job: str, slot: str, owner: str, now: float, ttl: float) -> bool:
        """Claim one run of `job` for `slot` (a period): True for the first claimant, and for a
        later one when the run was never finished and its claimant's lease expired."""
        with self.transaction() as db:
            row = db.execute(
                "SELECT owner, lease_until, done_at FROM job_runs WHERE job = ? AND slot = ?", (job, slot)
            ).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO job_runs (job, slot, owner, started_at, lease_until) VALUES (?, ?, ?, ?, ?)",
                    (job, slot, owner, now, now + ttl),
                )
                return True
            if row[2] is not None or (row[0] != owner and row[1] >= now):
                return False
            db.execute(
                "UPDATE job_runs SET owner = ?, lease_until = ? WHERE job = ? AND slot = ?",
                (owner, now + ttl, job, slot),
            )
            return True

    def finish_run(self, job: str, slot: str, now: float) -> None:
        self.execute("UPDATE job_runs SET done_at = ? WHERE job = ? AND slot = ?", (now, job, slot))

    def unfinished_runs(self, job: str, now: float) -> list[sqlite3.Row]:
        """Runs of `job` claimed but never finished whose lease expired (their replica died)."""
        return self.query(
            "SELECT * FROM job_runs WHERE job = ? AND done_at IS NULL AND lease_until < ? ORDER BY slot",
            (job, now),
        )

    def job_runs(self, job: str) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM job_runs WHERE job = ? ORDER BY slot", (job,))

    # -- on-call actions ------------------------------------------------------------------------

    def first_callback(self, event_id: str, now: float) -> bool:
        """Record a Feishu callback's event id; False when it was seen before (a replay)."""
        cur = self.execute(
            "INSERT OR IGNORE INTO callbacks_seen (event_id, seen_at) VALUES (?, ?)", (event_id, now)
        )
        return bool(cur.rowcount)

    def add_action(
        self,
        now: float,
        actor: str,
        actor_name: str,
        action: str,
        episode_id: int | None,
        detail: str,
        source: str,
    ) -> int:
        """Audit one on-call action: who (open id and name), what, on which alert, when, from where."""
        cur = self.execute(
            "INSERT INTO actions (at, actor, actor_name, action, episode_id, detail, source) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (now, actor, actor_name, action, episode_id, detail[:2000], source),
        )
        return int(cur.lastrowid)

    def actions_between(self, since: float, until: float) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM actions WHERE at >= ? AND at < ? ORDER BY at, id", (since, until))

    def actions_of(self, episode_id: int) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM actions WHERE episode_id = ? ORDER BY id", (episode_id,))

    def add_escalation(
        self, episode_id: int, step: int, message_id: str, users: list[str], now: float
    ) -> bool:
        """Record escalation `step` of an episode, phoning `users` about the app message
        `message_id` (before anyone is phoned); False when that step exists already."""
        cur = self.execute(
            "INSERT OR IGNORE INTO escalations (episode_id, step, message_id, users, at) "
            "VALUES (?, ?, ?, ?, ?)",
            (episode_id, step, message_id, json.dumps(users), now),
        )
        return bool(cur.rowcount)

    def escalations_of(self, episode_id: int) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM escalations WHERE episode_id = ? ORDER BY step", (episode_id,))

    def firing_unclaimed(self, levels: Sequence[str]) -> list[sqlite3.Row]:
        marks = ", ".join("?" for _ in levels)
        return self.query(
            f"SELECT * FROM episodes WHERE status = 'firing' AND claimed_by IS NULL AND level IN ({marks}) "
            "ORDER BY id",
            tuple(levels),
        )

    # -- retention ----------------------------------------------------------------------------

    def purge(self, before: float) -> dict[str, int]:
        """Delete finished history older than `before`; open work is never deleted."""
        counts = {}
        with self.transaction() as db:
            old = "SELECT id FROM episodes WHERE status = 'resolved' AND COALESCE(ends_at, last_seen) < ?"
            counts["attempts"] = db.execute(
                "DELETE FROM attempts WHERE outbox_id IN (SELECT id FROM outbox WHERE state NOT IN "
                "('pending', 'sending') AND created_at < ?)",
                (before,),
            ).rowcount
            counts["outbox"] = db.execute(
                "DELETE FROM outbox WHERE state NOT IN ('pending', 'sending') AND created_at < ?", (before,)
            ).rowcount
            counts["archive"] = db.execute(
                "DELETE FROM archive WHERE state = 'sent' AND created_at < ?", (before,)
            ).rowcount
            counts["drilldowns"] = db.execute(
                "DELETE FROM drilldowns WHERE state = 'done' AND requested_at < ?", (before,)
            ).rowcount
            counts["episodes"] = db.execute(
                f"DELETE FROM episodes WHERE id IN ({old}) AND id NOT IN "
                "(SELECT episode_id FROM outbox WHERE episode_id IS NOT NULL)",
                (before,),
            ).rowcount
            counts["incidents"] = db.execute(
                "DELETE FROM incidents WHERE closed_at < ? AND id NOT IN "
                "(SELECT incident_id FROM episodes WHERE incident_id IS NOT NULL)",
                (before,),
            ).rowcount
            counts["storms"] = db.execute(
                "DELETE FROM storms WHERE sealed_at < ? AND id NOT IN "
                "(SELECT storm_id FROM episodes WHERE storm_id IS NOT NULL)",
                (before,),
            ).rowcount
            counts["inbox"] = db.execute(
                "DELETE FROM inbox WHERE processed_at IS NOT NULL AND received_at < ?", (before,)
            ).rowcount
            counts["callbacks"] = db.execute(
                "DELETE FROM callbacks_seen WHERE seen_at < ?", (before,)
            ).rowcount
            counts["job_runs"] = db.execute("DELETE FROM job_runs WHERE done_at < ?", (before,)).rowcount
        return counts
