"""`megatrace exporter`: build the enabled collectors and serve them until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from megatrace.exporters.collector_settings import add_flags, flag_values
from megatrace.exporters.collectors import COLLECTORS, build, default_collectors
from megatrace.exporters.guard import Collector, GuardedCollectors
from megatrace.exporters.server import MetricsServer
from megatrace.exporters.settings import DEFAULT_PORT, ExporterConfig, load
from megatrace.listen import parse_host_port

if TYPE_CHECKING:
    from megatrace.exporters.trace_retention import RetentionThread

log = logging.getLogger(__name__)


def build_collectors(config: ExporterConfig, nvml: Any = None) -> GuardedCollectors:
    """The enabled collectors, in the table's order, wrapped so that one failing never breaks a scrape.
    A collector that cannot be built (its port taken, its token file unreadable) stops the ones built."""
    collectors: dict[str, Collector] = {}
    try:
        for name in COLLECTORS:
            if name in config.collectors:
                collectors[name] = build(name, config, nvml)
    except BaseException:
        GuardedCollectors(collectors).close()
        raise
    return GuardedCollectors(collectors)


def build_registry(guarded: GuardedCollectors) -> CollectorRegistry:
    """A registry of our own (never the process-global default) holding the guarded collectors."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(guarded)
    return registry


# Collectors also served alone, on a path of their own (scraped at an interval of their own).
OWN_PATHS = {"tracer": "/metrics/tracer"}


def own_path_registries(guarded: GuardedCollectors) -> dict[str, CollectorRegistry]:
    """Path -> registry of one enabled collector of `OWN_PATHS` alone (the same collector object)."""
    return {
        path: build_registry(GuardedCollectors({name: guarded.collectors[name]}))
        for name, path in OWN_PATHS.items()
        if name in guarded.collectors
    }


def run(config: ExporterConfig) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit code."""
    try:
        guarded = build_collectors(config)
    except (OSError, ValueError) as exc:
        log.error("cannot start the agent: %s", exc)
        return 1
    host, port = parse_host_port(config.listen)
    try:
        server = MetricsServer(
            (host, port),
            build_registry(guarded),
            config.read_timeout_s,
            config.max_connections,
            own_path_registries(guarded),
        )
    except OSError as exc:
        log.error("cannot listen on %s: %s", config.listen, exc.strerror or exc)
        guarded.close()
        return 1

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    retention = start_retention(config)
    log.info(
        "serving /metrics on %s:%d (collectors: %s)",
        host,
        server.server_address[1],
        ", ".join(guarded.collectors),
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
        guarded.close()
        if retention is not None:
            retention.close()
    return 0


def start_retention(config: ExporterConfig) -> RetentionThread | None:
    """Remove finished jobs' trace folders in the background, when the agent watches traces."""
    if "tracer" not in config.collectors:
        return None
    tracer = config.settings("tracer")
    max_age_s = tracer.trace_retention_hours * 3600 if tracer.trace_retention_hours else float("inf")
    if max_age_s == float("inf") and not tracer.trace_max_bytes:
        return None
    from megatrace.exporters.trace_retention import RetentionThread

    retention = RetentionThread(
        tracer.trace_dir, max_age_s, tracer.trace_max_bytes, tracer.tracer_grace_seconds
    )
    retention.start()
    return retention


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags: the agent's own and every collector's."""
    given = {key: getattr(args, key) for key in ("listen", "collectors") if getattr(args, key) is not None}
    return given | flag_values(args)


def handle(args: argparse.Namespace) -> int:
    return run(load(args.config, overrides(args)))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "exporter",
        help="run the node agent: GPU, InfiniBand/RoCE and tracer metrics on one /metrics endpoint",
        description="Serve GPU (NVML), InfiniBand/RoCE (sysfs) and tracer metrics for Prometheus. "
        "Settings come from --config, then MEGATRACE_EXPORTER_* variables, then flags. "
        f"Default port {DEFAULT_PORT}.",
    )
    parser.add_argument("--config", type=Path, help="YAML configuration file")
    parser.add_argument(
        "--listen", metavar="HOST:PORT", help=f"address to serve on (default 0.0.0.0:{DEFAULT_PORT})"
    )
    parser.add_argument(
        "--collectors",
        metavar="LIST",
        help=f"comma-separated collectors to enable, of {','.join(COLLECTORS)} "
        f"(default {','.join(default_collectors())})",
    )
    add_flags(parser.add_argument_group("collector settings"))
    parser.set_defaults(func=handle)
