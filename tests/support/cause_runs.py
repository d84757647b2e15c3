"""Run the cause job (tests/support/cause_job.py) under ``megatrace trace`` with torchrun, with faults
applied to its ranks while it runs, and analyze its traces.

`run_faulted` starts the job, finds each rank's process (by an id put in the job's environment), calls
`prepare(pids)` at once (to pin ranks, move them into cgroups), samples their /proc counters, calls
`strike()` once every rank finished step 1 (to start hogs, set limits), `release()` once the log shows
`release_at` (the last step: a throttled rank would take long to shut down), then waits for the job's end or,
when `hang_mark` names the log line a rank writes before it blocks, until every rank wrote a stall dump
(all but one, and 8 s more: a rank blocked in C while holding the GIL may write none) and
`while_hung(pids)` has looked at the blocked rank; then it stops the job and runs ``megatrace
analyze --format json`` on the traces.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.gloo_job import stall_dumps
from tests.support.host_faults import ProcWatch

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "MEGATRACE_CAUSE_RUN"
_STEP = re.compile(r"^rank (\d+) step (\d+) local ([0-9.]+)$", re.M)


@dataclass
class CauseRun:
    """A finished run: its trace folder, log, rank processes and their counters, the analysis, and for
    a hang the ranks that dumped."""

    job_dir: Path
    log: str
    pids: dict[int, int]
    watch: ProcWatch
    report: dict
    analyze_code: int
    dumped: set[int]  # ranks that wrote a stall dump once the job hung

    def local_s(self, rank: int, from_step: int) -> float:
        """The median time rank `rank` spent outside collectives per step, from `from_step` on."""
        times = [float(t) for r, s, t in _STEP.findall(self.log) if int(r) == rank and int(s) >= from_step]
        if not times:
            raise AssertionError(f"rank {rank} logged no step from {from_step} on:\n{self.log[-3000:]}")
        return statistics.median(times)

    def slowdown(self, rank: int, from_step: int) -> float:
        """Rank `rank`'s median local time per step over the median of its peers'."""
        peers = [self.local_s(r, from_step) for r in self.pids if r != rank]
        return self.local_s(rank, from_step) / statistics.median(peers)

    @property
    def why(self) -> dict:
        return self.report.get("why") or {}

    def top_suspect(self) -> tuple[int, str] | None:
        """(rank, kind) of the analyzer's most likely suspect, None when it names none."""
        suspects = self.report.get("suspects") or []
        return (suspects[0]["rank"], suspects[0]["kind"]) if suspects else None


def _run_processes(run_id: str) -> dict[int, int]:
    """The job's worker processes now (rank → pid), found by their environment."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            env = dict(
                item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item
            )
            if env.get(RUN_ID.encode()) == run_id.encode() and b"LOCAL_RANK" in env:
                found[int(env[b"RANK"])] = int(proc.name)
    return found


def _rank_pids(run_id: str, world: int) -> dict[int, int]:
    """Every rank's process once all `world` have started, else {}."""
    found = _run_processes(run_id)
    return found if len(found) == world else {}


def _kill_ranks(run_id: str) -> None:
    """Kill the job's workers that outlived the launcher (torchrun starts each in a session of its own:
    a rank stuck in C, or one waiting for it in a collective, would live on) and wait until they are gone."""
    deadline = time.monotonic() + 10
    while (left := _run_processes(run_id)) and time.monotonic() < deadline:
        for pid in left.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    assert not left, f"ranks {sorted(left)} of the job outlived SIGKILL"


def _wait(what: str, until: Callable[[], object], proc: subprocess.Popen, log: Path, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = until()
        if got:
            return got
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(
        f"waiting for {what}: job {'ended' if proc.poll() is not None else 'timed out'}:\n"
        f"{log.read_text(errors='replace')[-4000:]}"
    )


def analyze(job_dir: Path) -> tuple[int, dict]:
    """``megatrace analyze --format json`` of the job's traces: (exit code, report)."""
    done = subprocess.run(
        [sys.executable, "-m", "megatrace.cli", "analyze", "--format", "json", str(job_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 1, 3), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout)


def run_faulted(
    folder: Path,
    world: int,
    job_args: Sequence[str],
    prepare: Callable[[dict[int, int]], None] = lambda pids: None,
    strike: Callable[[], None] = lambda: None,
    hang_mark: str = "",
    while_hung: Callable[[dict[int, int]], None] = lambda pids: None,
    release_at: str = "",
    release: Callable[[], None] = lambda: None,
    timeout: float = 150.0,
) -> CauseRun:
    """Run the job with `world` ranks (see the module's docstring); the job must end well unless hung."""
    run_id = uuid.uuid4().hex
    job = f"cause-{run_id[:8]}"
    trace_dir = folder / "trace"
    log_path = folder / f"{job}.log"
    argv = [
        sys.executable, "-m", "megatrace.cli", "trace", f"--trace-dir={trace_dir}", f"--job={job}",
        "--stall-ms=1500", "--", str(Path(sys.executable).with_name("torchrun")), "--standalone",
        f"--nproc-per-node={world}", "-m", "tests.support.cause_job", *job_args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE_", "NCCL_MEGATRACE_"))}
    env.update({RUN_ID: run_id, "OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    folder.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    watch = ProcWatch({})
    dumped: set[int] = set()
    try:
        pids = _wait("the ranks' processes", lambda: _rank_pids(run_id, world), proc, log_path, 60)
        prepare(pids)
        watch.pids = pids
        watch.start()
        _wait("step 1", lambda: "rank 0 step 1 " in log_path.read_text(errors="replace"), proc, log_path, 90)
        strike()
        if hang_mark:
            _wait("the hang", lambda: hang_mark in log_path.read_text(errors="replace"), proc, log_path, 60)
            since = time.time_ns() - 200_000_000
            _wait(
                "the stall dumps",
                lambda: len(stall_dumps(trace_dir / job, since)) >= world - 1,
                proc,
                log_path,
                60,
            )
            with contextlib.suppress(AssertionError):  # a rank blocked holding the GIL may never dump
                _wait(
                    "the last stall dump",
                    lambda: len(stall_dumps(trace_dir / job, since)) == world,
                    proc,
                    log_path,
                    8,
                )
            dumped = set(stall_dumps(trace_dir / job, since))
            while_hung(pids)
        else:
            if release_at:
                _wait(
                    "the last step",
                    lambda: release_at in log_path.read_text(errors="replace"),
                    proc,
                    log_path,
                    timeout,
                )
                release()
            proc.wait(timeout=timeout)
            assert proc.returncode == 0, log_path.read_text(errors="replace")[-4000:]
    finally:
        watch.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _kill_ranks(run_id)
    code, report = analyze(trace_dir / job)
    return CauseRun(trace_dir / job, log_path.read_text(errors="replace"), pids, watch, report, code, dumped)
