"""Configuration of the node agent: YAML file, ``MEGATRACE_EXPORTER_*`` environment, then flags.

The agent's own keys (address, collectors, connection limits, node name) are declared here; every
other key belongs to a collector, declared in its module's ``SETTINGS`` and gathered from the
collectors table (`megatrace.exporters.collector_settings`). All keys are top-level keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatrace.config import ConfigError, load_config
from megatrace.exporters.collector_settings import declared_keys
from megatrace.exporters.collectors import COLLECTORS, default_collectors, settings_type
from megatrace.exporters.http_limits import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S
from megatrace.listen import parse_host_port

DEFAULT_PORT = 9450
ENV_PREFIX = "MEGATRACE_EXPORTER_"


@dataclasses.dataclass
class AgentSettings:
    """The agent's own keys: what it serves /metrics on, which collectors it runs, its HTTP limits."""

    listen: str = f"0.0.0.0:{DEFAULT_PORT}"
    # A list, or one comma-separated string (handy in MEGATRACE_EXPORTER_COLLECTORS=gpu,tracer).
    collectors: list[str] | str = dataclasses.field(default_factory=default_collectors)
    # Both HTTP servers (/metrics, the trace endpoint): seconds a client has to send its request
    # line and headers, and the most connections each keeps open (see megatrace.exporters.http_limits).
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # The Kubernetes node (or host) the agent reports its ranks on; "" is the machine's host name.
    node_name: str = ""


@dataclasses.dataclass
class ExporterConfig(AgentSettings):
    """What `megatrace exporter` serves: the agent's own settings and each collector's settings."""

    collectors: list[str] = dataclasses.field(default_factory=default_collectors)
    collector_settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    def settings(self, name: str) -> Any:
        """The settings of the collector named `name` (its defaults where none were loaded)."""
        found = self.collector_settings.get(name)
        return found if found is not None else settings_type(name)()


def schema() -> type:
    """The flat dataclass every configuration source is validated against: the agent's keys, then
    each collector's (from the table, so a collector added to it brings its keys)."""
    own = {field.name for field in dataclasses.fields(AgentSettings)}
    fields: list[tuple[str, Any, dataclasses.Field[Any]]] = []
    for key, declared in declared_keys().items():
        if key in own:
            raise TypeError(f"collector {declared.collectors[0]}: key {key!r} is one of the agent's own")
        copy = dataclasses.field(default=declared.field.default, metadata=declared.field.metadata)
        fields.append((key, declared.hint, copy))
    return dataclasses.make_dataclass("ExporterSettings", fields, bases=(AgentSettings,))


def split(flat: Any) -> ExporterConfig:
    """The validated flat settings as the agent's own and one settings object per collector."""
    own = {field.name: getattr(flat, field.name) for field in dataclasses.fields(AgentSettings)}
    own["collectors"] = collector_names(own["collectors"])
    per_collector = {}
    for name in COLLECTORS:
        kind = settings_type(name)
        per_collector[name] = kind(
            **{field.name: getattr(flat, field.name) for field in dataclasses.fields(kind)}
        )
    return ExporterConfig(**own, collector_settings=per_collector)


def collector_names(value: list[str] | str) -> list[str]:
    """`collectors` as a list (it may be one comma-separated string)."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return list(value)


def problems(config: ExporterConfig) -> list[str]:
    """What is wrong with `config`, each naming its key (an empty list when nothing is)."""
    found = []
    unknown = [name for name in config.collectors if name not in COLLECTORS]
    if unknown:
        found.append(
            f"key 'collectors': unknown collector {', '.join(unknown)} (known: {', '.join(COLLECTORS)})"
        )
    try:
        parse_host_port(config.listen)
    except ValueError as exc:
        found.append(f"key 'listen': {exc}")
    if not 0 < config.read_timeout_s <= 3600:
        found.append("key 'read_timeout_s': must be more than 0 and at most 3600")
    if config.max_connections < 1:
        found.append("key 'max_connections': must be at least 1")
    for name in COLLECTORS:
        settings = config.settings(name)
        if hasattr(settings, "problems"):
            found += settings.problems(name in config.collectors)
    return found


def load(
    path: str | Path | None, overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> ExporterConfig:
    """The agent's configuration from `path` (optional), the environment and `overrides` (flags)."""
    flat = load_config(schema(), path, env_prefix=ENV_PREFIX, environ=environ, overrides=overrides)
    config = split(flat)
    found = problems(config)
    if found:
        raise ConfigError(f"{path if path is not None else 'configuration'}: " + "; ".join(found))
    return config
