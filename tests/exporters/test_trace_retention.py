"""The node agent removes finished jobs' trace folders by age and total size, never a running job's."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import requests

from megatrace.config import ConfigError
from megatrace.exporters.settings import load
from megatrace.exporters.trace_retention import prune
from megatrace.tracer.ringfile import W_FINISHED, RankIdentity, RingWriter, ring_path
from tests.support.services import free_port, running

HOUR = 3600.0
AGENT = [sys.executable, "-m", "megatrace.cli", "exporter"]


def job(trace_dir: Path, name: str, age_s: float, finished: bool = True, dump_bytes: int = 0) -> RingWriter:
    """A job folder with one rank's ring (finished or still written by this process), `age_s` old."""
    identity = RankIdentity(name, 0, 0, 1, "gpu-node-07", os.getpid(), time.time_ns())
    writer = RingWriter(ring_path(trace_dir / name, 0), identity, capacity=64, comm_table_bytes=4096)
    if dump_bytes:
        (trace_dir / name / "rank-0.1.0.dump").write_bytes(b"d" * dump_bytes)
    if finished:
        writer.header[W_FINISHED] = 1
        writer.close()
    stamp = time.time() - age_s
    for path in (trace_dir / name).iterdir():
        os.utime(path, (stamp, stamp))
    return writer


def test_finished_jobs_older_than_the_retention_age_are_removed(tmp_path: Path) -> None:
    job(tmp_path, "old-finished", 100 * HOUR)
    live = job(tmp_path, "old-but-running", 100 * HOUR, finished=False)
    job(tmp_path, "recent-finished", 1 * HOUR)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link-to-elsewhere").symlink_to(tmp_path / "elsewhere")
    try:
        removed = prune(tmp_path, 72 * HOUR, 0, 300, time.time())
        assert [p.name for p in removed] == ["old-finished"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "elsewhere",
            "link-to-elsewhere",
            "old-but-running",
            "recent-finished",
        ]
    finally:
        live.close()


def test_over_the_size_limit_the_oldest_finished_jobs_go_first(tmp_path: Path) -> None:
    for name, age in (("a-oldest", 50 * HOUR), ("b-older", 40 * HOUR), ("c-newer", 30 * HOUR)):
        job(tmp_path, name, age, dump_bytes=1 << 20)
    live = job(tmp_path, "d-running", 60 * HOUR, finished=False, dump_bytes=1 << 20)
    job(tmp_path, "e-just-ended", 10, dump_bytes=1 << 20)
    try:
        removed = prune(tmp_path, 72 * HOUR, int(3.5 * (1 << 20)), 300, time.time())
        assert [p.name for p in removed] == ["a-oldest", "b-older"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c-newer", "d-running", "e-just-ended"]
    finally:
        live.close()


@pytest.mark.parametrize("key", ["trace_retention_hours", "trace_max_bytes"])
def test_retention_settings_are_checked(key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load(None, {key: -1}, environ={})


def test_the_agent_prunes_in_the_background(tmp_path: Path) -> None:
    trace_dir = tmp_path / "trace"
    job(trace_dir, "old-finished", 100 * HOUR)
    port = free_port()
    argv = [*AGENT, f"--listen=127.0.0.1:{port}", f"--trace-dir={trace_dir}", "--collectors=tracer"]
    with running(argv, f"http://127.0.0.1:{port}/healthz", tmp_path / "agent.log") as proc:
        deadline = time.monotonic() + 30
        while (trace_dir / "old-finished").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not (trace_dir / "old-finished").exists()
        assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert "trace retention: removed" in (tmp_path / "agent.log").read_text()
