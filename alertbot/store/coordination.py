"""What replicas sharing one database agree on: named leases, once-per-cluster job runs, Feishu's
rate windows, Feishu callbacks already seen, and the audit of on-call actions and escalations."""

from __future__ import annotations

import json
from collections.abc import Sequence

from megatrace.alertbot.store.database import Database
from megatrace.alertbot.store.records import Action, Escalation, JobRun, from_row

# One rate window: (name, requests, per seconds).
Window = tuple[str, float, float]


class Coordination:
    def __init__(self, db: Database) -> None:
        self.db = db

    # -- rate windows ---------------------------------------------------------------------------

    def take_rate_slots(self, windows: Sequence[Window], now: float) -> tuple[float, list[int]]:
        """A slot at `now` in every window (name, requests, per seconds) or in none, atomically for
        every replica: (0, the slots' ids) when each has room, else (seconds until all would, [])."""
        with self.db.transaction():
            wait = 0.0
            for name, requests, per in windows:
                key = f"{name}/{per:g}"
                self.db.run("DELETE FROM rate_slots WHERE name = ? AND at <= ?", (key, now - per))
                newest = self.db.query(
                    "SELECT at FROM rate_slots WHERE name = ? ORDER BY at DESC LIMIT ?", (key, int(requests))
                )
                if len(newest) >= requests:
                    wait = max(wait, float(newest[-1]["at"]) + per - now)
            if wait > 0:
                return wait, []
            insert = "INSERT INTO rate_slots (name, at) VALUES (?, ?) RETURNING id"
            return 0.0, [self.db.insert(insert, (f"{name}/{per:g}", now)) for name, _, per in windows]

    def settle_rate_slots(self, ids: Sequence[int], at: float) -> None:
        """Count the slots `ids` as taken at `at` (when their request finished)."""
        if ids:
            marks = ", ".join("?" for _ in ids)
            self.db.run(f"UPDATE rate_slots SET at = ? WHERE id IN ({marks})", (at, *ids))

    # -- leases and job runs --------------------------------------------------------------------

    def hold_lease(self, name: str, owner: str, now: float, ttl: float) -> bool:
        """Take or renew the named lease for `owner` until ``now + ttl``; False while another owner
        holds it unexpired."""
        with self.db.transaction():
            row = self.db.one("SELECT owner, until FROM leases WHERE name = ?", (name,))
            if row is None:
                sql = "INSERT INTO leases (name, owner, until) VALUES (?, ?, ?)"
                self.db.run(sql, (name, owner, now + ttl))
                return True
            if row["owner"] != owner and row["until"] >= now:
                return False
            sql = "UPDATE leases SET owner = ?, until = ? WHERE name = ?"
            self.db.run(sql, (owner, now + ttl, name))
            return True

    def release_lease(self, name: str, owner: str) -> None:
        """Give the named lease up (a replica stopping), so another takes it at once."""
        self.db.run("DELETE FROM leases WHERE name = ? AND owner = ?", (name, owner))

    def claim_run(self, job: str, slot: str, owner: str, now: float, ttl: float) -> bool:
        """Claim one run of `job` for `slot` (a period): True for the first claimant, and for a
        later one when the run was never finished and its claimant's lease expired."""
        with self.db.transaction():
            row = self.db.one(
                "SELECT owner, lease_until, done_at FROM job_runs WHERE job = ? AND slot = ?", (job, slot)
            )
            if row is None:
                self.db.run(
                    "INSERT INTO job_runs (job, slot, owner, started_at, lease_until) VALUES (?, ?, ?, ?, ?)",
                    (job, slot, owner, now, now + ttl),
                )
                return True
            if row["done_at"] is not None or (row["owner"] != owner and row["lease_until"] >= now):
                return False
            self.db.run(
                "UPDATE job_runs SET owner = ?, lease_until = ? WHERE job = ? AND slot = ?",
                (owner, now + ttl, job, slot),
            )
            return True

    def finish_run(self, job: str, slot: str, now: float) -> None:
        self.db.run("UPDATE job_runs SET done_at = ? WHERE job = ? AND slot = ?", (now, job, slot))

    def unfinished_runs(self, job: str, now: float) -> list[JobRun]:
        """Runs of `job` claimed but never finished whose lease expired (their replica died)."""
        rows = self.db.query(
            "SELECT * FROM job_runs WHERE job = ? AND done_at IS NULL AND lease_until < ? ORDER BY slot",
            (job, now),
        )
        return [from_row(JobRun, row) for row in rows]

    def job_runs(self, job: str) -> list[JobRun]:
        rows = self.db.query("SELECT * FROM job_runs WHERE job = ? ORDER BY slot", (job,))
        return [from_row(JobRun, row) for row in rows]

    # -- on-call actions ------------------------------------------------------------------------

    def first_callback(self, event_id: str, now: float) -> bool:
        """Record a Feishu callback's event id; False when it was seen before (a replay)."""
        return (
            self.db.run(
                "INSERT INTO callbacks_seen (event_id, seen_at) VALUES (?, ?) ON CONFLICT DO NOTHING",
                (event_id, now),
            )
            == 1
        )

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
        return self.db.insert(
            "INSERT INTO actions (at, actor, actor_name, action, episode_id, detail, source) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
            (now, actor, actor_name, action, episode_id, detail[:2000], source),
        )

    def actions_between(self, since: float, until: float) -> list[Action]:
        sql = "SELECT * FROM actions WHERE at >= ? AND at < ? ORDER BY at, id"
        return [from_row(Action, row) for row in self.db.query(sql, (since, until))]

    def actions_of(self, episode_id: int) -> list[Action]:
        sql = "SELECT * FROM actions WHERE episode_id = ? ORDER BY id"
        return [from_row(Action, row) for row in self.db.query(sql, (episode_id,))]

    def add_escalation(
        self, episode_id: int, step: int, message_id: str, users: list[str], now: float
    ) -> bool:
        """Record escalation `step` of an episode, phoning `users` about the app message
        `message_id` (before anyone is phoned); False when that step exists already."""
        return (
            self.db.run(
                "INSERT INTO escalations (episode_id, step, message_id, users, at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (episode_id, step, message_id, json.dumps(users), now),
            )
            == 1
        )

    def escalations_of(self, episode_id: int) -> list[Escalation]:
        sql = "SELECT * FROM escalations WHERE episode_id = ? ORDER BY step"
        return [from_row(Escalation, row) for row in self.db.query(sql, (episode_id,))]
