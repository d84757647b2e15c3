"""What the store returns: one frozen dataclass per kind of row, with the stored states as enums and
JSON columns decoded, and `NewNotification`, the one way a notification is put in the outbox.

`from_row` builds any of them from a database row by field name, so a column added by a migration is
a field added here.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from enum import StrEnum
from typing import Any, TypeVar

from megatrace.alertbot.kinds import (
    UPDATE_KINDS,
    ArchiveState,
    DrilldownState,
    EpisodeStatus,
    NotificationKind,
    OutboxState,
    Outcome,
)

R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class InboxItem:
    """One webhook body as received, before it is processed."""

    id: int
    received_at: float
    source: str
    body: str
    processed_at: float | None
    error: str | None


@dataclasses.dataclass(frozen=True)
class Quarantined:
    """An alert set aside because it could not be processed, with the reason."""

    id: int
    quarantined_at: float
    source: str
    inbox_id: int | None
    alert: str
    reason: str


@dataclasses.dataclass(frozen=True)
class NewEpisode:
    """An episode seen for the first time, as the pipeline graded it."""

    fingerprint: str
    starts_at: float
    alertname: str
    labels: dict[str, str]
    annotations: dict[str, str]
    generator_url: str
    external_url: str
    status: EpisodeStatus
    severity: str
    level: str
    escalated: bool
    recurrence: int
    recent: int
    flapping: bool
    first_seen: float
    last_seen: float
    ends_at: float | None


@dataclasses.dataclass(frozen=True)
class Episode(NewEpisode):
    """One alert episode as stored: what the pipeline graded it (`NewEpisode`), its id, and what
    happened to it since (its storm or incident, notifications, duplicates, claim and silence)."""

    id: int
    storm_id: int | None
    last_notified: float | None
    duplicates: int
    claimed_by: str | None
    claimed_at: float | None
    silence_id: str | None
    silenced_until: float | None
    incident_id: int | None

    @property
    def job(self) -> str:
        return self.labels.get("job", "")


@dataclasses.dataclass(frozen=True)
class Storm:
    """Many new episodes of one alert and level, notified as one summary."""

    id: int
    alertname: str
    level: str
    opened_at: float
    sealed_at: float | None


@dataclasses.dataclass(frozen=True)
class IncidentRecord:
    """One job's hang and slow alerts at one level, sharing one card that names the culprit."""

    id: int
    job: str
    level: str
    opened_at: float
    closed_at: float | None
    lead_episode_id: int
    verdict: str | None
    verdict_at: float | None


@dataclasses.dataclass(frozen=True)
class Drilldown:
    """One analyzer run over an alert's job; `result` is the report as JSON once done."""

    id: int
    job: str
    alertname: str
    episode_id: int
    requested_at: float
    state: DrilldownState
    result: str | None
    finished_at: float | None


@dataclasses.dataclass(frozen=True)
class Outbox:
    """One notification to one destination through one channel, and how its delivery stands."""

    id: int
    kind: NotificationKind
    episode_id: int | None
    storm_id: int | None
    drilldown_id: int | None
    parent_id: int | None
    channel: str
    destination: str
    level: str
    state: OutboxState
    idem_key: str
    created_at: float
    not_before: float
    attempts: int
    last_error: str | None
    payload: str | None
    message_id: str | None
    sent_at: float | None
    lease_owner: str | None
    lease_until: float | None

    @property
    def is_update(self) -> bool:
        """Whether it shows a new state of a card sent before (its `parent_id`), not a message."""
        return self.parent_id is not None and self.kind in UPDATE_KINDS


@dataclasses.dataclass(frozen=True)
class UnfinishedSend:
    """A notification whose last attempt started and never recorded a result (its process died)."""

    outbox: Outbox
    attempt_id: int
    attempt_started: float


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One try at sending an outbox row."""

    id: int
    outbox_id: int
    started_at: float
    finished_at: float | None
    outcome: Outcome | None
    detail: str | None


@dataclasses.dataclass(frozen=True)
class ArchiveRow:
    """One row for the Feishu sheet archive (the cells as a list)."""

    id: int
    episode_id: int
    event: str
    row: list[Any]
    state: ArchiveState
    created_at: float
    attempts: int
    last_error: str | None


@dataclasses.dataclass(frozen=True)
class JobRun:
    """One claimed run of a scheduled job for one slot (a period)."""

    job: str
    slot: str
    owner: str
    started_at: float
    lease_until: float
    done_at: float | None


@dataclasses.dataclass(frozen=True)
class Action:
    """One on-call action, audited: who, what, on which alert, when, from where."""

    id: int
    at: float
    actor: str
    actor_name: str
    action: str
    episode_id: int | None
    detail: str
    source: str


@dataclasses.dataclass(frozen=True)
class Escalation:
    """One escalation step of an episode: whom it phoned about which app message."""

    id: int
    episode_id: int
    step: int
    message_id: str
    users: list[str]
    at: float


@dataclasses.dataclass(frozen=True)
class NewNotification:
    """A notification to queue. `idem_key` makes queuing it twice a no-op; `payload` is the message
    already frozen (JSON), when it is known at queuing time (reports, urgent calls)."""

    kind: NotificationKind
    channel: str
    destination: str
    level: str
    idem_key: str
    created_at: float
    not_before: float
    episode_id: int | None = None
    storm_id: int | None = None
    drilldown_id: int | None = None
    parent_id: int | None = None
    payload: str | None = None


_CONVERTERS: dict[type, tuple[tuple[str, Callable[[Any], Any]], ...]] = {}


def _converters(cls: type) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """Each field's name and converter, worked out once per record class."""
    found = _CONVERTERS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = tuple((field.name, _converter(hints[field.name])) for field in dataclasses.fields(cls))
        _CONVERTERS[cls] = found
    return found


def _converter(hint: Any) -> Callable[[Any], Any]:
    """How a stored value becomes the field's type: enums by value, 0/1 as bool, JSON text decoded."""
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    target = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if isinstance(target, type) and issubclass(target, StrEnum):
        return lambda value: None if value is None else target(value)
    if target is bool:
        return bool
    if typing.get_origin(target) in (dict, list):
        return lambda value: json.loads(value) if isinstance(value, str) else value
    return lambda value: value


def columns(record: object) -> dict[str, object]:
    """A new record's fields as stored: enums by value, booleans as 0/1, dicts and lists as JSON."""
    stored: dict[str, object] = {}
    for field in dataclasses.fields(record):  # type: ignore[arg-type]
        value = getattr(record, field.name)
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, dict | list):
            value = json.dumps(value, sort_keys=True, ensure_ascii=False)
        stored[field.name] = value
    return stored


def names(cls: type) -> tuple[str, ...]:
    """The columns of the table `cls` is read from."""
    return tuple(field.name for field in dataclasses.fields(cls))


class Row(typing.Protocol):
    """A database row, read by column name."""

    def __getitem__(self, key: str, /) -> Any: ...


def from_row(cls: type[R], row: Row) -> R:
    """The record `cls` made of a database row (a mapping of column names to values)."""
    return cls(**{name: convert(row[name]) for name, convert in _converters(cls)})
