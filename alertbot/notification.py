"""The neutral notification every channel receives: what happened, in words and links, with no
channel's format in it. The Feishu channels build their interactive card from it (`card`, the
template and its context, which shrinks to fit Feishu's size limit); other channels use the fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatrace.alertbot.kinds import NotificationKind

# A card's template context for a detail budget (characters per free-text field).
CardContext = Callable[[int], dict[str, object]]


@dataclasses.dataclass(frozen=True)
class Link:
    """A link shown with the notification (runbook, dashboards, a silence)."""

    text: str
    url: str
    style: str = "default"  # Feishu button type: primary, default or danger


@dataclasses.dataclass(frozen=True)
class CardSpec:
    """How the Feishu channels show it: a card template (``card_*.json.j2``) and its context."""

    template: str
    context: CardContext


@dataclasses.dataclass(frozen=True)
class Notification:
    """`title` and `facts` say what happened and where; `culprit` who is to blame ("" when none is
    named); `actions` are the on-call actions offered (claim, silence, …) where the channel takes
    them; `ref` names the notification in every channel (``megatrace ref …``)."""

    kind: NotificationKind
    level: str
    title: str
    facts: tuple[tuple[str, str], ...]
    culprit: str
    links: tuple[Link, ...]
    actions: tuple[str, ...]
    ref: str
    card: CardSpec

    def as_json(self) -> dict[str, object]:
        """The notification as plain JSON (for channels that post it as it is)."""
        return {
            "kind": str(self.kind),
            "level": self.level,
            "title": self.title,
            "facts": dict(self.facts),
            "culprit": self.culprit,
            "links": [{"text": link.text, "url": link.url} for link in self.links],
            "actions": list(self.actions),
            "ref": self.ref,
        }
