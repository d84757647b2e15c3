"""Delivery channels as a table: each module implements `base.Channel` and is registered here, once.
Adding a channel (e-mail, a generic webhook) is one module and one line in `CHANNELS`."""

from __future__ import annotations

from megatrace.alertbot.channels.app import AppChannel
from megatrace.alertbot.channels.base import Channel, Context, card_message
from megatrace.alertbot.channels.console import ConsoleChannel, ConsoleSink
from megatrace.alertbot.channels.group_bot import GroupBotChannel
from megatrace.alertbot.channels.urgent import UrgentChannel
from megatrace.alertbot.config import AlertbotConfig

CHANNELS: dict[str, Channel] = {
    channel.name: channel for channel in (GroupBotChannel(), AppChannel(), UrgentChannel(), ConsoleChannel())
}
FALLBACK = ConsoleChannel.name

__all__ = ["CHANNELS", "Channel", "ConsoleSink", "Context", "card_message", "routes"]


def routes(cfg: AlertbotConfig, level: str) -> list[tuple[str, str]]:
    """(channel, destination) for every notification of `level`: each channel configured for it, the
    console when none is, nothing for a report-only level."""
    if level in cfg.delivery.report_only_levels:
        return []
    found = [(name, dest) for name, channel in CHANNELS.items() for dest in channel.destinations(cfg, level)]
    return found or [(FALLBACK, level)]
