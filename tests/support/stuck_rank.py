"""A traced process that gets stuck for real, for the stack tests: it records into a ring (rank 0 of a
one-rank job, no torch.distributed), runs the tracer's watchdog, names a helper thread, then:

- ``gil SECONDS``: holds the GIL in C for SECONDS (`ctypes.pythonapi` calls never release it) in
  `hold_the_gil`, then exits cleanly;
- ``user-timer SECONDS FILE``: arms faulthandler's timer itself (into FILE), then holds the GIL;
- ``fifo PATH``: `torch.save` to a FIFO nobody reads (the open blocks) in `save_checkpoint`;
- ``flock PATH``: `fcntl.flock` on a file another process holds locked, in `take_lock`.

Usage: ``python -m tests.support.stuck_rank JOB_DIR STALL_MS MODE ARG…``. It prints "stuck" before it
gets stuck. Each mode's stuck function is named for it, so tests can look for that frame.
"""

from __future__ import annotations

import ctypes
import faulthandler
import fcntl
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import DTYPE_CODES, OP_CODES, RankIdentity, RingWriter, comm_id, ring_path
from megatrace.tracer.watchdog import Watchdog

HELPER_THREAD = "loader-helper"


def hold_the_gil(seconds: int) -> None:
    ctypes.pythonapi.sleep(seconds)


def save_checkpoint(path: str) -> None:
    import torch

    torch.save({"weights": torch.zeros(4)}, path)


def take_lock(path: str) -> None:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)


def main(job_dir: Path, stall_ms: int, mode: str, args: list[str]) -> None:
    if mode == "fifo":
        import torch  # noqa: F401 - before the first op: importing it takes long enough to be a stall
    identity = RankIdentity(job_dir.name, 0, 0, 1, "localhost", os.getpid(), time.time_ns())
    stall_ns = stall_ms * 1_000_000
    writer = RingWriter(ring_path(job_dir, 0), identity, 64, stall_threshold_ns=stall_ns)
    recorder = Recorder(writer, rank=0)
    cid = comm_id([0])
    writer.add_communicator(cid, (0,))
    recorder.end(recorder.begin(cid, OP_CODES["all_reduce"], 16, DTYPE_CODES["float32"], -1, 0))
    watchdog = Watchdog(recorder, job_dir, 0, stall_ns)
    watchdog.start_thread()
    jobs: queue.Queue[int] = queue.Queue()
    threading.Thread(target=jobs.get, name=HELPER_THREAD, daemon=True).start()
    time.sleep(0.3)  # a few watchdog ticks: the threads are named in the stacks file
    print("stuck", flush=True)
    if mode == "gil":
        hold_the_gil(int(args[0]))
    elif mode == "user-timer":
        user_file = open(args[1], "w")  # noqa: SIM115 - faulthandler writes into it after this returns
        faulthandler.dump_traceback_later(1, file=user_file)
        hold_the_gil(int(args[0]))
    elif mode == "fifo":
        save_checkpoint(args[0])
    elif mode == "flock":
        take_lock(args[0])
    watchdog.stop()
    writer.close()


def held_gil_stacks(job_dir: Path) -> None:
    """Run a rank that holds the GIL for 3 s past a 0.5 s stall threshold, in its own process, so that
    faulthandler's timer writes its stacks file into `job_dir`."""
    subprocess.run(
        [sys.executable, "-m", "tests.support.stuck_rank", str(job_dir), "500", "gil", "3"],
        cwd=Path(__file__).resolve().parents[2],
        check=True,
        capture_output=True,
        timeout=60,
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:])
