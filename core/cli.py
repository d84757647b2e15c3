"""The `megatrace` command: global flags, then one subcommand per component.

A component adds its subcommand by exposing ``register(subparsers)`` in a module listed in
`COMMANDS`; `register` adds a parser and sets ``func`` (taking the parsed args, returning an exit
code) as its default. Only the module of the subcommand being run is imported, so the node agent
does not carry the analyzer's pandas, nor the analyzer the alert bot's scheduler.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from megatrace import __version__
from megatrace.config import ConfigError
from megatrace.logsetup import setup_logging

COMMANDS: dict[str, tuple[str, str]] = {
    "exporter": ("megatrace.exporters.cli", "run the node agent: GPU, InfiniBand/RoCE and tracer metrics"),
    "analyze": ("megatrace.analyzer.cli", "localize the hung or slow rank from trace logs"),
    "alertbot": ("megatrace.alertbot.command", "run the alert bot, or write its weekly report"),
    "trace": ("megatrace.tracer.trace_command", "run a training command with the collective tracer enabled"),
    "stack": ("megatrace.stack_cli", "run the whole pipeline locally; `stack demo` shows it at work"),
}


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argument parser; the subcommand named in `argv` (if any) is registered in full, the others
    by name and summary only."""
    chosen = next((arg for arg in argv if arg in COMMANDS), None)
    parser = argparse.ArgumentParser(
        prog="megatrace",
        description="Monitor distributed training: trace collectives, export GPU/IB metrics, "
        "localize hung and slow ranks, and deliver graded alerts.",
    )
    parser.add_argument("--version", action="version", version=f"megatrace {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"], help="log line format")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        if name == chosen:
            importlib.import_module(module).register(subparsers)
        else:
            subparsers.add_parser(name, help=summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
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
