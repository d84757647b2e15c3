"""`megatrace trace [options] -- COMMAND…`: run a command with the collective tracer on in every rank.

Sets the tracer's environment and puts a generated ``sitecustomize.py`` first on PYTHONPATH, so every
Python process the command starts (torchrun workers included) installs the tracer once it imports
torch; the training script needs no change. Says which capture the ranks use (native process-group
capture, or the Python fallback and why). Returns the command's exit status.

Tracing never stops training: bad ``MEGATRACE_TRACE_*``/``MEGATRACE_FAULT_*`` values, or no trace
folder that can be written, are a loud warning and the command runs untraced (``--strict`` refuses to
start it instead, exit 2).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from megatrace.config import ConfigError
from megatrace.tracer.autoload import SITECUSTOMIZE
from megatrace.tracer.ringfile import DEFAULT_CAPACITY
from megatrace.tracer.settings import fault_settings, job_trace_dir, trace_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="run a training command with the collective tracer enabled",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: megatrace trace --trace-dir /tmp/traces -- torchrun --nproc-per-node 8 train.py",
    )
    parser.add_argument("--trace-dir", help="folder for <job>/rank-N.trace (env MEGATRACE_TRACE_DIR)")
    parser.add_argument("--job", help="job id (default: torchrun run id, Slurm job id, else 'local')")
    parser.add_argument(
        "--stall-ms", type=_at_least(1, "--stall-ms"), help="stall sensitivity in ms (default 3000)"
    )
    parser.add_argument(
        "--capacity",
        type=_at_least(16, "--capacity"),
        help=f"records kept per rank (ring size, default {DEFAULT_CAPACITY})",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="refuse to start the command when the tracer's settings are bad (default: run it untraced)",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command to run")
    parser.set_defaults(func=run)


def _at_least(low: int, flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag}: must be at least {low}, got {value}")
        return value

    return parse


def command_env(args: argparse.Namespace, site_dir: Path, environ: dict[str, str]) -> dict[str, str]:
    """The command's environment: tracer switched on, options as variables, our site dir on PYTHONPATH."""
    env = dict(environ)
    env["MEGATRACE_TRACE_ENABLE"] = "1"
    for flag, name in (
        ("trace_dir", "DIR"),
        ("job", "JOB"),
        ("stall_ms", "STALL_MS"),
        ("capacity", "CAPACITY"),
    ):
        value = getattr(args, flag)
        if value is not None:
            env[f"MEGATRACE_TRACE_{name}"] = str(value)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site_dir), environ.get("PYTHONPATH", "")) if p)
    return env


def tracing_problem(env: dict[str, str]) -> str | None:
    """Why the command cannot be traced with `env` (bad settings, no writable folder); None when it
    can, after saying where it traces to."""
    try:
        settings = trace_settings(env)
        fault_settings(env)
    except ConfigError as exc:
        return f"bad tracer settings: {exc}"
    job_dir, why = job_trace_dir(settings.dir, settings.job)
    if job_dir is None:
        return f"no writable trace folder ({settings.dir}/{settings.job}: {why}; nor one in the temp dir)"
    fallen_back = (
        f" ({settings.dir}/{settings.job}: {why}; the node agent does not look there)" if why else ""
    )
    print(f"megatrace trace: tracing into {job_dir}{fallen_back}", file=sys.stderr, flush=True)
    return None


def capture_description(wanted: bool) -> str:
    """Which capture the ranks will use, as this process finds it (same torch, same environment)."""
    try:
        from megatrace.tracer import native
    except ImportError as exc:
        return f"decided by each rank (torch not importable here: {exc})"
    return native.capture_description(wanted)


def run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print(
            "megatrace trace: no command given (usage: megatrace trace [options] -- COMMAND …)",
            file=sys.stderr,
        )
        return 2
    if shutil.which(cmd[0]) is None:  # say so before anything is created on disk
        print(f"megatrace trace: cannot run {cmd[0]!r}: command not found", file=sys.stderr)
        return 127
    with tempfile.TemporaryDirectory(prefix="megatrace-site-") as site:
        env = command_env(args, Path(site), dict(os.environ))
        problem = tracing_problem(env)
        if problem is not None and args.strict:
            print(f"megatrace trace: {problem} (--strict: not starting the command)", file=sys.stderr)
            return 2
        if problem is not None:
            print(
                f"megatrace trace: WARNING: NOT TRACING: {problem}; the command runs untraced "
                "(--strict refuses to start it instead)",
                file=sys.stderr,
                flush=True,
            )
            env["MEGATRACE_TRACE_ENABLE"] = "0"
            env["NCCL_MEGATRACE_ENABLE"] = "0"
        else:
            (Path(site) / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
            wanted = trace_settings(env).native
            print(f"megatrace trace: capture: {capture_description(wanted)}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.Popen(cmd, env=env)
        except OSError as exc:
            print(f"megatrace trace: cannot run {cmd[0]!r}: {exc.strerror or exc}", file=sys.stderr)
            return 127

        def forward(signum: int, _frame: object) -> None:
            proc.send_signal(signum)

        previous = {
            sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
        }
        try:
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return code if code >= 0 else 128 - code
