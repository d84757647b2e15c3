"""The tracer steps aside instead of harming the job: a full trace filesystem, a file where the job's
folder should be, read-only folders, bad settings under `megatrace trace`. Real gloo jobs; small
filesystems are tmpfs mounts made for the test (they need root, as mounting does)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from megatrace.tracer.ringfile import DEFAULT_CAPACITY, RankIdentity, RingWriter, ring_path
from tests.support.gloo_job import start_traced_job

DOCS = Path(__file__).resolve().parents[2] / "docs"
TRACE = [sys.executable, "-m", "megatrace.cli", "trace"]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Mount small tmpfs filesystems (`size` bytes, optionally read-only) under `tmp_path`."""
    mounted: list[Path] = []

    def mount(name: str, size: int = 256 * 1024, read_only: bool = False) -> Path:
        point = tmp_path / name
        point.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def nearly_full(mount: Callable[..., Path]) -> Path:
    """A 256 KiB tmpfs with 8 KiB left: a ring's header fits, its records do not."""
    point = mount("small")
    (point / "filler").write_bytes(b"\0" * (256 - 8) * 1024)
    return point


def run_job(trace_dir: Path, tmp_path: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a 2-rank example job to its end; (exit status, its output)."""
    log_path = tmp_path / "job.log"
    with start_traced_job(trace_dir, nprocs=2, steps=3, tp=1, env=env, log_path=log_path) as (proc, _):
        try:
            code = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            code = -signal.SIGKILL
    return code, log_path.read_text(errors="replace")


def test_a_ring_the_filesystem_cannot_hold_is_refused_not_a_sigbus(tmpfs) -> None:
    point = nearly_full(tmpfs)
    script = (
        "import sys, time; from pathlib import Path\n"
        "from megatrace.tracer.ringfile import RankIdentity, RingWriter, RECORD_SIZE\n"
        "identity = RankIdentity('j', 0, 0, 1, 'h', 1, time.time_ns())\n"
        "try:\n"
        f"    writer = RingWriter(Path({str(point / 'j' / 'rank-0.trace')!r}), identity, capacity=4096)\n"
        "except OSError as exc:\n"
        "    print('refused', exc.strerror); sys.exit(0)\n"
        "writer.rec_b[-RECORD_SIZE:] = b'x' * RECORD_SIZE\n"
        "print('written')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"status {done.returncode}: {done.stderr}"
    assert done.stdout.strip() == "refused No space left on device"
    assert sorted(p.name for p in (point / "j").iterdir()) == []  # no half-made ring left behind


def test_a_job_whose_trace_filesystem_is_full_trains_untraced(tmpfs, tmp_path: Path) -> None:
    point = nearly_full(tmpfs)
    code, output = run_job(point, tmp_path)
    assert code == 0, output
    assert output.count("megatrace tracer: not tracing this rank") == 2
    assert "No space left on device" in output


def test_a_file_where_the_job_folder_should_be_falls_back_to_the_temp_dir(tmp_path: Path) -> None:
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    job = f"blocked-{os.getpid()}"
    (trace_dir / job).write_text("not a folder\n")
    fallback = tmp_path / "tmp"
    fallback.mkdir()
    code, output = run_job(trace_dir, tmp_path, {"MEGATRACE_TRACE_JOB": job, "TMPDIR": str(fallback)})
    assert code == 0, output
    assert sorted(p.name for p in (fallback / "megatrace" / job).glob("rank-*.trace")) == [
        "rank-0.trace",
        "rank-1.trace",
    ]
    warnings = [line for line in output.splitlines() if "megatrace tracer: WARNING" in line]
    assert len(warnings) == 2, output  # one line per rank, naming the folder it uses and why
    for line in warnings:
        assert f"{trace_dir}/{job} cannot be used (something other than a folder is in its place)" in line
        assert f"tracing into {fallback / 'megatrace' / job} instead" in line


def test_a_read_only_trace_dir_says_why_it_is_passed_over(tmpfs, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrace.tracer.settings import job_trace_dir

    read_only = tmpfs("ro", read_only=True)
    writable = tmpfs("rw")
    monkeypatch.setattr(tempfile, "tempdir", str(writable))
    assert job_trace_dir(str(read_only), "j") == (writable / "megatrace" / "j", "Read-only file system")
    assert job_trace_dir(str(writable), "k") == (writable / "k", "")


def test_read_only_trace_dir_and_fallback_leave_the_process_untraced(
    tmpfs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatrace.tracer import runtime
    from megatrace.tracer.settings import FaultSettings, TraceSettings

    read_only = tmpfs("ro", read_only=True)
    monkeypatch.setattr(tempfile, "tempdir", str(read_only))  # the fallback is read-only too
    assert runtime.install(TraceSettings(enable=True, dir=str(read_only), job="j"), FaultSettings()) is False
    assert runtime.current() is None
    assert "megatrace tracer: not tracing" in capsys.readouterr().err


def trace_command(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE_", "NCCL_MEGATRACE_"))}
    return subprocess.run(
        [*TRACE, *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    "env",
    [
        {"MEGATRACE_TRACE_CAPACITY": "many"},
        {"MEGATRACE_TRACE_STALL_MS": "0"},
        {"MEGATRACE_FAULT_SLOW_PCT": "-1"},
    ],
)
def test_bad_settings_under_trace_warn_loudly_and_run_the_command_untraced(
    tmp_path: Path, env: dict[str, str]
) -> None:
    command = ["--trace-dir", str(tmp_path / "t"), "--", sys.executable, "-c", "print('trained')"]
    done = trace_command(tmp_path, *command, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trained"
    assert "WARNING: NOT TRACING" in done.stderr and "--strict" in done.stderr
    strict = trace_command(tmp_path, "--strict", *command, env=env)
    assert strict.returncode == 2
    assert strict.stdout == ""


def test_trace_flags_are_checked_by_name(tmp_path: Path) -> None:
    done = trace_command(tmp_path, "--stall-ms", "0", "--", sys.executable, "-c", "pass")
    assert done.returncode == 2
    assert "--stall-ms: must be at least 1, got 0" in done.stderr
    assert "environment" not in done.stderr


def test_a_command_that_does_not_exist_creates_no_trace_folder(tmp_path: Path) -> None:
    done = trace_command(tmp_path, "--trace-dir", str(tmp_path / "t"), "--", "megatrace-no-such-command")
    assert done.returncode == 127
    assert "command not found" in done.stderr
    assert not (tmp_path / "t").exists()


def test_documented_default_ring_size_is_what_is_written(tmp_path: Path) -> None:
    identity = RankIdentity("j", 0, 0, 1, "h", os.getpid(), time.time_ns())
    writer = RingWriter(ring_path(tmp_path, 0), identity)
    try:
        size = writer.path.stat().st_size
        assert writer.capacity == DEFAULT_CAPACITY
    finally:
        writer.close()
    documented = {
        doc.name: {
            int(n.replace(",", "")) for n in re.findall(r"([\d,]{9,}) bytes", (DOCS / doc).read_text())
        }
        for doc in (Path("tracer.md"), Path("tracer-format.md"), Path("configuration.md"))
    }
    assert documented == {name: {size} for name in documented}, size
