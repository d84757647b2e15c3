"""`megatrace trace [options] -- COMMAND…`: run a command with the collective tracer on in every rank.

Sets the tracer's environment and puts a generated ``sitecustomize.py`` first on PYTHONPATH, so every
Python process the command starts (torchrun workers included) installs the tracer once it imports
torch; the training script needs no change. Says which capture the ranks use (native process-group
capture, or the Python fallback and why). Returns the command's exit status.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from megatrace.tracer.autoload import SITECUSTOMIZE
from megatrace.tracer.settings import fault_settings, trace_settings, writable_trace_dir


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
    parser.add_argument("--stall-ms", type=int, help="stall sensitivity in ms (default 3000)")
    parser.add_argument("--capacity", type=int, help="records kept per rank (ring size)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command to run")
    parser.set_defaults(func=run)


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
    with tempfile.TemporaryDirectory(prefix="megatrace-site-") as site:
        env = command_env(args, Path(site), dict(os.environ))
        settings = trace_settings(env)  # ConfigError here: the CLI reports it and exits 2
        fault_settings(env)
        (Path(site) / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        job_dir = writable_trace_dir(settings.dir) / settings.job
        print(f"megatrace trace: tracing into {job_dir}", file=sys.stderr, flush=True)
        print(
            f"megatrace trace: capture: {capture_description(settings.native)}", file=sys.stderr, flush=True
        )
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
