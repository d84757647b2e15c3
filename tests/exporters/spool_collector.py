"""A collector with one setting, written the way a new collector is added: this one file plus one row
in the collectors table (the tests add the row with ``monkeypatch.setitem``). It counts the files
waiting in a spool folder, and is what proves that a collector brings its own key, variable and flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric

from megatrace.exporters.collector_settings import setting
from megatrace.exporters.collectors import CollectorEntry
from megatrace.exporters.families import FamilySet

ROW = CollectorEntry("tests.exporters.spool_collector", False, "files waiting in a spool folder")


@dataclasses.dataclass(frozen=True)
class SpoolSettings:
    """The spool collector's one key."""

    spool_dir: str = setting("", "folder whose waiting files are counted", metavar="DIR")

    def problems(self, enabled: bool) -> list[str]:
        return (
            ["key 'spool_dir': the spool collector needs a folder"] if enabled and not self.spool_dir else []
        )


SETTINGS = SpoolSettings


class SpoolCollector:
    """`megatrace_spool_files`: regular files in the spool folder now."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def collect(self) -> Iterator[Metric]:
        families = FamilySet("spool")
        count = sum(1 for path in self.folder.iterdir() if path.is_file())
        families.gauge("files", "Files waiting in the spool folder.", {}, count)
        return iter(families.families())


def build(settings: SpoolSettings, agent: Any, nvml: object = None) -> SpoolCollector:
    """The spool collector (table row ``spool``)."""
    return SpoolCollector(Path(settings.spool_dir))
