"""Delivery channels as a table: each module implements `base.Channel` and is registered here, once.
Adding a channel (e-mail, a generic webhook) is one module and one line in `CHANNELS`; a channel with
settings declares their dataclass (`Channel.settings`), read from the configuration's
``channels.<name>`` section (`settings_of`)."""

from __future__ import annotations

import dataclasses

from megatrace.alertbot.channels.app import AppChannel
from megatrace.alertbot.channels.base import Channel, Context, FeishuCardChannel, Message, card_message
from megatrace.alertbot.channels.console import ConsoleChannel, ConsoleSink
from megatrace.alertbot.channels.group_bot import GroupBotChannel
from megatrace.alertbot.channels.urgent import UrgentChannel
from megatrace.alertbot.config import AlertbotConfig
from megatrace.config import ConfigError, validate
from megatrace.logsetup import register_secret

CHANNELS: dict[str, Channel] = {
    channel.name: channel for channel in (GroupBotChannel(), AppChannel(), UrgentChannel(), ConsoleChannel())
}
FALLBACK = ConsoleChannel.name

__all__ = [
    "CHANNELS",
    "FALLBACK",
    "Channel",
    "ConsoleSink",
    "Context",
    "FeishuCardChannel",
    "Message",
    "card_message",
    "check_settings",
    "routes",
]


def routes(cfg: AlertbotConfig, level: str) -> list[tuple[str, str]]:
    """(channel, destination) for every notification of `level`: each channel configured for it, the
    console when none is, nothing for a report-only level."""
    if level in cfg.delivery.report_only_levels:
        return []
    found = [(name, dest) for name, channel in CHANNELS.items() for dest in channel.destinations(cfg, level)]
    return found or [(FALLBACK, level)]


def check_settings(sections: dict[str, object], source: str) -> dict[str, object]:
    """The ``channels`` section of the configuration, each channel's part checked against its settings
    dataclass (defaults for a channel with settings that is not configured). A settings field marked
    ``metadata={"secret": True}`` is kept out of every log line and message."""
    unknown = sorted(name for name in sections if name not in CHANNELS or CHANNELS[name].settings is None)
    if unknown:
        known = ", ".join(name for name, channel in CHANNELS.items() if channel.settings is not None)
        named = ", ".join(unknown)
        raise ConfigError(
            f"{source}: key 'channels': no channel with settings named {named} (known: {known or 'none'})"
        )
    checked: dict[str, object] = {}
    for name, channel in CHANNELS.items():
        if channel.settings is not None:
            section = sections.get(name) or {}
            if not isinstance(section, dict):
                raise ConfigError(f"{source}: key 'channels.{name}': expected a mapping")
            settings: object = validate(channel.settings, section, f"{source}: channels.{name}")
            for field in dataclasses.fields(settings):  # type: ignore[arg-type]
                if field.metadata.get("secret"):
                    register_secret(str(getattr(settings, field.name)))
            checked[name] = settings
    return checked
