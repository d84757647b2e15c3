"""The table of the node agent's collectors: each name, the module that builds it, and whether it is on
by default. Adding a collector is adding its module (with a ``build(config, nvml)`` function returning
an object with ``collect()``, and ``close()`` if it holds anything) and one row here.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatrace.exporters.guard import Collector
    from megatrace.exporters.settings import ExporterConfig


@dataclasses.dataclass(frozen=True)
class CollectorEntry:
    """Where a collector is built (a module with ``build``), whether it is on by default, what it does."""

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
DEFAULT_COLLECTORS = tuple(name for name, entry in COLLECTORS.items() if entry.default)


def build(name: str, config: ExporterConfig, nvml: Any = None) -> Collector:
    """The collector named `name`, built from the agent's configuration."""
    return importlib.import_module(COLLECTORS[name].module).build(config, nvml)
