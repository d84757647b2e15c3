"""The bot's schema as numbered migrations, applied in order; each database records the version it
is at (``schema_version``). A migration is never edited once released: a change is a new one.

Column types are written ``{id}``, ``{integer}`` and ``{real}``; the dialect fills them in.
"""

from __future__ import annotations

MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE inbox (
        id {id}, received_at {real} NOT NULL, source TEXT NOT NULL, body TEXT NOT NULL,
        processed_at {real}, error TEXT);
    CREATE INDEX inbox_pending ON inbox(processed_at);
    CREATE TABLE episodes (
        id {id}, fingerprint TEXT NOT NULL, starts_at {real} NOT NULL,
        alertname TEXT NOT NULL, labels TEXT NOT NULL, annotations TEXT NOT NULL,
        generator_url TEXT NOT NULL, external_url TEXT NOT NULL, status TEXT NOT NULL,
        severity TEXT NOT NULL, level TEXT NOT NULL, escalated {integer} NOT NULL DEFAULT 0,
        recurrence {integer} NOT NULL DEFAULT 0, recent {integer} NOT NULL DEFAULT 0,
        flapping {integer} NOT NULL DEFAULT 0, storm_id {integer},
        first_seen {real} NOT NULL, last_seen {real} NOT NULL, ends_at {real}, last_notified {real},
        duplicates {integer} NOT NULL DEFAULT 0,
        UNIQUE (fingerprint, starts_at));
    CREATE INDEX episodes_fingerprint ON episodes(fingerprint, first_seen);
    CREATE INDEX episodes_kind ON episodes(alertname, level, first_seen);
    CREATE INDEX episodes_status ON episodes(status);
    CREATE TABLE storms (
        id {id}, alertname TEXT NOT NULL, level TEXT NOT NULL,
        opened_at {real} NOT NULL, sealed_at {real});
    CREATE TABLE outbox (
        id {id}, kind TEXT NOT NULL, episode_id {integer}, storm_id {integer},
        drilldown_id {integer}, parent_id {integer}, channel TEXT NOT NULL, destination TEXT NOT NULL,
        level TEXT NOT NULL, state TEXT NOT NULL, idem_key TEXT NOT NULL UNIQUE,
        created_at {real} NOT NULL, not_before {real} NOT NULL, attempts {integer} NOT NULL DEFAULT 0,
        last_error TEXT, payload TEXT, message_id TEXT, sent_at {real});
    CREATE INDEX outbox_due ON outbox(state, not_before);
    CREATE TABLE attempts (
        id {id}, outbox_id {integer} NOT NULL, started_at {real} NOT NULL,
        finished_at {real}, outcome TEXT, detail TEXT);
    CREATE INDEX attempts_outbox ON attempts(outbox_id);
    CREATE TABLE archive (
        id {id}, episode_id {integer} NOT NULL, event TEXT NOT NULL, row TEXT NOT NULL,
        state TEXT NOT NULL, created_at {real} NOT NULL, attempts {integer} NOT NULL DEFAULT 0,
        last_error TEXT);
    CREATE INDEX archive_state ON archive(state);
    CREATE TABLE drilldowns (
        id {id}, job TEXT NOT NULL, alertname TEXT NOT NULL, episode_id {integer} NOT NULL,
        requested_at {real} NOT NULL, state TEXT NOT NULL, result TEXT, finished_at {real});
    CREATE INDEX drilldowns_job ON drilldowns(job, requested_at);
    """,
    """
    CREATE TABLE quarantine (
        id {id}, quarantined_at {real} NOT NULL, source TEXT NOT NULL,
        inbox_id {integer}, alert TEXT NOT NULL, reason TEXT NOT NULL);
    """,
    """
    ALTER TABLE outbox ADD COLUMN lease_owner TEXT;
    ALTER TABLE outbox ADD COLUMN lease_until {real};
    ALTER TABLE episodes ADD COLUMN claimed_by TEXT;
    ALTER TABLE episodes ADD COLUMN claimed_at {real};
    ALTER TABLE episodes ADD COLUMN silence_id TEXT;
    ALTER TABLE episodes ADD COLUMN silenced_until {real};
    CREATE TABLE leases (name TEXT PRIMARY KEY, owner TEXT NOT NULL, until {real} NOT NULL);
    CREATE TABLE job_runs (
        job TEXT NOT NULL, slot TEXT NOT NULL, owner TEXT NOT NULL, started_at {real} NOT NULL,
        lease_until {real} NOT NULL, done_at {real}, PRIMARY KEY (job, slot));
    CREATE TABLE actions (
        id {id}, at {real} NOT NULL, actor TEXT NOT NULL, actor_name TEXT NOT NULL,
        action TEXT NOT NULL, episode_id {integer}, detail TEXT NOT NULL, source TEXT NOT NULL);
    CREATE INDEX actions_at ON actions(at);
    CREATE TABLE callbacks_seen (event_id TEXT PRIMARY KEY, seen_at {real} NOT NULL);
    CREATE TABLE escalations (
        id {id}, episode_id {integer} NOT NULL, step {integer} NOT NULL, message_id TEXT NOT NULL,
        users TEXT NOT NULL, at {real} NOT NULL, UNIQUE (episode_id, step));
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
        id {id}, job TEXT NOT NULL, level TEXT NOT NULL, opened_at {real} NOT NULL,
        closed_at {real}, lead_episode_id {integer} NOT NULL, verdict TEXT, verdict_at {real});
    CREATE INDEX incidents_open ON incidents(job, level, closed_at);
    ALTER TABLE episodes ADD COLUMN incident_id {integer};
    """,
    # Feishu's rate windows, shared by the replicas of one database (`ratelimit.SharedRateLimiter`).
    """
    CREATE TABLE rate_slots (id {id}, name TEXT NOT NULL, at {real} NOT NULL);
    CREATE INDEX rate_slots_name ON rate_slots(name, at);
    """,
)
