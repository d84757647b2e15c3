"""From stored webhooks to queued notifications: dedupe → grade → route, one transaction per webhook.

Episodes are keyed by (fingerprint, startsAt). Duplicates (Alertmanager HA) are counted, not sent;
repeats follow the repeat interval; recurrences are counted; flapping alerts are held back; many new
episodes of one kind within the storm window collapse into one summary notification, and their
resolves into one resolved summary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

from megatrace.alertbot.channels import routes
from megatrace.alertbot.config import AlertbotConfig, drilldown_enabled
from megatrace.alertbot.grading import PolicyRule, grade
from megatrace.alertbot.incident import from_labels
from megatrace.alertbot.kinds import EpisodeStatus, NotificationKind, OutboxState
from megatrace.alertbot.metrics import BotMetrics
from megatrace.alertbot.payload import Alert, PayloadError, format_time, parse_webhook
from megatrace.alertbot.store import Store
from megatrace.alertbot.store.records import Episode, IncidentRecord, NewEpisode, NewNotification

log = logging.getLogger(__name__)

ARCHIVE_COLUMNS = (
    "time",
    "level",
    "alert",
    "event",
    "job",
    "instance",
    "summary",
    "started",
    "ended",
    "recurrence",
    "fingerprint",
    "episode",
)


def episode_ref(episode: Episode) -> str:
    """What names an episode's notifications across databases (so the card's ref, and Feishu's
    `uuid`, never repeat for another alert after the bot's state was reset): its identity."""
    return f"{episode.fingerprint}@{episode.starts_at}"


def storm_ref(storm_id: int, opened_at: float) -> str:
    """What names a storm's notifications across databases: its id and when it opened."""
    return f"s{storm_id}@{opened_at}"


def idempotency_key(kind: str, ref: str, channel: str, destination: str) -> str:
    """Stable key (≤ 50 chars) for one notification to one destination; doubles as Feishu's `uuid`."""
    digest = hashlib.sha256(f"{kind}|{ref}|{channel}|{destination}".encode()).hexdigest()
    return f"mt-{digest[:40]}"


@dataclasses.dataclass
class Pipeline:
    store: Store
    cfg: AlertbotConfig
    policy: list[PolicyRule]
    metrics: BotMetrics

    def enqueue(
        self,
        kind: NotificationKind,
        ref: str,
        level: str,
        now: float,
        not_before: float | None = None,
        episode_id: int | None = None,
        storm_id: int | None = None,
    ) -> int:
        """Queue notification `kind` for every destination of `level`; returns how many were queued."""
        queued = 0
        for channel, destination in routes(self.cfg, level):
            new = NewNotification(
                kind=kind,
                channel=channel,
                destination=destination,
                level=level,
                idem_key=idempotency_key(kind, ref, channel, destination),
                created_at=now,
                not_before=now if not_before is None else not_before,
                episode_id=episode_id,
                storm_id=storm_id,
            )
            queued += self.store.outbox.enqueue(new) is not None
        return queued

    def archive(self, episode: Episode, event: str, now: float) -> None:
        if not self.cfg.feishu.sheet.spreadsheet_token:
            return
        labels, annotations = episode.labels, episode.annotations
        row = [
            format_time(now).replace("T", " ")[:19],
            episode.level,
            episode.alertname,
            event,
            labels.get("job", ""),
            labels.get("instance", labels.get("node", "")),
            annotations.get("summary", ""),
            format_time(episode.starts_at),
            format_time(episode.ends_at) if episode.ends_at else "",
            episode.recurrence,
            episode.fingerprint,
            episode.id,
        ]
        self.store.outbox.add_archive(episode.id, event, row, now)

    # -- one alert ------------------------------------------------------------------------------

    def _new_episode(self, alert: Alert, external_url: str, now: float) -> Episode:
        d, g = self.cfg.dedupe, self.cfg.grading
        recurrence = self.store.episodes.count_all(alert.fingerprint)
        recent = self.store.episodes.count_since(alert.fingerprint, now - g.escalate_window_s) + 1
        graded = grade(alert.labels, self.policy, g, recent)
        flapping = (
            self.store.episodes.count_since(alert.fingerprint, now - d.flap_window_s) + 1 >= d.flap_threshold
        )
        status = EpisodeStatus(alert.status)
        episode = self.store.episodes.insert(
            NewEpisode(
                fingerprint=alert.fingerprint,
                starts_at=alert.starts_at,
                alertname=alert.name,
                labels=alert.labels,
                annotations=alert.annotations,
                generator_url=alert.generator_url,
                external_url=external_url,
                status=status,
                severity=alert.labels.get("severity", ""),
                level=graded.level,
                escalated=graded.escalated,
                recurrence=recurrence,
                recent=recent,
                flapping=flapping,
                first_seen=now,
                last_seen=now,
                ends_at=alert.ends_at if status == EpisodeStatus.RESOLVED else None,
            )
        )
        self.metrics.episodes.labels(graded.level).inc()
        return episode

    def _storm_for(self, episode: Episode, now: float) -> int | None:
        """The storm this new firing episode joins, or None when it is notified on its own."""
        d = self.cfg.dedupe
        if d.storm_threshold <= 0 or not routes(self.cfg, episode.level):
            return None
        others = self.store.episodes.count_new_of_kind(
            episode.alertname, episode.level, now - d.storm_window_s
        )
        if others - 1 < d.storm_threshold:
            return None
        storm = self.store.episodes.open_storm(episode.alertname, episode.level)
        if storm is not None:
            return storm.id
        storm_id = self.store.episodes.create_storm(episode.alertname, episode.level, now)
        self.enqueue(
            NotificationKind.STORM,
            storm_ref(storm_id, now),
            episode.level,
            now,
            now + d.storm_hold_s,
            storm_id=storm_id,
        )
        self.metrics.storms.inc()
        log.warning("alert storm: %s at %s, collapsing into one summary", episode.alertname, episode.level)
        return storm_id

    def _firing(self, alert: Alert, external_url: str, now: float) -> None:
        existing = self.store.episodes.find(alert.fingerprint, alert.starts_at)
        if existing is not None:
            self.store.episodes.update(existing.id, last_seen=now, duplicates=existing.duplicates + 1)
            self.metrics.deduplicated.inc()
            last = existing.last_notified
            if (
                existing.status == EpisodeStatus.FIRING
                and last is not None
                and existing.storm_id is None
                and now - last >= self.cfg.dedupe.repeat_interval_s
            ):
                self.store.episodes.update(existing.id, last_notified=now)
                self.enqueue(
                    NotificationKind.REPEAT,
                    f"{existing.id}@{int(now)}",
                    existing.level,
                    now,
                    episode_id=existing.id,
                )
            return
        episode = self._new_episode(alert, external_url, now)
        requested = self._request_drilldown(episode, now)
        incident = self._incident_for(episode, now)
        if incident is not None and incident.lead_episode_id != episode.id:
            self.archive(episode, "firing", now)
            return  # its incident's card is already out or queued
        storm_id = self._storm_for(episode, now)
        self.archive(episode, "firing" if storm_id is None else f"firing in storm s{storm_id}", now)
        if storm_id is not None:
            self.store.episodes.update(episode.id, storm_id=storm_id, last_notified=now)
            return
        hold = self.cfg.dedupe.flap_hold_s if episode.flapping else 0.0
        if incident is not None and requested and from_labels(alert.name, alert.labels) is None:
            hold = max(hold, self.cfg.drilldown.verdict_wait_s)  # the verdict may make it into the card
        if self.enqueue(
            NotificationKind.FIRING,
            episode_ref(episode),
            episode.level,
            now,
            now + hold,
            episode_id=episode.id,
        ):
            self.store.episodes.update(episode.id, last_notified=now)

    def _resolved(self, alert: Alert, external_url: str, now: float) -> None:
        existing = self.store.episodes.find(alert.fingerprint, alert.starts_at)
        if existing is None:  # the firing webhook was lost or arrives later: report the whole episode
            episode = self._new_episode(alert, external_url, now)
            self.archive(episode, "resolved", now)
            if not episode.flapping:
                self.enqueue(
                    NotificationKind.RESOLVED, episode_ref(episode), episode.level, now, episode_id=episode.id
                )
            return
        if existing.status == EpisodeStatus.RESOLVED:
            self.store.episodes.update(existing.id, last_seen=now, duplicates=existing.duplicates + 1)
            self.metrics.deduplicated.inc()
            return
        self.store.episodes.update(
            existing.id, status=EpisodeStatus.RESOLVED, ends_at=alert.ends_at, last_seen=now
        )
        episode = dataclasses.replace(existing, status=EpisodeStatus.RESOLVED, ends_at=alert.ends_at)
        self.archive(episode, "resolved", now)
        held = []
        if existing.flapping:  # a held-back flapping alert that resolved in time is never sent
            pending = self.store.outbox.find(episode_id=existing.id, kind=NotificationKind.FIRING)
            held = [row for row in pending if row.state == OutboxState.PENDING]
        for row in held:
            self.store.outbox.update(
                row.id, state=OutboxState.SUPPRESSED, last_error="resolved before it was sent"
            )
            self.metrics.suppressed.inc()
        if existing.incident_id is not None:  # whether its card went out alone or in a storm
            self._incident_member_resolved(existing.incident_id, now)
        if existing.storm_id is not None:
            self._storm_member_resolved(existing.storm_id, existing.level, now)
        elif existing.incident_id is None and existing.last_notified is not None and not held:
            kind = NotificationKind.RESOLVED
            self.enqueue(kind, episode_ref(existing), existing.level, now, episode_id=existing.id)

    def _storm_member_resolved(self, storm_id: int, level: str, now: float) -> None:
        """A storm gets one resolved summary, queued when its first member resolves and sent
        `storm_resolve_hold_s` later, so members that recover together share it (it lists what
        recovered and what still fires). If it went out while some still fired, the last member to
        resolve queues a final "all recovered" summary. The refs make both idempotent."""
        summaries = self.store.outbox.find(storm_id=storm_id, kind=NotificationKind.STORM_RESOLVED)
        storm = self.store.episodes.storm(storm_id)
        if storm is None:
            return
        if not summaries:
            ref = f"{storm_ref(storm_id, storm.opened_at)}-resolved"
        elif any(row.payload is not None for row in summaries) and not any(
            member.status == EpisodeStatus.FIRING for member in self.store.episodes.storm_members(storm_id)
        ):
            ref = f"{storm_ref(storm_id, storm.opened_at)}-all-resolved"
        else:
            return
        not_before = now + self.cfg.dedupe.storm_resolve_hold_s
        opened = [
            row.not_before for row in self.store.outbox.find(storm_id=storm_id, kind=NotificationKind.STORM)
        ]
        self.enqueue(
            NotificationKind.STORM_RESOLVED, ref, level, now, max([not_before, *opened]), storm_id=storm_id
        )

    def _request_drilldown(self, episode: Episode, now: float) -> bool:
        """Ask for a drill-down of the episode's job; True when one was requested now. A level
        nothing is sent for (report only, e.g. the per-rank P3 hang alerts) has no card to put a
        verdict on, so it gets none."""
        dd = self.cfg.drilldown
        job = episode.labels.get("job", "")
        if episode.alertname not in dd.alerts or not drilldown_enabled(dd) or not job:
            return False
        if not routes(self.cfg, episode.level):
            return False
        if self.store.incidents.recent_drilldown(job, episode.alertname, now - dd.rerun_after_s) is not None:
            return False
        self.store.incidents.add_drilldown(job, episode.alertname, episode.id, now)
        return True

    # -- incidents: a job's hang and slow alerts at one level share one card ----------------------

    def _incident_for(self, episode: Episode, now: float) -> IncidentRecord | None:
        """The incident a new firing episode leads or joins (None: not a hang or slow alert of a job).
        A member naming a culprit the incident's card does not know yet updates that card."""
        job = episode.labels.get("job", "")
        if episode.alertname not in self.cfg.drilldown.alerts or not job:
            return None
        incident = self.store.incidents.open(job, episode.level)
        if incident is None:
            incident_id = self.store.incidents.create(job, episode.level, episode.id, now)
        else:
            incident_id = incident.id
            members = self.store.incidents.members(incident_id)
            known = any(from_labels(m.alertname, m.labels) for m in members)
            if not known and from_labels(episode.alertname, episode.labels) is not None:
                self.incident_changed(incident_id, now, f"rules@{episode.id}")
        self.store.episodes.update(episode.id, incident_id=incident_id)
        return self.store.incidents.get(incident_id)

    def _incident_member_resolved(self, incident_id: int, now: float) -> None:
        """The incident closes when its last member resolves; its cards then show it resolved."""
        if any(m.status == EpisodeStatus.FIRING for m in self.store.incidents.members(incident_id)):
            return
        self.store.incidents.update(incident_id, closed_at=now)
        self.incident_changed(incident_id, now, "resolved")

    def incident_changed(self, incident_id: int, now: float, why: str) -> None:
        """Show an incident's new state (a verdict, a culprit, its resolve) on every card it has:
        a card not rendered yet is sent now and shows the verdict; a rendered one gets one update,
        in place where its channel edits, else as one reply; the resolve always follows the card.
        Run it in the transaction that changed the incident: delivery renders and freezes a card in
        one transaction, so exactly one of the two shows the change."""
        incident = self.store.incidents.get(incident_id)
        if incident is None:
            return
        kind = NotificationKind.RESOLVED if why == "resolved" else NotificationKind.VERDICT
        lead = self.store.episodes.get(incident.lead_episode_id)
        for card in self.store.outbox.find(episode_id=incident.lead_episode_id, kind=NotificationKind.FIRING):
            if card.state in (OutboxState.DEAD, OutboxState.SUPPRESSED):
                continue
            if (
                kind == NotificationKind.VERDICT
                and card.state == OutboxState.PENDING
                and card.payload is None
            ):
                if lead is not None and not lead.flapping:
                    self.store.outbox.update(card.id, not_before=min(card.not_before, now))
                continue
            update = NewNotification(
                kind=kind,
                channel=card.channel,
                destination=card.destination,
                level=card.level,
                idem_key=idempotency_key(kind, f"{card.id}@{why}", card.channel, card.destination),
                created_at=now,
                not_before=now,
                episode_id=incident.lead_episode_id,
                parent_id=card.id,
            )
            self.store.outbox.enqueue(update)

    # -- webhooks -------------------------------------------------------------------------------

    def ingest(self, alerts: list[Alert], external_url: str, now: float, inbox_id: int | None = None) -> int:
        """Apply a batch of alerts (one webhook or one reconciliation) in one transaction; returns how
        many were quarantined. An alert whose processing fails for a reason of its own (not the
        database's) is undone alone and quarantined, so it never blocks the alerts after it."""
        quarantined = 0
        with self.store.transaction():
            for alert in alerts:
                self.metrics.received.inc()
                try:
                    with self.store.savepoint():
                        if alert.status == EpisodeStatus.FIRING:
                            self._firing(alert, external_url, now)
                        else:
                            self._resolved(alert, external_url, now)
                except self.store.errors:
                    raise
                except Exception as exc:
                    reason = f"processing failed: {type(exc).__name__}: {exc}"
                    self.quarantine("webhook", dataclasses.asdict(alert), reason, now, inbox_id)
                    quarantined += 1
        return quarantined

    def quarantine(
        self, source: str, alert: Any, reason: str, now: float, inbox_id: int | None = None
    ) -> None:
        """Set one alert aside: stored with its reason, logged, counted (``/healthz``, ``/metrics``)."""
        self.store.inbox.quarantine(source, alert, reason, now, inbox_id)
        self.metrics.quarantined.inc()
        log.warning("quarantined an alert from %s (inbox %s): %s", source, inbox_id, reason)

    def process_inbox(self, now: float, limit: int = 200) -> int:
        """Process up to `limit` stored, unprocessed webhooks (oldest first); returns how many. The
        bound keeps a long burst from starving delivery: the worker alternates the two. Bodies were
        validated on arrival, but rows stored by an older version may hold alerts that no longer
        pass: those alerts are quarantined, the rest of their webhook is processed."""
        done = 0
        for row in self.store.inbox.unprocessed(limit):
            try:
                webhook = parse_webhook(row.body, lenient=True)
            except PayloadError as exc:
                self.quarantine(row.source, row.body, str(exc), now, row.id)
                self.store.inbox.mark(row.id, now, str(exc))
                continue
            with self.store.transaction():
                if not self.store.inbox.claim(row.id, now):  # another replica processed it
                    continue
                for index, reason, raw in webhook.rejected:
                    self.quarantine(row.source, raw, f"alerts[{index}]: {reason}", now, row.id)
                self.ingest(webhook.alerts, webhook.external_url, now, row.id)
            done += 1
        return done
