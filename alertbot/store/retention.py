"""Retention: finished history older than a cutoff is deleted; open work never is."""

from __future__ import annotations

from megatrace.alertbot.kinds import FINISHED_EPISODES, OPEN_STATES, ArchiveState, DrilldownState
from megatrace.alertbot.store.database import Database


def _marks(values: tuple[str, ...]) -> str:
    return ", ".join("?" for _ in values)


def purge(db: Database, before: float) -> dict[str, int]:
    """Delete finished history older than `before` (episodes that resolved or were quarantined, sent
    notifications, archived rows, finished drill-downs and job runs); returns the rows deleted per table."""
    finished = (
        f"SELECT id FROM episodes WHERE status IN ({_marks(FINISHED_EPISODES)}) "
        "AND COALESCE(ends_at, last_seen) < ?"
    )
    closed_outbox = f"state NOT IN ({_marks(OPEN_STATES)}) AND created_at < ?"
    statements: dict[str, tuple[str, tuple[object, ...]]] = {
        "attempts": (
            f"DELETE FROM attempts WHERE outbox_id IN (SELECT id FROM outbox WHERE {closed_outbox})",
            (*OPEN_STATES, before),
        ),
        "outbox": (f"DELETE FROM outbox WHERE {closed_outbox}", (*OPEN_STATES, before)),
        "archive": ("DELETE FROM archive WHERE state = ? AND created_at < ?", (ArchiveState.SENT, before)),
        "drilldowns": (
            "DELETE FROM drilldowns WHERE state = ? AND requested_at < ?",
            (DrilldownState.DONE, before),
        ),
        "episodes": (
            f"DELETE FROM episodes WHERE id IN ({finished}) AND id NOT IN "
            "(SELECT episode_id FROM outbox WHERE episode_id IS NOT NULL)",
            (*FINISHED_EPISODES, before),
        ),
        "incidents": (
            "DELETE FROM incidents WHERE closed_at < ? AND id NOT IN "
            "(SELECT incident_id FROM episodes WHERE incident_id IS NOT NULL)",
            (before,),
        ),
        "storms": (
            "DELETE FROM storms WHERE sealed_at < ? AND id NOT IN "
            "(SELECT storm_id FROM episodes WHERE storm_id IS NOT NULL)",
            (before,),
        ),
        "inbox": ("DELETE FROM inbox WHERE processed_at IS NOT NULL AND received_at < ?", (before,)),
        "callbacks": ("DELETE FROM callbacks_seen WHERE seen_at < ?", (before,)),
        "job_runs": ("DELETE FROM job_runs WHERE done_at < ?", (before,)),
    }
    with db.transaction():
        return {table: db.run(sql, params) for table, (sql, params) in statements.items()}
