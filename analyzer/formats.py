"""The table of trace formats the analyzer reads; adding a format is adding its module and one line here.

Formats are told apart by their first bytes (each reader's `detect`, tried in this order), never by
file name. `reader_settings` gives each reader with settings its settings for a run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatrace.analyzer.flight_recorder import READER as FLIGHT_RECORDER
from megatrace.analyzer.nccl_comms import READER as NCCL_LOG
from megatrace.analyzer.reader_api import Reader
from megatrace.analyzer.tracer_formats import DUMP, RING, STACKS
from megatrace.config import ConfigError, validate

READERS: dict[str, Reader] = {
    reader.name: reader for reader in (RING, DUMP, STACKS, NCCL_LOG, FLIGHT_RECORDER)
}


def reader_settings(options: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Reader name -> its settings: the defaults of its dataclass with `options` (reader name -> key ->
    value, values as given on a command line converted to the field's type) applied. ConfigError naming
    the reader and the key for an unknown reader, an unknown key or a bad value."""
    options = options or {}
    configurable = {name: reader for name, reader in READERS.items() if reader.settings is not None}
    for name in options:
        if name not in configurable:
            known = ", ".join(sorted(configurable)) or "none"
            raise ConfigError(f"reader settings: unknown reader '{name}' (readers with settings: {known})")
    return {
        name: validate(reader.settings, options.get(name, {}), f"reader settings of '{name}'")
        for name, reader in configurable.items()
        if reader.settings is not None
    }


def detect(head: bytes) -> Reader | None:
    """The reader of a file that starts with `head`, or None for an unknown format."""
    return next((reader for reader in READERS.values() if reader.detect(head)), None)
