"""Stage 3, render: the neutral notification for a queued row, by a renderer chosen from `RENDERERS`
by the notification's kind, then the channel's own message made of it. Rows queued with their
message (urgent calls, reports) and rows rendered once before (a retry) keep that frozen message."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

from megatrace.alertbot.actions import oncall_context
from megatrace.alertbot.cards import CardRenderer, placement_text
from megatrace.alertbot.channels import CHANNELS, Context, Message
from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.incident import load as load_incident
from megatrace.alertbot.kinds import CARD_KINDS, EpisodeStatus, NotificationKind
from megatrace.alertbot.notification import Notification
from megatrace.alertbot.store import Store
from megatrace.alertbot.store.records import Outbox


@dataclasses.dataclass(frozen=True)
class RenderContext:
    store: Store
    cfg: AlertbotConfig
    cards: CardRenderer


Renderer = Callable[[RenderContext, Outbox, float], Notification | None]


def storm(ctx: RenderContext, row: Outbox, now: float) -> Notification | None:
    """A storm's summary; rendering it seals the storm (later members get their own cards)."""
    if row.storm_id is None:
        return None
    ctx.store.episodes.seal_storm(row.storm_id, now)
    found = ctx.store.episodes.storm(row.storm_id)
    members = ctx.store.episodes.storm_members(row.storm_id)
    if found is None or not members:
        return None
    return ctx.cards.storm(found, members, ctx.cfg.dedupe.storm_window_s, row.idem_key)


def storm_resolved(ctx: RenderContext, row: Outbox, now: float) -> Notification | None:
    found = None if row.storm_id is None else ctx.store.episodes.storm(row.storm_id)
    if found is None:
        return None
    members = ctx.store.episodes.storm_members(found.id)
    return ctx.cards.storm_resolved(found, members, row.idem_key, now)


def alert(ctx: RenderContext, row: Outbox, now: float) -> Notification | None:
    """An alert's card, or its incident's in its current state; an update of a card in a channel that
    cannot edit is one reply that says it follows that card up."""
    episode = None if row.episode_id is None else ctx.store.episodes.get(row.episode_id)
    if episode is None:
        return None
    channel = CHANNELS[row.channel]
    kind = row.kind
    incident = None
    if episode.incident_id is not None:
        incident = load_incident(ctx.store, episode.incident_id, placement_text)
    if incident is not None:  # the page as it was, or the incident's card in its current state
        firing = kind in CARD_KINDS or not incident.closed
        shown = (
            kind if kind in CARD_KINDS else NotificationKind.FIRING if firing else NotificationKind.RESOLVED
        )
    else:
        firing = episode.status == EpisodeStatus.FIRING
        shown = NotificationKind.FIRING if kind == NotificationKind.CARD_UPDATE else kind
    acting = bool(ctx.cfg.feishu.callback.mode) and channel.takes_actions
    oncall = oncall_context(ctx.store, ctx.cards, episode, now) if acting and firing else None
    ref = row.idem_key
    parent = None if row.parent_id is None else ctx.store.outbox.get(row.parent_id)
    if row.is_update and parent is not None:  # the card's own ref where it is replaced, else a reply's
        ref = parent.idem_key if channel.edits_messages else f"{ref} (follows {parent.idem_key})"
        if not channel.edits_messages and shown == NotificationKind.FIRING:
            shown = (
                NotificationKind.VERDICT
            )  # a reply: its title says it follows up, not that something new fires
    return ctx.cards.alert(episode, shown, ref, ctx.cfg.dedupe.flap_hold_s, now, oncall, incident)


RENDERERS: dict[NotificationKind, Renderer] = {
    NotificationKind.STORM: storm,
    NotificationKind.STORM_RESOLVED: storm_resolved,
    NotificationKind.FIRING: alert,
    NotificationKind.REPEAT: alert,
    NotificationKind.RESOLVED: alert,
    NotificationKind.CARD_UPDATE: alert,
    NotificationKind.VERDICT: alert,
}


def render(ctx: RenderContext, channel_ctx: Context, row: Outbox, now: float) -> Message | None:
    """The message to send for `row` (None: nothing to send any more)."""
    if row.payload:
        frozen: Message = json.loads(row.payload)
        return frozen
    renderer = RENDERERS.get(row.kind)
    if renderer is None:
        raise LookupError(f"no renderer for a {row.kind} notification queued without its message")
    note = renderer(ctx, row, now)
    return None if note is None else CHANNELS[row.channel].render(channel_ctx, note)
