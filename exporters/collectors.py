"""The table of the node agent's collectors: each name, the module that builds it, and whether it is on
by default. Adding a collector is adding its module and one row here (see docs/architecture.md).

A collector module provides:

- ``SETTINGS``: a dataclass whose fields are the collector's configuration keys, each declared with
  `megatrace.exporters.collector_settings.setting` (default, help text, optional flag name). The keys
  are top-level keys of the agent's configuration (YAML, ``MEGATRACE_EXPORTER_<KEY>``, ``--<key>``);
  name them after the collector. Two collectors may share a key only by declaring it alike. The class
  may define ``problems(self, enabled: bool) -> list[str]`` returning ``key '...': why`` messages.
- ``build(settings, agent, nvml)``: the collector, from its settings and the agent's configuration
  (`megatrace.exporters.settings.ExporterConfig`), an object with ``collect()``, and ``close()`` if it
  holds anything.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatrace.exporters.guard import Collector
    from megatrace.exporters.settings import ExporterConfig


@dataclasses.dataclass(frozen=True)
class CollectorEntry:
    """Where a collector is built (a module with ``SETTINGS`` and ``build``), whether it is on by
    default, what it does."""

    module: str
    default: bool
    summary: str


COLLECTORS: dict[str, CollectorEntry] = {
    "gpu": CollectorEntry("megatrace.exporters.gpu", True, "GPUs through NVML, with pod attribution"),
    "infiniband": CollectorEntry("megatrace.exporters.infiniband", True, "InfiniBand/RoCE ports from sysfs"),
    "tracer": CollectorEntry(
        "megatrace.exporters.tracer_files", True, "live counters of the traced ranks on the node"
    ),
    "traces": CollectorEntry(
        "megatrace.exporters.trace_endpoint",
        False,
        "serves the node's trace files to the alert bot (its own port, bearer token)",
    ),
}


def default_collectors() -> list[str]:
    """The collectors on by default, in the table's order."""
    return [name for name, entry in COLLECTORS.items() if entry.default]


def plugin(name: str) -> ModuleType:
    """The module of the collector named `name`."""
    return importlib.import_module(COLLECTORS[name].module)


def settings_type(name: str) -> type:
    """The settings dataclass of the collector named `name`."""
    return plugin(name).SETTINGS


def build(name: str, config: ExporterConfig, nvml: Any = None) -> Collector:
    """The collector named `name`, built from its settings and the agent's configuration."""
    return plugin(name).build(config.settings(name), config, nvml)
