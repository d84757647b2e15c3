"""The collectors' own settings, gathered from the collectors table: one declaration per key gives
its configuration key, its ``MEGATRACE_EXPORTER_<KEY>`` variable and its command-line flag.

A collector declares its keys as fields of its ``SETTINGS`` dataclass with `setting`. Keys are flat
(top-level keys of the agent's configuration), as they always were; two collectors that use the same
key (``trace_dir``) must declare it alike, and no collector may take a key of the agent's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from megatrace.exporters.collectors import COLLECTORS, settings_type


@dataclasses.dataclass(frozen=True)
class DeclaredKey:
    """One collector configuration key: the collectors declaring it, its field and type."""

    collectors: tuple[str, ...]
    field: dataclasses.Field[Any]
    hint: Any

    @property
    def flag(self) -> str:
        """The command-line flag: ``--<key with dashes>`` unless the field names another."""
        return "--" + (self.field.metadata.get("flag") or self.field.name.replace("_", "-"))


def setting(default: Any, help: str, flag: str | None = None, metavar: str | None = None) -> Any:
    """A field of a collector's ``SETTINGS`` dataclass: its default, the help of its flag, and the
    flag's name (without ``--``) where it is not the key with dashes."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "metavar": metavar})


def declared_keys() -> dict[str, DeclaredKey]:
    """Every collector's keys, in the table's order; TypeError when two collectors declare one key
    differently or a key has no help text."""
    keys: dict[str, DeclaredKey] = {}
    for name in COLLECTORS:
        schema = settings_type(name)
        hints = typing.get_type_hints(schema)
        for field in dataclasses.fields(schema):
            if not field.metadata.get("help"):
                raise TypeError(f"collector {name}: key {field.name!r} is not declared with setting()")
            seen = keys.get(field.name)
            if seen is None:
                keys[field.name] = DeclaredKey((name,), field, hints[field.name])
            elif (seen.hint, seen.field.default, seen.field.metadata) != (
                hints[field.name],
                field.default,
                field.metadata,
            ):
                raise TypeError(
                    f"collectors {seen.collectors[0]} and {name} both declare key {field.name!r}, differently"
                )
            else:
                keys[field.name] = dataclasses.replace(seen, collectors=(*seen.collectors, name))
    return keys


def add_flags(parser: argparse._ActionsContainer) -> None:
    """One flag per collector key; a flag left out is None in the parsed arguments."""
    for key, declared in declared_keys().items():
        metadata = declared.field.metadata
        parser.add_argument(
            declared.flag,
            dest=key,
            type=declared.hint if declared.hint in (int, float) else str,
            metavar=metadata.get("metavar") or key.rsplit("_", 1)[-1].upper(),
            help=f"{metadata['help']} (default {declared.field.default!r}; "
            f"collector {', '.join(declared.collectors)})",
        )


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The collector keys given as flags in `args`."""
    return {key: getattr(args, key) for key in declared_keys() if getattr(args, key, None) is not None}
