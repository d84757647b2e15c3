"""The `megatrace` command: global flags, then one subcommand per component.

A component adds its subcommand by exposing ``register(subparsers)`` in a module listed in
`COMMAND_MODULES`; `register` adds a parser and sets ``func`` (taking the parsed args, returning
an exit code) as its default.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from megatrace import __version__
from megatrace.config import ConfigError
from megatrace.logsetup import setup_logging

COMMAND_MODULES: tuple[str, ...] = (
    "megatrace.exporters.cli",
    "megatrace.alertbot.command",
    "megatrace.analyzer.cli",
    "megatrace.tracer.trace_command",
    "megatrace.stack_cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every landed subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="megatrace",
        description="Monitor distributed training: trace collectives, export GPU/IB metrics, "
        "localize hung and slow ranks, and deliver graded alerts.",
    )
    parser.add_argument("--version", action="version", version=f"megatrace {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"], help="log line format")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    setup_logging(args.log_level, args.log_format)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"megatrace: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
