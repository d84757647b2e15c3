"""``megatrace analyze``: name the hung or slow rank from trace logs (text, JSON or Chrome-trace output)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatrace.analyzer import run
from megatrace.analyzer.layout import DEFAULT_ORDER, LayoutError, layout_config_from, load_layout_file
from megatrace.analyzer.report import render
from megatrace.analyzer.uncollected import parse_ranks, read_ranks_file
from megatrace.config import ConfigError

EXIT_CODES = {"healthy": 0, "hang": 1, "slow": 1, "inconclusive": 3, "no-data": 3}
LAYOUT_FLAGS = ("world_size", "tp", "pp", "dp", "cp", "ep", "order", "gpus_per_node")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="localize the hung or slow rank from trace logs",
        description="Read trace logs (Megatrace ring files and dumps, Megatrace NCCL logs, PyTorch Flight "
        "Recorder dumps; formats are auto-detected) and name the hung or slow rank. Exit code 0 when "
        "healthy, 1 when a hang or slow rank is found, 2 on bad arguments, 3 when the logs allow no "
        "safe call (inconclusive) or nothing readable was found (no data).",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace files or directories holding them")
    p.add_argument("--format", choices=["text", "json", "chrome"], default="text", help="report format")
    p.add_argument("--output", "-o", metavar="FILE", help="write the report here instead of stdout")
    p.add_argument("--world-size", type=int, help="number of ranks (default: from the logs)")
    p.add_argument("--tp", type=int, help="tensor-parallel size")
    p.add_argument("--pp", type=int, help="pipeline-parallel size")
    p.add_argument("--dp", type=int, help="data-parallel size (default: what remains of the world size)")
    p.add_argument("--cp", type=int, help="context-parallel size")
    p.add_argument("--ep", type=int, help="expert-parallel size")
    p.add_argument("--order", help=f"Megatron order string, fastest first (default {DEFAULT_ORDER})")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node when logs do not name hosts (default 8)")
    p.add_argument("--layout", metavar="FILE", help="YAML layout file (keys as the flags, e.g. tp: 8)")
    p.add_argument("--stall-seconds", type=float, default=1.0, help="in-flight this long counts as stuck")
    p.add_argument(
        "--uncollected-ranks",
        metavar="LIST",
        help="ranks whose trace data could not be collected (agent unreachable, timed out, partitioned), "
        "e.g. 0-3,8: missing data is then no evidence against them, and they are never named for it",
    )
    p.add_argument(
        "--uncollected-ranks-file",
        metavar="FILE",
        help="the same list read from a file (commas, spaces or lines between items; # starts a comment)",
    )
    p.add_argument(
        "--reader-option",
        action="append",
        default=[],
        metavar="READER.KEY=VALUE",
        help="a setting of one trace format's reader (repeatable), e.g. --reader-option NAME.KEY=VALUE; "
        "an unknown reader or key is an error",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=handle)


def uncollected_ranks(args: argparse.Namespace) -> frozenset[int]:
    """The ranks of --uncollected-ranks and --uncollected-ranks-file together; ValueError or OSError
    naming the flag."""
    ranks: frozenset[int] = frozenset()
    if args.uncollected_ranks is not None:
        try:
            ranks |= parse_ranks(args.uncollected_ranks)
        except ValueError as exc:
            raise ValueError(f"--uncollected-ranks: {exc}") from None
    if args.uncollected_ranks_file is not None:
        try:
            ranks |= read_ranks_file(args.uncollected_ranks_file)
        except OSError as exc:
            raise OSError(
                f"--uncollected-ranks-file {args.uncollected_ranks_file}: {exc.strerror or exc}"
            ) from None
        except ValueError as exc:
            raise ValueError(f"--uncollected-ranks-file {args.uncollected_ranks_file}: {exc}") from None
    return ranks


def reader_options(items: list[str]) -> dict[str, dict[str, str]]:
    """``READER.KEY=VALUE`` items of --reader-option as reader -> key -> value; ValueError naming the item."""
    options: dict[str, dict[str, str]] = {}
    for item in items:
        name, dot, rest = item.partition(".")
        key, equals, value = rest.partition("=")
        if not (name and dot and key and equals):
            raise ValueError(f"--reader-option {item!r}: expected READER.KEY=VALUE")
        options.setdefault(name, {})[key] = value
    return options


def handle(args: argparse.Namespace) -> int:
    values = {name: getattr(args, name) for name in LAYOUT_FLAGS}
    given = {k: v for k, v in values.items() if v is not None}
    if args.stall_seconds < 0:
        print("megatrace analyze: --stall-seconds must be 0 or more", file=sys.stderr)
        return 2
    try:
        uncollected = uncollected_ranks(args)
        options = reader_options(args.reader_option)
    except (OSError, ValueError) as exc:
        print(f"megatrace analyze: {exc}", file=sys.stderr)
        return 2
    try:
        if args.layout:
            config = load_layout_file(args.layout, overrides=given)
        else:
            config = layout_config_from(given) if given else None
        report, table = run(
            args.paths,
            config,
            progress=not args.quiet and sys.stderr.isatty(),
            stall_s=args.stall_seconds,
            uncollected=uncollected,
            reader_options=options,
        )
    except (LayoutError, ConfigError) as exc:
        print(f"megatrace analyze: {exc}", file=sys.stderr)
        return 2
    text = render(report, args.format, table)
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:
            print(
                f"megatrace analyze: cannot write --output {args.output}: {exc.strerror or exc}",
                file=sys.stderr,
            )
            return 2
    else:
        sys.stdout.write(text)
    return EXIT_CODES[report["verdict"]]
