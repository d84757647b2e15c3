"""`megatrace stack up|down|status`: the whole pipeline as local processes on loopback ports."""

from __future__ import annotations

import argparse
import sys

from megatrace.config import load_config
from megatrace.demo import DEMO_SETTINGS, DemoFailed
from megatrace.stack import StackError, down, status, up
from megatrace.stack_config import StackConfig


def load_stack_config(args: argparse.Namespace, demo: bool = False) -> StackConfig:
    """The stack configuration from ``--config``, ``MEGATRACE_STACK_*`` and ``--state-dir``.

    The demo runs with compressed time (see `megatrace.demo.DEMO_SETTINGS`) and its own state dir.
    """
    overrides = dict(DEMO_SETTINGS) if demo else {}
    if args.state_dir:
        overrides["state_dir"] = args.state_dir
    return load_config(StackConfig, args.config, env_prefix="MEGATRACE_STACK_", overrides=overrides)


def _up(args: argparse.Namespace) -> int:
    config = load_stack_config(args)
    print(f"starting the Megatrace stack in {config.state_dir}")
    try:
        up(config)
    except StackError as exc:
        print(f"megatrace stack: {exc}", file=sys.stderr)
        return 1
    print(f"trace directory for training jobs: {config.trace_dir}  (MEGATRACE_TRACE_DIR)")
    where = f" --state-dir {args.state_dir}" if args.state_dir else ""
    print(f"stop it with: megatrace stack{where} down")
    return 0


def _down(args: argparse.Namespace) -> int:
    stopped = down(load_stack_config(args))
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    return 0


def _status(args: argparse.Namespace) -> int:
    parts = status(load_stack_config(args))
    if not parts:
        print("the stack is not running")
        return 3
    for part in parts:
        state = "up" if part.healthy else ("unhealthy" if part.running else "exited")
        print(f"{part.name:<14} {state:<10} pid {part.pid:<8} {part.url}")
        if not part.running:
            print(f"{'':<14} log: {part.log}")
    return 0 if all(part.healthy for part in parts) else 1


def _demo(args: argparse.Namespace) -> int:
    from megatrace.demo import Scenario, main, prepare_state_dir

    config = load_stack_config(args, demo=True)
    try:
        prepare_state_dir(config)
    except DemoFailed as exc:
        print(f"megatrace stack demo: {exc}", file=sys.stderr)
        return 2
    return main(config, Scenario(seed=args.seed))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `megatrace stack`."""
    parser = subparsers.add_parser(
        "stack",
        help="run the whole pipeline locally (exporter, Prometheus, Alertmanager, node_exporter, alert bot)",
    )
    parser.add_argument("--config", help="YAML stack configuration (optional; embedded defaults otherwise)")
    parser.add_argument(
        "--state-dir", help="where configs, data and logs go (default ~/.local/state/megatrace/stack)"
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("up", help="start every part and wait until healthy").set_defaults(func=_up)
    actions.add_parser("down", help="stop what `up` started, and nothing else").set_defaults(func=_down)
    actions.add_parser("status", help="show each part and whether it answers").set_defaults(func=_status)
    demo = actions.add_parser(
        "demo",
        help="scripted scenario: a real job hangs, then runs slow; follow the alerts to the bot's messages",
    )
    demo.add_argument("--seed", type=int, help="seed for choosing the faulty ranks (default: random)")
    demo.set_defaults(func=_demo)
