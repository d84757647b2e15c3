"""What every delivery channel implements, what it may use, and the Feishu message envelope.

A channel is one way a notification leaves the bot (a group bot, an app message, an urgent call, the
console). `megatrace.alertbot.channels.CHANNELS` registers them; the delivery loop and the pipeline's
routing only ever go through this interface.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import requests

from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.feishu import FeishuApp, SendResult
from megatrace.alertbot.ratelimit import Window
from megatrace.alertbot.store import Store

if TYPE_CHECKING:
    from megatrace.alertbot.channels.console import ConsoleSink

# Sliding windows are padded (one second counted as 1.25 s, one minute as 61 s) so that network
# jitter cannot make Feishu count more requests in its window than it allows.
SECOND, MINUTE = 1.25, 61.0


def card_message(card: dict[str, Any]) -> dict[str, Any]:
    """The Feishu envelope of an interactive card: the one place it is built."""
    return {"msg_type": "interactive", "card": card}


@dataclasses.dataclass
class Context:
    """What a channel may use to send: the configuration, the store, the Feishu app (None when not
    configured), the console sink and an HTTP session."""

    cfg: AlertbotConfig
    store: Store
    app: FeishuApp | None
    console: ConsoleSink
    session: requests.Session


class Channel:
    """One delivery channel. `edits`: a message it sent can be replaced in place (an update of an
    incident goes there), else an update goes out as one reply. `phones`: a page it delivered is
    followed by an urgent call about that message."""

    name = ""
    edits = False
    phones = False

    def destinations(self, cfg: AlertbotConfig, level: str) -> list[str]:
        """Where notifications of `level` go through this channel ([]: not configured for it)."""
        return []

    def limits(self, cfg: AlertbotConfig, row: Any) -> list[Window]:
        """The rate-limit windows a send of `row` counts against."""
        return []

    def render(self, card: dict[str, Any]) -> dict[str, Any]:
        """The message this channel sends for `card`."""
        return card_message(card)

    def send(self, ctx: Context, row: Any, message: dict[str, Any]) -> SendResult:
        raise NotImplementedError

    def update(self, ctx: Context, row: Any, parent: Any, message: dict[str, Any]) -> SendResult:
        """Show `message` as the new state of the message `parent` sent: replaced in place where the
        channel `edits`, else sent as one reply."""
        return self.send(ctx, row, message)

    def after_crash(self, ctx: Context, row: Any) -> str:
        """What to do with a send the bot stopped in the middle of: "sent" (it arrived), "resend", or
        "abandon" (it must not be repeated and cannot be confirmed)."""
        return "resend"
