"""On-call actions taken from a card: claim, silence (1 h / 4 h / 24 h) and unsilence through
Alertmanager's API v2, and notes. Only people on the roster may act; each action is audited in the
database (``actions``) and as a sheet row, and the card is updated in place for everyone.

`Actions.handle` takes a ``card.action.trigger`` callback (schema 2.0) already authenticated by its
transport (`callbacks`) and answers what Feishu shows the clicker (a toast).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from megatrace.alertbot.alertmanager import (
    AlertmanagerError,
    create_silence,
    exclusive_matchers,
    expire_silence,
    list_silences,
)
from megatrace.alertbot.cards import CardRenderer
from megatrace.alertbot.channels import CHANNELS
from megatrace.alertbot.config import AlertbotConfig, Person
from megatrace.alertbot.kinds import CARD_KINDS, NotificationKind, OutboxState
from megatrace.alertbot.oncall import roster_member
from megatrace.alertbot.pipeline import Pipeline
from megatrace.alertbot.store import Store
from megatrace.alertbot.store.records import Episode, NewNotification

log = logging.getLogger(__name__)
SILENCES = {"1h": 3600, "4h": 4 * 3600, "24h": 86400}
CALLBACK_AM_TIMEOUT_S = 2.0  # Feishu waits 3 s for the callback's answer
# `silence_id` while one click creates the silence; other clicks meanwhile make none. It lapses
# after the Alertmanager calls' timeouts, should the replica die in between.
SILENCING = "(being created)"
SILENCING_S = 4 * CALLBACK_AM_TIMEOUT_S
LIVE = ("active", "pending")  # silence states that still mute


class ActionRefused(Exception):
    """The action cannot be taken (the toast says why); nothing was changed."""


def toast(kind: str, text: str) -> dict[str, Any]:
    return {"toast": {"type": kind, "content": text}}


def oncall_context(store: Store, renderer: CardRenderer, episode: Episode, now: float) -> dict[str, Any]:
    """The card's on-call part: who claimed it and whether it is silenced, and the buttons."""
    ref = {"episode": episode.id}
    status = []
    if episode.claimed_by:
        status.append(f"**Claimed** by {episode.claimed_by} at {renderer.when(episode.claimed_at)}")
    silenced = episode.silence_id not in (None, SILENCING) and (episode.silenced_until or 0) > now
    if silenced:
        status.append(f"**Silenced** until {renderer.when(episode.silenced_until)}")
    buttons = []
    if not episode.claimed_by:
        buttons.append({"text": "Claim", "type": "primary", "value": {**ref, "action": "claim"}})
    if silenced:
        buttons.append({"text": "Unsilence", "type": "default", "value": {**ref, "action": "unsilence"}})
    else:
        buttons += [
            {"text": f"Silence {d}", "type": "danger", "value": {**ref, "action": "silence", "duration": d}}
            for d in SILENCES
        ]
    return {
        "status": " · ".join(status) or "Not claimed yet",
        "buttons": buttons,
        "note_value": {**ref, "action": "note"},
    }


@dataclasses.dataclass
class Actions:
    store: Store
    cfg: AlertbotConfig
    pipeline: Pipeline
    wake: Callable[[], None]

    def handle(self, callback: dict[str, Any], source: str, now: float) -> dict[str, Any]:
        """Apply one card action; the answer is the toast Feishu shows. Refusals change nothing
        but the record of the callback's event id, and are logged."""
        header = callback.get("header") or {}
        event = callback.get("event") or {}
        operator = (event.get("operator") or {}).get("open_id", "")
        action = event.get("action") or {}
        raw = action.get("value")
        value: dict[str, Any] = raw if isinstance(raw, dict) else {}
        person = roster_member(self.cfg.oncall, operator)
        if person is None:
            log.warning("card action %r from %s refused: not on the on-call roster", value, operator or "?")
            return toast("error", "Only people on the on-call roster can act on alerts.")
        event_id = str(header.get("event_id", ""))
        if not event_id or not self.store.coordination.first_callback(event_id, now):
            log.warning("card action %s refused: event %r seen before (replay)", value, event_id)
            return toast("error", "This action was already received.")
        try:
            episode = self.store.episodes.get(int(value.get("episode", 0)))
            if episode is None:
                raise ActionRefused("this alert is no longer known")
            card = str((event.get("context") or {}).get("open_message_id") or "")
            if not self.on_its_card(episode, card):
                raise ActionRefused(f"message {card[:64]!r} is not a card of this alert")
            handler = HANDLERS.get(str(value.get("action")))
            if handler is None:
                raise ActionRefused(f"unknown action {value.get('action')!r}")
            done = handler(self, person, episode, value, action, now)
        except ActionRefused as exc:
            log.warning("card action %s by %s refused: %s", value, person.name, exc)
            return toast("error", str(exc))
        self.record(person, str(value["action"]), episode, done, source, now)
        return toast("success", done)

    def on_its_card(self, episode: Episode, message_id: str) -> bool:
        """Whether message `message_id` is a card the bot sent for `episode` or for its incident."""
        shown = self.store.outbox.card_episodes(message_id) if message_id else []
        if episode.id in shown:
            return True
        incident = episode.incident_id
        return incident is not None and any(
            (other := self.store.episodes.get(e)) is not None and other.incident_id == incident for e in shown
        )

    def record(
        self, person: Person, action: str, episode: Episode, detail: str, source: str, now: float
    ) -> None:
        """Audit the action, archive it as a sheet row, and queue the card update."""
        with self.store.transaction():
            action_id = self.store.coordination.add_action(
                now, person.open_id, person.name, action, episode.id, detail, source
            )
            self.pipeline.archive(episode, f"{action} by {person.name}: {detail}", now)
            for card in self.store.outbox.find(episode_id=episode.id, state=OutboxState.SENT):
                if CHANNELS[card.channel].takes_actions and card.kind in CARD_KINDS and card.message_id:
                    update = NewNotification(
                        kind=NotificationKind.CARD_UPDATE,
                        channel=card.channel,
                        destination=card.destination,
                        level=episode.level,
                        idem_key=f"mt-update-{card.id}-{action_id}",
                        created_at=now,
                        not_before=now,
                        episode_id=episode.id,
                        parent_id=card.id,
                    )
                    self.store.outbox.enqueue(update)
        log.info("%s: %s on alert %s (%s)", person.name, detail, episode.id, episode.alertname)
        self.wake()

    # -- the actions ----------------------------------------------------------------------------

    def claim(self, person: Person, episode: Episode, value: dict, action: dict, now: float) -> str:
        if episode.claimed_by:
            raise ActionRefused(f"already claimed by {episode.claimed_by}")
        self.store.episodes.update(episode.id, claimed_by=person.name, claimed_at=now)
        return "claimed"

    def silence(self, person: Person, episode: Episode, value: dict, action: dict, now: float) -> str:
        """One silence per alert however many clicks: the click that marks the alert as being
        silenced creates it; the others are told it is silenced (or being silenced) already."""
        seconds = SILENCES.get(str(value.get("duration")))
        if seconds is None:
            raise ActionRefused(f"silence duration must be one of {', '.join(SILENCES)}")
        if not self.store.episodes.begin_silence(episode.id, SILENCING, now, now + SILENCING_S):
            current = self.store.episodes.get(episode.id)
            if current is not None and current.silence_id == SILENCING:
                raise ActionRefused("a silence of this alert is being created")
            raise ActionRefused(f"already silenced (silence {current.silence_id if current else '?'})")
        labels = episode.labels
        am = dataclasses.replace(self.cfg.alertmanager, timeout_s=CALLBACK_AM_TIMEOUT_S)
        try:
            absent = exclusive_matchers(am, labels)
            silence_id = create_silence(am, labels, now, now + seconds, person.name, comment(episode), absent)
        except AlertmanagerError as exc:
            self.store.episodes.update(episode.id, silence_id=None, silenced_until=now)
            raise ActionRefused(f"Alertmanager refused the silence: {exc}") from None
        self.store.episodes.update(episode.id, silence_id=silence_id, silenced_until=now + seconds)
        return f"silenced for {value['duration']} (silence {silence_id})"

    def unsilence(self, person: Person, episode: Episode, value: dict, action: dict, now: float) -> str:
        """Expire every silence the bot made for this alert (found by its comment), not only the
        last one recorded: an older replica, or clicks before this rule, may have made several."""
        am = dataclasses.replace(self.cfg.alertmanager, timeout_s=CALLBACK_AM_TIMEOUT_S)
        try:
            made = [
                str(s["id"])
                for s in list_silences(am)
                if s.get("comment") == comment(episode) and (s.get("status") or {}).get("state") in LIVE
            ]
            if not made:
                raise ActionRefused("this alert is not silenced")
            for silence_id in made:
                expire_silence(am, silence_id)
        except AlertmanagerError as exc:
            raise ActionRefused(f"Alertmanager refused to expire the silence: {exc}") from None
        self.store.episodes.update(episode.id, silenced_until=now)
        return f"silence {', '.join(made)} expired"

    def note(self, person: Person, episode: Episode, value: dict, action: dict, now: float) -> str:
        text = str((action.get("form_value") or {}).get("note", "")).strip()
        if not text:
            raise ActionRefused("the note is empty")
        return f"note: {text[:500]}"


def comment(episode: Episode) -> str:
    """The comment of the silences the bot makes for `episode`: how it finds them again."""
    return f"from the Feishu card of alert {episode.id} ({episode.alertname})"


HANDLERS: dict[str, Callable[..., str]] = {
    "claim": Actions.claim,
    "silence": Actions.silence,
    "unsilence": Actions.unsilence,
    "note": Actions.note,
}
