"""Python stacks in stall dumps, and faulthandler's timer for a rank stuck holding the GIL.

Every stack here is captured from a real thread or a real process (`tests.support.stuck_rank`);
faulthandler's text is its real output.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from pathlib import Path

import pytest

from megatrace.tracer.dumpfile import DumpFormatError, read_dump, write_dump
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import (
    DTYPE_CODES,
    OP_CODES,
    RankIdentity,
    RingWriter,
    comm_id,
    read_ring,
    ring_path,
)
from megatrace.tracer.settings import trace_settings
from megatrace.tracer.stack_fallback import read_stacks_file
from megatrace.tracer.stacks import MAX_FRAMES, capture_stacks, main_stack, parse_faulthandler, thread_names
from megatrace.tracer.watchdog import Watchdog
from tests.support.stuck_rank import HELPER_THREAD

REPO = Path(__file__).resolve().parents[2]
STALL_NS = 500_000_000
FALLBACK_OFF = {"MEGATRACE_TRACE_ENABLE": "1", "MEGATRACE_TRACE_STACKS_FALLBACK": "0"}


def make_recorder(job_dir: Path) -> Recorder:
    identity = RankIdentity("stacks", 3, 0, 4, "node-3", os.getpid(), 1)
    writer = RingWriter(
        ring_path(job_dir, 3), identity, 16, comm_table_bytes=4096, stall_threshold_ns=STALL_NS
    )
    writer.add_communicator(comm_id([0, 3]), (0, 3))
    return Recorder(writer, rank=3)


def blocked_in(event: threading.Event, depth: int) -> None:
    if depth:
        blocked_in(event, depth - 1)
    else:
        event.wait()


def until_waiting(thread: threading.Thread, inside: str = "blocked_in") -> None:
    """Return once `thread` waits on its event inside function `inside` (polls its live frames)."""
    while True:
        frame = sys._current_frames().get(thread.ident or 0)
        names = [entry.name for entry in traceback.extract_stack(frame)] if frame is not None else []
        if names[-1:] == ["wait"] and inside in names:
            return
        time.sleep(0.001)


def test_a_stall_dump_carries_every_threads_stack_and_the_collective_in_flight(tmp_path: Path) -> None:
    rec = make_recorder(tmp_path / "job")
    rec.begin(comm_id([0, 3]), OP_CODES["all_reduce"], 4, DTYPE_CODES["float32"], -1, 0)
    dog = Watchdog(rec, tmp_path / "job", 3, STALL_NS)
    release = threading.Event()
    worker = threading.Thread(target=blocked_in, args=(release, 3), name="data loader=1 ü")
    worker.start()
    until_waiting(worker)
    written: list[Path | None] = []

    def dump_once_main_waits() -> None:
        # the watchdog's dump runs in its own thread once the main thread waits in `blocked_in`
        while "blocked_in" not in str(
            traceback.extract_stack(sys._current_frames()[threading.main_thread().ident])
        ):
            time.sleep(0.001)
        written.append(dog.dump("stall"))
        release.set()

    dumper = threading.Thread(target=dump_once_main_waits)
    dumper.start()
    blocked_in(release, 0)
    dumper.join()
    worker.join()
    text = written[0].read_text()
    assert "# stacks threads=" in text and " in_flight=all_reduce in_flight_since_ns=" in text
    snap = read_dump(written[0])
    main = main_stack(snap.stacks)
    assert main is not None and main.name == "MainThread" and main.thread_id == threading.main_thread().ident
    assert [f.function for f in main.frames[:3]] == ["wait", "wait", "blocked_in"]
    named = {stack.name: stack for stack in snap.stacks}
    loader = named["data loader=1 ü"]
    assert [f.function for f in loader.frames].count("blocked_in") == 4 and not loader.main
    assert loader.frames[2].file == __file__ and loader.frames[2].line > 0
    assert "megatrace-watchdog" not in named  # not started: the dumping thread is a plain one
    assert sum(stack.main for stack in snap.stacks) == 1
    rec.writer.close()


def test_the_exit_dump_carries_no_stacks_and_old_dumps_read_with_none(tmp_path: Path) -> None:
    rec = make_recorder(tmp_path / "job")
    dog = Watchdog(rec, tmp_path / "job", 3, STALL_NS)
    exit_dump = dog.dump("exit")
    assert read_dump(exit_dump).stacks == () and "# stacks" not in exit_dump.read_text()
    assert read_dump(dog.dump("signal")).stacks != ()
    with tarfile.open(REPO / "tests" / "fixtures" / "real_runs.tar.gz") as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith(".dump"))
        (tmp_path / "old.dump").write_bytes(archive.extractfile(member).read())
    old = read_dump(tmp_path / "old.dump")
    assert old.stacks == () and len(old.records) > 0
    rec.writer.close()


def test_stack_lines_round_trip_odd_files_and_names(tmp_path: Path) -> None:
    odd_file = str(tmp_path / "my dir" / "odd=mod %2F.py")
    namespace: dict = {}
    exec(compile("def wait_odd(event):\n    event.wait()\n", odd_file, "exec"), namespace)
    release = threading.Event()
    worker = threading.Thread(target=namespace["wait_odd"], args=(release,), name="x y=z\tq")
    worker.start()
    until_waiting(worker, inside="wait_odd")
    try:
        stacks = capture_stacks()
    finally:
        release.set()
        worker.join()
    rec = make_recorder(tmp_path / "job")
    snap = read_ring(rec.writer.path)
    path = write_dump(tmp_path / "d.dump", dataclasses.replace(snap, stacks=stacks), "stall")
    back = read_dump(path).stacks
    assert back == stacks
    odd = next(stack for stack in back if stack.name == "x y=z\tq")
    assert any(frame.file == odd_file and frame.function == "wait_odd" for frame in odd.frames)
    rec.writer.close()


def test_capture_and_faulthandler_see_the_same_stacks_and_truncate_alike(tmp_path: Path) -> None:
    release = threading.Event()
    shallow = threading.Thread(target=blocked_in, args=(release, 5), name="shallow")
    deep = threading.Thread(target=blocked_in, args=(release, MAX_FRAMES + 20), name="deep")
    shallow.start()
    deep.start()
    until_waiting(shallow)
    until_waiting(deep)
    names = thread_names()
    try:
        with open(tmp_path / "fh.txt", "w+") as out:
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.seek(0)
            text = out.read()
        captured = {stack.name: stack for stack in capture_stacks()}
    finally:
        release.set()
        shallow.join()
        deep.join()
    parsed = {stack.name: stack for stack in parse_faulthandler(text, names, threading.main_thread().ident)}
    for name in ("shallow", "deep"):
        assert parsed[name].frames == captured[name].frames
        assert parsed[name].thread_id == captured[name].thread_id
    assert (
        parsed["deep"].truncated and captured["deep"].truncated and len(parsed["deep"].frames) == MAX_FRAMES
    )
    assert not parsed["shallow"].truncated
    assert parsed["MainThread"].main and not parsed["deep"].main


def run_stuck(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.stuck_rank",
            str(tmp_path / "job"),
            str(STALL_NS // 1_000_000),
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )


def test_a_rank_holding_the_gil_in_c_gets_its_stacks_written_by_faulthandler(tmp_path: Path) -> None:
    proc = run_stuck(tmp_path, "gil", "4")
    files = list((tmp_path / "job").glob("rank-0.*.stacks"))
    assert len(files) == 1, proc.stderr
    found = read_stacks_file(files[0])
    assert (found.rank, found.job, found.firings) == (0, "job", 1)
    main = main_stack(found.stacks)
    assert main is not None and main.name == "MainThread"
    assert main.frames[0].function == "hold_the_gil" and main.frames[0].file.endswith("stuck_rank.py")
    names = {stack.name for stack in found.stacks}
    assert {HELPER_THREAD, "megatrace-watchdog", "MainThread"} <= names


def test_a_healthy_rank_leaves_no_stacks_file(tmp_path: Path) -> None:
    run_stuck(tmp_path, "gil", "0")
    assert (tmp_path / "job" / "rank-0.trace").exists()
    assert list((tmp_path / "job").glob("*.stacks")) == []


def test_a_process_that_arms_faulthandlers_timer_itself_keeps_it(tmp_path: Path) -> None:
    mine = tmp_path / "user-timer.txt"
    proc = run_stuck(tmp_path, "user-timer", "3", str(mine))
    assert "hold_the_gil" in mine.read_text()
    assert "arms faulthandler.dump_traceback_later itself" in proc.stderr
    assert list((tmp_path / "job").glob("*.stacks")) == []


def test_stacks_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.1.stacks"
    path.write_text("hello\n")
    with pytest.raises(ValueError, match=r"rank-0\.1\.stacks: not a Megatrace stacks file"):
        read_stacks_file(path)
    path.write_text("# megatrace-stacks version=1 rank=x\n")
    with pytest.raises(ValueError, match=r"rank-0\.1\.stacks:1: needs rank="):
        read_stacks_file(path)


def test_the_fallback_cleans_up_after_itself_and_can_be_turned_off(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    rec = make_recorder(job_dir)
    armed = Watchdog(rec, job_dir, 3, STALL_NS)
    armed.start_thread()
    assert [path.name for path in job_dir.glob("*.stacks")] == [f"rank-3.{os.getpid()}.stacks"]
    armed.stop()
    assert list(job_dir.glob("*.stacks")) == []
    off = Watchdog(rec, job_dir, 3, STALL_NS, stacks_fallback=trace_settings(FALLBACK_OFF).stacks_fallback)
    off.start_thread()
    assert off.fallback is None and list(job_dir.glob("*.stacks")) == []
    off.stop()
    rec.writer.close()


def test_bad_stack_lines_are_named_errors(tmp_path: Path) -> None:
    rec = make_recorder(tmp_path / "job")
    dog = Watchdog(rec, tmp_path / "job", 3, STALL_NS)
    path = dog.dump("signal")
    text = path.read_text()
    first_frame = next(line for line in text.splitlines() if line.startswith("# frame "))
    path.write_text(text.replace(first_frame, first_frame.replace(" line=", " line=x"), 1))
    with pytest.raises(DumpFormatError, match=r"\.dump:\d+: line= is not a number"):
        read_dump(path)
    path.write_text(text.replace("# thread id=", "# thread id=zz", 1))
    with pytest.raises(DumpFormatError, match=r"\.dump:\d+: id= is not a number"):
        read_dump(path)
    path.write_text("\n".join(line for line in text.splitlines() if not line.startswith("# thread ")))
    with pytest.raises(DumpFormatError, match=r"\.dump:\d+: a frame line before any thread line"):
        read_dump(path)
    rec.writer.close()
