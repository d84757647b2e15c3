"""Incidents (one job's hang and slow alerts at one level, sharing one card) and drill-downs (the
analyzer runs that name an incident's culprit)."""

from __future__ import annotations

from collections.abc import Sequence

from megatrace.alertbot.kinds import DrilldownState
from megatrace.alertbot.store.database import Database
from megatrace.alertbot.store.records import Drilldown, Episode, IncidentRecord, from_row, names


class Incidents:
    def __init__(self, db: Database) -> None:
        self.db = db

    def _incidents(self, sql: str, params: Sequence[object]) -> list[IncidentRecord]:
        return [from_row(IncidentRecord, row) for row in self.db.query(sql, params)]

    def open(self, job: str, level: str) -> IncidentRecord | None:
        found = self._incidents(
            "SELECT * FROM incidents WHERE job = ? AND level = ? AND closed_at IS NULL "
            "ORDER BY id DESC LIMIT 1",
            (job, level),
        )
        return found[0] if found else None

    def create(self, job: str, level: str, lead_episode_id: int, now: float) -> int:
        return self.db.insert(
            "INSERT INTO incidents (job, level, opened_at, lead_episode_id) VALUES (?, ?, ?, ?) RETURNING id",
            (job, level, now, lead_episode_id),
        )

    def get(self, incident_id: int) -> IncidentRecord | None:
        found = self._incidents("SELECT * FROM incidents WHERE id = ?", (incident_id,))
        return found[0] if found else None

    def update(self, incident_id: int, **fields: object) -> None:
        self.db.update("incidents", incident_id, fields, names(IncidentRecord))

    def led_between(self, since: float, until: float) -> list[IncidentRecord]:
        """Incidents whose first alert started in [since, until)."""
        return self._incidents(
            "SELECT i.* FROM incidents i JOIN episodes e ON e.id = i.lead_episode_id "
            "WHERE e.starts_at >= ? AND e.starts_at < ? ORDER BY i.id",
            (since, until),
        )

    def members(self, incident_id: int) -> list[Episode]:
        rows = self.db.query("SELECT * FROM episodes WHERE incident_id = ? ORDER BY id", (incident_id,))
        return [from_row(Episode, row) for row in rows]

    # -- drill-downs --------------------------------------------------------------------------

    def _drilldowns(self, sql: str, params: Sequence[object]) -> list[Drilldown]:
        return [from_row(Drilldown, row) for row in self.db.query(sql, params)]

    def recent_drilldown(self, job: str, alertname: str, since: float) -> Drilldown | None:
        found = self._drilldowns(
            "SELECT * FROM drilldowns WHERE job = ? AND alertname = ? AND requested_at >= ? "
            "ORDER BY id DESC LIMIT 1",
            (job, alertname, since),
        )
        return found[0] if found else None

    def add_drilldown(self, job: str, alertname: str, episode_id: int, now: float) -> int:
        return self.db.insert(
            "INSERT INTO drilldowns (job, alertname, episode_id, requested_at, state) "
            "VALUES (?, ?, ?, ?, ?) RETURNING id",
            (job, alertname, episode_id, now, DrilldownState.PENDING),
        )

    def pending_drilldowns(self) -> list[Drilldown]:
        return self._drilldowns(
            "SELECT * FROM drilldowns WHERE state IN (?, ?) ORDER BY id",
            (DrilldownState.PENDING, DrilldownState.RUNNING),
        )

    def update_drilldown(self, drilldown_id: int, **fields: object) -> None:
        self.db.update("drilldowns", drilldown_id, fields, names(Drilldown))

    def drilldown(self, drilldown_id: int) -> Drilldown | None:
        found = self._drilldowns("SELECT * FROM drilldowns WHERE id = ?", (drilldown_id,))
        return found[0] if found else None
