"""Run the tracer's example training job (real gloo ranks on the CPU) for tests of any component.

`run_traced_job` runs ``python -m megatrace.tracer.example_train`` with the tracer enabled and returns
the job's trace folder (``<trace_dir>/<job>`` with ``rank-<N>.trace`` and dump files). With an
injected hang (``MEGATRACE_FAULT_HANG_RANK`` in `env`) it waits until every rank has written a stall
dump, then kills the job. `start_traced_job` gives the running process for tests that watch it live.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from megatrace.tracer.dumpfile import read_dump

_counter = itertools.count()
HANG_MESSAGE = b"megatrace fault injection: hang"


def job_env(trace_dir: Path, job: str, env: dict[str, str] | None) -> dict[str, str]:
    """The environment of a traced job: tracer on, writing to `trace_dir`/`job`; `env` wins."""
    merged = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE_", "NCCL_MEGATRACE_"))}
    merged.update(
        MEGATRACE_TRACE_ENABLE="1",
        MEGATRACE_TRACE_DIR=str(trace_dir),
        MEGATRACE_TRACE_JOB=job,
        MEGATRACE_TRACE_STALL_MS="1500",
        MEGATRACE_TRACE_CAPACITY="4096",
        OMP_NUM_THREADS="1",
    )
    merged.update(env or {})
    return merged


def _stop(proc: subprocess.Popen) -> None:
    """Kill the job's whole process group (launcher and ranks) and reap the launcher."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@contextlib.contextmanager
def start_traced_job(
    trace_dir: Path,
    nprocs: int = 4,
    steps: int = 10,
    env: dict[str, str] | None = None,
    tp: int = 2,
    extra_args: tuple[str, ...] = (),
    log_path: Path | None = None,
) -> Iterator[tuple[subprocess.Popen, Path]]:
    """Start the example job; yields (launcher process, job trace folder); kills what is left on exit."""
    job = (env or {}).get("MEGATRACE_TRACE_JOB") or f"example-{os.getpid()}-{next(_counter)}"
    argv = [
        sys.executable, "-m", "megatrace.tracer.example_train",
        f"--nprocs={nprocs}", f"--steps={steps}", f"--tp={tp}", "--timeout=60", *extra_args,
    ]  # fmt: skip
    log_path = log_path or Path(trace_dir) / f"{job}.log"
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            env=job_env(Path(trace_dir), job, env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc, Path(trace_dir) / job
    finally:
        _stop(proc)


def stall_dumps(job_dir: Path, since_ns: int = 0) -> dict[int, list[Path]]:
    """Stall dumps in a job folder taken after `since_ns` (CLOCK_REALTIME), by rank."""
    found: dict[int, list[Path]] = {}
    for path in sorted(Path(job_dir).glob("rank-*.dump")):
        snapshot = read_dump(path)
        if snapshot.reason == "stall" and snapshot.taken_ns > since_ns:
            found.setdefault(snapshot.header.rank, []).append(path)
    return found


def run_traced_job(
    trace_dir: Path,
    nprocs: int = 4,
    steps: int = 10,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    tp: int = 2,
) -> Path:
    """Run the example job to its end (or, with a hang injected, until every rank dumped); its folder."""
    hang = bool((env or {}).get("MEGATRACE_FAULT_HANG_RANK"))
    with start_traced_job(trace_dir, nprocs, steps, env, tp) as (proc, job_dir):
        log_path = Path(trace_dir) / f"{job_dir.name}.log"
        hang_seen_ns = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if hang and not hang_seen_ns and HANG_MESSAGE in log_path.read_bytes():
                hang_seen_ns = time.time_ns() - 200_000_000  # polled every 0.1 s
            if hang_seen_ns and len(stall_dumps(job_dir, hang_seen_ns)) == nprocs:
                return job_dir
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        log = log_path.read_text(errors="replace")[-4000:]
        if proc.poll() is None:
            raise TimeoutError(f"traced job {job_dir.name} still running after {timeout}s:\n{log}")
        if hang:
            raise RuntimeError(f"traced job {job_dir.name} ended before every rank dumped a stall:\n{log}")
        if proc.returncode != 0:
            raise RuntimeError(f"traced job {job_dir.name} exited with {proc.returncode}:\n{log}")
        return job_dir


def trace_under_torchrun(
    trace_dir: Path, job: str, script: Path, nprocs: int, native: bool | None = None, timeout: float = 280
) -> subprocess.CompletedProcess:
    """Run `script` with torchrun (`nprocs` ranks) under ``megatrace trace`` into `trace_dir`/`job`;
    `native` forces the capture (None: the tracer's default). Fails the test if the job fails."""
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [
        sys.executable, "-m", "megatrace.cli", "trace", "--trace-dir", str(trace_dir), "--job", job,
        "--stall-ms", "60000", "--", str(torchrun), "--standalone", "--nproc-per-node", str(nprocs),
        str(script),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE_", "NCCL_MEGATRACE_"))}
    if native is not None:
        env["MEGATRACE_TRACE_NATIVE"] = "1" if native else "0"
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done
