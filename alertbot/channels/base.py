"""What every delivery channel implements, what it may use, and what it declares about itself.

A channel is one way a notification leaves the bot (a group bot, an app message, an urgent call, the
console, a webhook). `megatrace.alertbot.channels.CHANNELS` registers them; delivery, routing, the
on-call module and the weekly report only ever go through this interface and the capability flags,
never through a channel's name.

A channel receives the neutral `Notification` and turns it into its own message (`render`); the
Feishu channels build their interactive card from it (`FeishuCardChannel`). A channel with settings
declares their dataclass (`settings`) and its key: the configuration's ``channels.<key>`` section is
checked against that dataclass when the configuration loads, and the channel finds its settings in
``cfg.channels[key]``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import requests

from megatrace.alertbot.cards import CardRenderer
from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.feishu import FeishuApp, SendResult
from megatrace.alertbot.kinds import AfterCrash, Outcome
from megatrace.alertbot.notification import Notification
from megatrace.alertbot.ratelimit import Window
from megatrace.alertbot.store import Store
from megatrace.alertbot.store.records import Outbox, UnfinishedSend

if TYPE_CHECKING:
    from megatrace.alertbot.channels.console import ConsoleSink

# Sliding windows are padded (one second counted as 1.25 s, one minute as 61 s) so that network
# jitter cannot make Feishu count more requests in its window than it allows.
SECOND, MINUTE = 1.25, 61.0

# What a channel sends: a JSON object.
Message = dict[str, object]


def card_message(card: dict[str, object]) -> Message:
    """The Feishu envelope of an interactive card: the one place it is built."""
    return {"msg_type": "interactive", "card": card}


@dataclasses.dataclass
class Context:
    """What a channel may use to send: the configuration, the store, the Feishu app (None when not
    configured), the console sink, an HTTP session and the card renderer."""

    cfg: AlertbotConfig
    store: Store
    app: FeishuApp | None
    console: ConsoleSink
    session: requests.Session
    cards: CardRenderer


class Channel:
    """One delivery channel and its capabilities:

    - `edits_messages`: a message it sent can be replaced in place (an incident's update goes there;
      else an update goes out as one reply);
    - `pages`: a page it delivered is followed by an urgent call about that message;
    - `receives_reports`: the weekly report is posted there;
    - `takes_actions`: its cards carry the on-call buttons (claim, silence, note) and get their updates;
    - `places_calls`: it phones the on-call people about a page (urgent calls are queued to it).
    """

    name: ClassVar[str] = ""
    edits_messages: ClassVar[bool] = False
    pages: ClassVar[bool] = False
    receives_reports: ClassVar[bool] = False
    takes_actions: ClassVar[bool] = False
    places_calls: ClassVar[bool] = False
    # Its settings' dataclass, read from ``channels.<name>`` (None: it has none of its own).
    settings: ClassVar[type | None] = None

    def destinations(self, cfg: AlertbotConfig, level: str) -> list[str]:
        """Where notifications of `level` go through this channel ([]: not configured for it)."""
        return []

    def limits(self, cfg: AlertbotConfig, row: Outbox) -> list[Window]:
        """The rate-limit windows a send of `row` counts against."""
        return []

    def render(self, ctx: Context, note: Notification) -> Message:
        """The message this channel sends for `note`: here the notification as plain JSON."""
        return note.as_json()

    def send(self, ctx: Context, row: Outbox, message: Message) -> SendResult:
        return SendResult(Outcome.FATAL, f"channel {self.name} cannot send")

    def update(self, ctx: Context, row: Outbox, parent: Outbox, message: Message) -> SendResult:
        """Show `message` as the new state of the message `parent` sent: replaced in place where the
        channel `edits_messages`, else sent as one reply."""
        return self.send(ctx, row, message)

    def after_crash(self, ctx: Context, sent: UnfinishedSend) -> AfterCrash:
        """What to do with a send the bot stopped in the middle of."""
        return AfterCrash.RESEND


class FeishuCardChannel(Channel):
    """A channel that shows a notification as a Feishu interactive card."""

    def render(self, ctx: Context, note: Notification) -> Message:
        return card_message(ctx.cards.card(note.card))
