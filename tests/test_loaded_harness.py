"""`make test-loaded`'s harness (`tests.support.loaded`): it passes the command's exit status on,
prints the load it sampled, and leaves no CPU hog behind, also when it is killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = [sys.executable, "-m", "tests.support.loaded", "--floor", "0", "--settle-s", "0", "--"]


def hogs_of(harness_pid: int) -> list[int]:
    """Processes still running the harness's busy loop for the harness with `harness_pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            len(argv) >= 4
            and argv[1] == b"-c"
            and b"PR_SET_PDEATHSIG" in argv[2]
            and argv[3] == str(harness_pid).encode()
        ):
            found.append(int(entry.name))
    return found


def wait_gone(harness_pid: int, within_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := hogs_of(harness_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_the_commands_status_and_the_load_are_reported_and_no_hog_is_left(tmp_path: Path) -> None:
    marker = tmp_path / "harness-pid"
    command = f"import os, sys; open({str(marker)!r}, 'w').write(str(os.getppid())); sys.exit(3)"
    done = subprocess.run(
        [*HARNESS, sys.executable, "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "samples of the 1-minute load average during the run" in done.stdout
    assert "exit status 3" in done.stdout
    assert wait_gone(int(marker.read_text())) == []


def test_hogs_end_with_a_harness_killed_outright(tmp_path: Path) -> None:
    marker = tmp_path / "command-pid"
    command = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    harness = subprocess.Popen([*HARNESS, sys.executable, "-c", command], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not hogs_of(harness.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hogs_of(harness.pid), "the harness started no hog"
        os.kill(harness.pid, signal.SIGKILL)
        harness.wait()
        assert wait_gone(harness.pid) == []
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if marker.exists():  # the command outlives a harness killed outright; it is this test's to end
            os.kill(int(marker.read_text()), signal.SIGKILL)
