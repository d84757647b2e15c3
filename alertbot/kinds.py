"""Every state and kind the alert bot stores or passes between its layers, as `StrEnum`s.

The values are the strings the database has always held, so rows written by earlier versions read
back unchanged; comparing a member with a stored string works because a `StrEnum` is a `str`.
"""

from __future__ import annotations

from enum import StrEnum


class EpisodeStatus(StrEnum):
    """Where one alert episode (fingerprint, startsAt) stands."""

    FIRING = "firing"
    RESOLVED = "resolved"
    # Alertmanager no longer knows it and the bot could not tell how it ended (see `alertmanager`).
    QUARANTINED = "quarantined"


FINISHED_EPISODES = (EpisodeStatus.RESOLVED, EpisodeStatus.QUARANTINED)


class NotificationKind(StrEnum):
    """What a queued notification says."""

    FIRING = "firing"
    REPEAT = "repeat"
    RESOLVED = "resolved"
    STORM = "storm"
    STORM_RESOLVED = "storm-resolved"
    CARD_UPDATE = "card-update"
    VERDICT = "verdict"
    URGENT = "urgent"
    REPORT = "report"
    REPORT_FILE = "report-file"


# A page: what an on-call person is phoned about. A card shows these as its alert firing.
PAGE_KINDS = (NotificationKind.FIRING, NotificationKind.STORM)
CARD_KINDS = (NotificationKind.FIRING, NotificationKind.REPEAT)
# A new state of a card sent before (with its `parent_id`), not a message of its own.
UPDATE_KINDS = (NotificationKind.CARD_UPDATE, NotificationKind.VERDICT, NotificationKind.RESOLVED)


class OutboxState(StrEnum):
    """Where one queued notification stands."""

    PENDING = "pending"
    SENDING = "sending"  # an attempt started (leased to its sender)
    SENT = "sent"
    DEAD = "dead"  # given up: attempts exhausted, a fatal answer, or nothing left to render
    SUPPRESSED = "suppressed"  # never to be sent (held back and overtaken)
    IN_DOUBT = "in-doubt"  # a send that must not be repeated and could not be confirmed


OPEN_STATES = (OutboxState.PENDING, OutboxState.SENDING)


class Outcome(StrEnum):
    """How one delivery attempt ended."""

    SENT = "sent"
    RETRY = "retry"  # a transient failure: try again after a backoff
    FATAL = "fatal"  # this request will never succeed
    INTERRUPTED = "interrupted"  # the process stopped in the middle of it


class AfterCrash(StrEnum):
    """What a channel says of a send its process stopped in the middle of."""

    SENT = "sent"  # it arrived
    RESEND = "resend"
    ABANDON = "abandon"  # it must not be repeated and cannot be confirmed


class ArchiveState(StrEnum):
    """Where one row for the Feishu sheet archive stands."""

    PENDING = "pending"
    SENDING = "sending"
    SENT = "sent"
    DEAD = "dead"


class DrilldownState(StrEnum):
    """Where one analyzer run for an alert's job stands."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class IncidentKind(StrEnum):
    """What a job's incident is about."""

    HANG = "hang"
    SLOW = "slow"
