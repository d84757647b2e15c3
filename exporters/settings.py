"""Configuration of the node agent: YAML file, ``MEGATRACE_EXPORTER_*`` environment, then flags."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatrace.config import ConfigError, load_config
from megatrace.exporters.collectors import COLLECTORS, DEFAULT_COLLECTORS
from megatrace.exporters.http_limits import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S

DEFAULT_PORT = 9450
DEFAULT_TRACE_PORT = 9452
ENV_PREFIX = "MEGATRACE_EXPORTER_"


@dataclasses.dataclass
class ExporterConfig:
    """What `megatrace exporter` serves and where it reads from."""

    listen: str = f"0.0.0.0:{DEFAULT_PORT}"
    # A list, or one comma-separated string (handy in MEGATRACE_EXPORTER_COLLECTORS=gpu,tracer).
    collectors: list[str] | str = dataclasses.field(default_factory=lambda: list(DEFAULT_COLLECTORS))
    sysfs_root: str = "/sys"
    trace_dir: str = "/run/megatrace"
    # Seconds a finished or dead rank's series stay exported (with rank_alive=0) before they are dropped.
    tracer_grace_seconds: float = 300.0
    # kubelet PodResources socket; GPUs get pod attribution when it exists, "" turns attribution off.
    podresources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    xid_wait_ms: int = 500
    # Finished jobs' folders under trace_dir are removed after this many hours (0 keeps them)...
    trace_retention_hours: float = 72.0
    # ...and, oldest first, while all job folders together hold more than this (0: no size limit).
    trace_max_bytes: int = 2 << 30
    # The trace endpoint (collector "traces"): its own address, so that a NetworkPolicy can let only
    # the alert bot reach it, and the file holding the bearer token every request must carry.
    trace_listen: str = f"0.0.0.0:{DEFAULT_TRACE_PORT}"
    trace_token_file: str = ""
    # Most records one ring window may hold, most bytes one dump may have, requests served at once.
    trace_max_records: int = 200_000
    trace_max_response_bytes: int = 64 << 20
    trace_max_concurrent: int = 4
    # Both HTTP servers (/metrics, the trace endpoint): seconds a client has to send its request
    # line and headers, and the most connections each keeps open (see megatrace.exporters.http_limits).
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # The Kubernetes node (or host) the agent reports its ranks on; "" is the machine's host name.
    node_name: str = ""


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) into its parts; ValueError when it is not one."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port from 1 to 65535, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def check(config: ExporterConfig, source: str) -> ExporterConfig:
    """Normalize `collectors` to a list; reject an unknown collector, a bad listen address."""
    if isinstance(config.collectors, str):
        names = [name.strip() for name in config.collectors.split(",") if name.strip()]
        config = dataclasses.replace(config, collectors=names)
    unknown = [name for name in config.collectors if name not in COLLECTORS]
    if unknown:
        raise ConfigError(
            f"{source}: key 'collectors': unknown collector {', '.join(unknown)} "
            f"(known: {', '.join(COLLECTORS)})"
        )
    for key in ("listen", "trace_listen"):
        try:
            parse_listen(getattr(config, key))
        except ValueError as exc:
            raise ConfigError(f"{source}: key '{key}': {exc}") from None
    if "traces" in config.collectors and not config.trace_token_file:
        raise ConfigError(
            f"{source}: key 'trace_token_file': the trace endpoint (collector traces) needs a token file"
        )
    for key in ("trace_max_records", "trace_max_response_bytes", "trace_max_concurrent"):
        if getattr(config, key) < 1:
            raise ConfigError(f"{source}: key '{key}': must be at least 1")
    if not 0 < config.read_timeout_s <= 3600:
        raise ConfigError(f"{source}: key 'read_timeout_s': must be more than 0 and at most 3600")
    if config.max_connections < 1:
        raise ConfigError(f"{source}: key 'max_connections': must be at least 1")
    if config.tracer_grace_seconds < 0:
        raise ConfigError(f"{source}: key 'tracer_grace_seconds': must not be negative")
    if config.xid_wait_ms < 1:
        raise ConfigError(f"{source}: key 'xid_wait_ms': must be at least 1")
    if config.trace_retention_hours < 0:
        raise ConfigError(f"{source}: key 'trace_retention_hours': must not be negative (0 keeps them)")
    if config.trace_max_bytes < 0:
        raise ConfigError(f"{source}: key 'trace_max_bytes': must not be negative (0: no size limit)")
    return config


def load(
    path: str | Path | None, overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> ExporterConfig:
    """The agent's configuration from `path` (optional), the environment and `overrides` (flags)."""
    config = load_config(ExporterConfig, path, env_prefix=ENV_PREFIX, environ=environ, overrides=overrides)
    return check(config, str(path) if path is not None else "configuration")
