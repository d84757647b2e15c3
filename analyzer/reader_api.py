"""What one trace format provides the loader: recognise a file, parse it, turn all parsed files into calls.

Each format module defines one `Reader`; `megatrace.analyzer.formats.READERS` lists them. A format
whose files must be read together (communicators matched across ranks) does that in `resolve`. A
format with settings declares them as a dataclass (every field with a default) in `Reader.settings`;
its settings key is its name, and `parse` receives the settings of this run (None for a reader
without settings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrace.analyzer.layout import Layout
from megatrace.analyzer.table import RankCalls


class ReaderError(ValueError):
    """A file of a known format that holds nothing usable; the message says why."""


@dataclass
class Parsed:
    """One parsed file: the format's own object, and how many lines were skipped or duplicated."""

    item: Any
    skipped: int = 0
    duplicates: int = 0


@dataclass(frozen=True)
class Reader:
    """One trace format. `priority` decides which file wins when two hold the same rank (higher wins)."""

    name: str
    priority: int
    detect: Callable[[bytes], bool]
    parse: Callable[[Path, Any], Parsed]
    resolve: Callable[[list[Any], Layout | None], list[RankCalls]]
    settings: type | None = None


def each_alone(items: list[RankCalls], _layout: Layout | None) -> list[RankCalls]:
    """`resolve` for formats whose files are complete on their own."""
    return items
