"""Alert episodes (one alert from its startsAt to its resolve) and storms (many new episodes of one
alert and level, notified as one summary)."""

from __future__ import annotations

from collections.abc import Sequence

from megatrace.alertbot.kinds import EpisodeStatus
from megatrace.alertbot.store.database import Database
from megatrace.alertbot.store.records import Episode, NewEpisode, Storm, columns, from_row, names


class Episodes:
    def __init__(self, db: Database) -> None:
        self.db = db

    def _all(self, sql: str, params: Sequence[object] = ()) -> list[Episode]:
        return [from_row(Episode, row) for row in self.db.query(sql, params)]

    def _first(self, sql: str, params: Sequence[object] = ()) -> Episode | None:
        row = self.db.one(sql, params)
        return None if row is None else from_row(Episode, row)

    def get(self, episode_id: int) -> Episode | None:
        return self._first("SELECT * FROM episodes WHERE id = ?", (episode_id,))

    def find(self, fingerprint: str, starts_at: float) -> Episode | None:
        sql = "SELECT * FROM episodes WHERE fingerprint = ? AND starts_at = ?"
        return self._first(sql, (fingerprint, starts_at))

    def count_since(self, fingerprint: str, since: float) -> int:
        sql = "SELECT COUNT(*) AS n FROM episodes WHERE fingerprint = ? AND first_seen >= ?"
        return self.db.count(sql, (fingerprint, since))

    def count_all(self, fingerprint: str) -> int:
        return self.db.count("SELECT COUNT(*) AS n FROM episodes WHERE fingerprint = ?", (fingerprint,))

    def count_new_of_kind(self, alertname: str, level: str, since: float) -> int:
        return self.db.count(
            "SELECT COUNT(*) AS n FROM episodes WHERE alertname = ? AND level = ? AND first_seen >= ?",
            (alertname, level, since),
        )

    def insert(self, new: NewEpisode) -> Episode:
        fields = columns(new)
        marks = ", ".join("?" for _ in fields)
        sql = f"INSERT INTO episodes ({', '.join(fields)}) VALUES ({marks}) RETURNING id"
        with self.db.transaction():
            episode = self.get(self.db.insert(sql, tuple(fields.values())))
        if episode is None:
            raise LookupError("an episode just inserted is not there")
        return episode

    def update(self, episode_id: int, **fields: object) -> None:
        self.db.update("episodes", episode_id, fields, names(Episode))

    def begin_silence(self, episode_id: int, marker: str, now: float, until: float) -> bool:
        """Mark the alert as being silenced (``silence_id`` = `marker` until `until`) unless a
        silence of it is active or being made: True for the one caller that may create it."""
        return (
            self.db.run(
                "UPDATE episodes SET silence_id = ?, silenced_until = ? WHERE id = ? "
                "AND (silence_id IS NULL OR silenced_until IS NULL OR silenced_until <= ?)",
                (marker, until, episode_id, now),
            )
            == 1
        )

    def firing(self) -> list[Episode]:
        return self._all("SELECT * FROM episodes WHERE status = ? ORDER BY id", (EpisodeStatus.FIRING,))

    def firing_unclaimed(self, levels: Sequence[str]) -> list[Episode]:
        marks = ", ".join("?" for _ in levels)
        return self._all(
            f"SELECT * FROM episodes WHERE status = ? AND claimed_by IS NULL AND level IN ({marks}) "
            "ORDER BY id",
            (EpisodeStatus.FIRING, *levels),
        )

    def between(self, since: float, until: float) -> list[Episode]:
        return self._all(
            "SELECT * FROM episodes WHERE starts_at >= ? AND starts_at < ? ORDER BY starts_at, id",
            (since, until),
        )

    # -- storms -------------------------------------------------------------------------------

    def storm_members(self, storm_id: int) -> list[Episode]:
        return self._all("SELECT * FROM episodes WHERE storm_id = ? ORDER BY id", (storm_id,))

    def open_storm(self, alertname: str, level: str) -> Storm | None:
        row = self.db.one(
            "SELECT * FROM storms WHERE alertname = ? AND level = ? AND sealed_at IS NULL "
            "ORDER BY id DESC LIMIT 1",
            (alertname, level),
        )
        return None if row is None else from_row(Storm, row)

    def create_storm(self, alertname: str, level: str, now: float) -> int:
        sql = "INSERT INTO storms (alertname, level, opened_at) VALUES (?, ?, ?) RETURNING id"
        return self.db.insert(sql, (alertname, level, now))

    def seal_storm(self, storm_id: int, now: float) -> None:
        self.db.run("UPDATE storms SET sealed_at = ? WHERE id = ? AND sealed_at IS NULL", (now, storm_id))

    def storm(self, storm_id: int) -> Storm | None:
        row = self.db.one("SELECT * FROM storms WHERE id = ?", (storm_id,))
        return None if row is None else from_row(Storm, row)
