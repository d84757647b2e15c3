"""Who is on call, and escalation in time: the weekly rotation with overrides, whom a page phones
(`page_after_sent`, delivery's after-send hook), the next person phoned when a page stays unclaimed,
and unclaimed alerts raised a level.

Every function takes the time it works at (`now`), so tests compress hours into calls.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from megatrace.alertbot.channels import CHANNELS
from megatrace.alertbot.config import AlertbotConfig, OncallConfig, Person, parse_time
from megatrace.alertbot.kinds import PAGE_KINDS, NotificationKind
from megatrace.alertbot.pipeline import Pipeline, episode_ref
from megatrace.alertbot.store import Store
from megatrace.alertbot.store.records import Episode, NewNotification, Outbox

log = logging.getLogger(__name__)
SYSTEM = "megatrace"  # the actor of actions the bot takes by itself
DUE_AT_ONCE = 0.0  # what escalation queues goes out now, whatever clock decided it
NEVER_PHONED = frozenset({"P3"})  # the lowest level: a chat or the report, never a phone


def rotation(oncall: OncallConfig, now: float) -> list[Person]:
    """The roster in calling order at `now`: the primary first (an override's person, else the
    rotation's), then the rest in roster order after the rotation's primary."""
    roster = oncall.roster
    if not roster:
        return []
    period = oncall.rotation_days * 86400
    index = int((now - parse_time(oncall.rotation_start, "oncall.rotation_start")) // period) % len(roster)
    order = roster[index:] + roster[:index]
    for override in oncall.overrides:
        if parse_time(override.start, "") <= now < parse_time(override.end, ""):
            chosen = next(p for p in roster if p.name == override.name)
            order = [chosen] + [p for p in order if p is not chosen]
            break
    return order


def roster_member(oncall: OncallConfig, open_id: str) -> Person | None:
    return next((p for p in oncall.roster if p.open_id == open_id), None)


def first_call(cfg: AlertbotConfig, level: str, now: float) -> list[str]:
    """Open ids phoned when a page of `level` goes out: the primary, or everyone on the roster when
    the level's policy says so; without a roster, the flat ``feishu.app.oncall`` list. A level in
    `NEVER_PHONED` rings no one, whatever ``phone_levels`` says: it waits in its low-priority chat
    or the report."""
    if level in NEVER_PHONED:
        return []
    order = rotation(cfg.oncall, now)
    if not order:
        return list(cfg.feishu.app.oncall)
    policy = cfg.oncall.escalation.get(level)
    if policy is not None and policy.phone == "everyone":
        return [p.open_id for p in order]
    return [order[0].open_id]


def call(
    level: str,
    idem_key: str,
    message_id: str,
    users: list[str],
    now: float,
    due: float,
    episode_id: int | None,
    parent_id: int | None = None,
    storm_id: int | None = None,
) -> NewNotification:
    """The urgent call about app message `message_id` to `users`, through the channel that places calls."""
    channel = next(name for name, channel in CHANNELS.items() if channel.places_calls)
    return NewNotification(
        kind=NotificationKind.URGENT,
        channel=channel,
        destination="oncall",
        level=level,
        idem_key=idem_key,
        created_at=now,
        not_before=due,
        payload=json.dumps({"message_id": message_id, "users": users}),
        episode_id=episode_id,
        parent_id=parent_id,
        storm_id=storm_id,
    )


def page_after_sent(store: Store, cfg: AlertbotConfig, row: Outbox, message_id: str, now: float) -> None:
    """Delivery's after-send hook: a page sent through a channel that `pages` gets the on-call people
    phoned about it (escalation step 0, recorded before the call is queued). P3 is never phoned."""
    if not CHANNELS[row.channel].pages or row.kind not in PAGE_KINDS or not message_id:
        return
    users = first_call(cfg, row.level, now)
    if row.level not in cfg.feishu.app.phone_levels or not users:
        return
    with store.transaction():
        episode = row.episode_id
        if episode is not None and not store.coordination.add_escalation(episode, 0, message_id, users, now):
            return
        key = f"{row.idem_key}-urgent"
        store.outbox.enqueue(call(row.level, key, message_id, users, now, now, episode, row.id, row.storm_id))


@dataclasses.dataclass
class Escalator:
    """The escalation job (run by one replica of the cluster each tick)."""

    store: Store
    cfg: AlertbotConfig
    pipeline: Pipeline

    def tick(self, now: float) -> int:
        """Raise and re-page unclaimed firing alerts that waited long enough; returns steps taken."""
        policies = self.cfg.oncall.escalation
        taken = 0
        for episode in self.store.episodes.firing_unclaimed(list(policies)):
            policy = policies[episode.level]
            with self.store.transaction():
                if policy.raise_after_s and now - episode.starts_at >= policy.raise_after_s:
                    taken += self.raise_level(episode, policy.raise_to, now)
                elif policy.next_after_s:
                    taken += self.page_next(episode, policy.next_after_s, now)
        return taken

    def raise_level(self, episode: Episode, level: str, now: float) -> int:
        if episode.level == level:
            return 0
        self.store.episodes.update(episode.id, level=level, escalated=True)
        detail = f"unclaimed {episode.level} raised to {level}"
        self.store.coordination.add_action(now, SYSTEM, SYSTEM, "raise", episode.id, detail, "escalation")
        raised = dataclasses.replace(episode, level=level, escalated=True)
        self.pipeline.archive(raised, f"raised to {level} (unclaimed)", now)
        ref = f"{episode_ref(episode)}-{level}"
        self.pipeline.enqueue(NotificationKind.FIRING, ref, level, now, DUE_AT_ONCE, episode_id=episode.id)
        log.warning("alert %s (%s): %s", episode.id, episode.alertname, detail)
        return 1

    def page_next(self, episode: Episode, after_s: float, now: float) -> int:
        """Phone the next person on the roster when the last call is `after_s` old and unclaimed."""
        steps = self.store.coordination.escalations_of(episode.id)
        if not steps or now - steps[-1].at < after_s:
            return 0
        order = rotation(self.cfg.oncall, steps[0].at)
        step = steps[-1].step + 1
        if step >= len(order):
            return 0
        message_id = steps[-1].message_id
        users = [order[step].open_id]
        if not self.store.coordination.add_escalation(episode.id, step, message_id, users, now):
            return 0
        self.enqueue_call(episode, step, message_id, users, now)
        detail = f"unclaimed after {after_s:.0f}s: phoning {order[step].name}"
        self.store.coordination.add_action(now, SYSTEM, SYSTEM, "escalate", episode.id, detail, "escalation")
        return 1

    def enqueue_call(
        self, episode: Episode, step: int, message_id: str, users: list[str], now: float
    ) -> None:
        key = f"mt-call-{episode.id}-{step}"
        new = call(episode.level, key, message_id, users, now, DUE_AT_ONCE, episode.id)
        self.store.outbox.enqueue(new)
