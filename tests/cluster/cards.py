"""What the Feishu stand-in received, read as the on-call person reads it: the incident cards of a
chat (first sends and their updates) as text, and waiting for one that says something."""

from __future__ import annotations

import time
from collections.abc import Callable

from megatrace.demo import card_text
from tests.support.feishu_server import FeishuServer


def timed_cards(feishu: FeishuServer, chat: str) -> list[tuple[float, str]]:
    """(time received, text) of every card sent to `chat` and of every later update of one, in order."""
    sent = feishu.messages(chat)
    ids = {record.message_id for record in sent}
    cards = [(record.time, card_text({"card": record.body["content"]})) for record in sent]
    cards += [
        (record.time, card_text(record.body)) for record in feishu.select("update") if record.key in ids
    ]
    return sorted(cards)


def wait_for_card(
    feishu: FeishuServer, chat: str, says: Callable[[str], bool], since: float, timeout: float = 120.0
) -> tuple[str, float]:
    """The first card (or update) of `chat` received after `since` (a time.time()) whose text satisfies
    `says`, and the seconds from `since` until the stand-in received it; TimeoutError listing what came
    instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for received, text in timed_cards(feishu, chat):
            if received >= since and says(text):
                return text, received - since
        time.sleep(0.2)
    cards = [text for _, text in timed_cards(feishu, chat)]
    raise TimeoutError(f"no card in {chat} as wanted after {timeout}s; cards: {cards}")
