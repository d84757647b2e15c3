"""Where a stuck rank is stuck, from stacks captured in real processes (`tests.support.stuck_rank`):
a checkpoint write to a FIFO nobody reads (torch's file writer opens it holding the GIL, so only
faulthandler's timer sees it) and a file lock another process holds (the watchdog's stall dump)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from megatrace.analyzer.frames import is_internal, where_stuck
from megatrace.analyzer.loader import load
from megatrace.tracer.dumpfile import read_dump
from megatrace.tracer.stack_fallback import read_stacks_file
from megatrace.tracer.stacks import Frame, ThreadStack
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
STALL_MS = 500


@contextlib.contextmanager
def stuck_rank(job_dir: Path, mode: str, arg: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.stuck_rank", str(job_dir), str(STALL_MS), mode, arg],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def fired_stacks(job_dir: Path) -> bool:
    return any(read_stacks_file(path).firings for path in job_dir.glob("*.stacks"))


def stall_dump_with(job_dir: Path, function: str) -> bool:
    for path in job_dir.glob("*.dump"):
        with contextlib.suppress(ValueError):
            if any(f.function == function for s in read_dump(path).stacks if s.main for f in s.frames):
                return True
    return False


def test_a_checkpoint_write_to_a_fifo_is_found_in_torch_save(tmp_path: Path) -> None:
    fifo = tmp_path / "checkpoint.pt"
    os.mkfifo(fifo)
    job_dir = tmp_path / "job"
    with stuck_rank(job_dir, "fifo", str(fifo)):
        wait_for(lambda: fired_stacks(job_dir), 90, "faulthandler to write the stacks")
        table, report = load([tmp_path])
    assert report.files_by_format.get("stacks") == 1
    assert table.ranks[0].stacks_frozen  # faulthandler's timer took them: torch.save holds the GIL
    stacks = table.ranks[0].stacks
    stuck = where_stuck(stacks)
    assert stuck is not None
    assert stuck.frames[0].function == "save_checkpoint" and stuck.frames[0].file.endswith("stuck_rank.py")
    assert stuck.text.startswith("in `save_checkpoint` → `torch.serialization.save` (stuck_rank.py:")
    assert not any(is_internal(frame) for frame in stuck.frames)


def test_a_rank_waiting_on_a_file_lock_is_found_in_take_lock(tmp_path: Path) -> None:
    lock = tmp_path / "state.lock"
    job_dir = tmp_path / "job"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # this process holds it; the rank waits
        with stuck_rank(job_dir, "flock", str(lock)):
            wait_for(lambda: stall_dump_with(job_dir, "take_lock"), 90, "a stall dump naming take_lock")
            table, report = load([tmp_path])
    assert report.files_by_format.get("dump", 0) >= 1 and report.files_by_format.get("ring") == 1
    # the live ring wins over the dump as the rank's calls; the dump's stacks still reach the rank
    assert table.ranks[0].fmt == "ring" and not table.ranks[0].stacks_frozen
    stuck = where_stuck(table.ranks[0].stacks, in_flight="")
    assert stuck is not None and stuck.frames[0].function == "take_lock"
    assert stuck.text.startswith("in `main` → `take_lock` (stuck_rank.py:")


def test_internals_are_skipped_and_the_collective_in_flight_is_said() -> None:
    """A constructed stack (not captured): the installed-package paths a rank has, which this
    checkout's editable install does not produce."""
    torch_file = "/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py"
    stack = ThreadStack(
        thread_id=1,
        name="MainThread",
        main=True,
        frames=(
            Frame("/venv/lib/python3.11/site-packages/megatrace/tracer/wrappers.py", 88, "traced"),
            Frame(torch_file, 2501, "all_reduce"),
            Frame("/venv/lib/python3.11/site-packages/megatrace/tracer/wrappers.py", 90, "call"),
            Frame("/job/train.py", 41, "step"),
            Frame("/job/train.py", 70, "main"),
        ),
    )
    stuck = where_stuck((stack,), in_flight="all_reduce")
    assert stuck is not None and [f.function for f in stuck.frames] == ["step", "main"]
    assert stuck.text == (
        "in `step` → `torch.distributed.distributed_c10d.all_reduce` (train.py:41), "
        "collective `all_reduce` in flight"
    )
    assert where_stuck(()) is None
    assert where_stuck((ThreadStack(2, "", False, stack.frames),)) is None
