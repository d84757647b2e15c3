"""`megatrace stack up|down|status` with the real parts: health, crash reporting, stopping only our own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megatrace import stack
from megatrace.config import load_config
from megatrace.stack import Running, StackError, down, is_ours, read_state, status, stop, up
from megatrace.stack_config import StackConfig
from tests.support.services import free_port

PARTS = ("prometheus", "alertmanager", "node_exporter", "exporter", "alertbot")


def _config(tmp_path: Path, **ports: int) -> StackConfig:
    chosen = {name: free_port() for name in PARTS} | ports
    return load_config(
        StackConfig, environ={}, overrides={"state_dir": str(tmp_path / "stack"), "ports": chosen}
    )


def _cli(config: StackConfig, action: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "megatrace.cli", "stack", "--state-dir", config.state_dir, action],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            **{f"MEGATRACE_STACK_PORTS__{k.upper()}": str(v) for k, v in vars(config.ports).items()},
        },
    )


def test_up_status_crash_down(tmp_path: Path) -> None:
    config = _config(tmp_path)
    started = _cli(config, "up")
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        assert "prometheus     up" in started.stdout
        running = read_state(Path(config.state_dir))
        assert [item.name for item in running] == [
            "exporter",
            "node_exporter",
            "alertbot",
            "alertmanager",
            "prometheus",
        ]
        assert all(part.healthy for part in status(config))

        healthy = _cli(config, "status")
        assert healthy.returncode == 0
        assert healthy.stdout.count(" up ") == 5

        exporter = next(item for item in running if item.name == "exporter")
        os.kill(exporter.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while is_ours(exporter) and time.monotonic() < deadline:
            time.sleep(0.1)
        crashed = _cli(config, "status")
        assert crashed.returncode == 1
        assert "exporter       exited" in crashed.stdout
        assert str(Path(config.state_dir) / "logs" / "exporter.log") in crashed.stdout

        again = _cli(config, "up")
        assert again.returncode == 1
        assert "already running" in again.stderr
    finally:
        stopped = _cli(config, "down")
    assert stopped.returncode == 0
    assert stopped.stdout.strip() == "stopped: prometheus, alertmanager, alertbot, node_exporter"
    assert not any(is_ours(item) for item in running)
    assert read_state(Path(config.state_dir)) == []
    assert _cli(config, "status").returncode == 3


def test_a_part_that_cannot_start_is_reported_and_the_rest_stopped(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = _config(tmp_path, alertmanager=taken.getsockname()[1])
        with pytest.raises(StackError, match=r"alertmanager: 127\.0\.0\.1:\d+ is already in use") as exc:
            up(config, say=lambda line: None)
    assert "address already in use" in str(exc.value) and "ports.alertmanager" in str(exc.value)
    assert read_state(Path(config.state_dir)) == []
    assert not [part for part in status(config) if part.running]


class AnswersEverything(BaseHTTPRequestHandler):
    """Another stack's part: answers 200 on any path."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("race", [False, True], ids=["taken-before-up", "taken-while-starting"])
def test_a_port_another_stack_serves_is_named_not_reported_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, race: bool
) -> None:
    other = ThreadingHTTPServer(("127.0.0.1", 0), AnswersEverything)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    config = _config(tmp_path, exporter=port)
    if race:  # the port was free when checked and taken before the exporter bound it
        monkeypatch.setattr(stack, "port_in_use", lambda host, port: False)
    said: list[str] = []
    try:
        with pytest.raises(StackError) as exc:
            up(config, say=said.append)
        assert f"exporter: 127.0.0.1:{port} is already in use" in str(exc.value)
        assert "ports.exporter" in str(exc.value)
        assert said == []
        assert read_state(Path(config.state_dir)) == []
    finally:
        down(config)
        other.shutdown()
        other.server_close()


def test_down_leaves_processes_it_did_not_start(tmp_path: Path) -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        recorded = Running(
            "exporter", stranger.pid, ["/usr/bin/something-else"], "http://x", "http://x", "log"
        )
        assert not is_ours(recorded)
        assert stop([recorded]) == []
        assert stranger.poll() is None
        config = _config(tmp_path)
        assert down(config) == []
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_demo_stopped_by_sigterm_leaves_nothing_running(tmp_path: Path) -> None:
    state = tmp_path / "demo"
    env = {**os.environ, **{f"MEGATRACE_STACK_PORTS__{name.upper()}": str(free_port()) for name in PARTS}}
    demo = subprocess.Popen(
        [sys.executable, "-m", "megatrace.cli", "stack", "--state-dir", str(state), "demo", "--seed", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    job_log = state / "logs" / "demo-hang.log"
    deadline = time.monotonic() + 120
    while not (job_log.exists() and job_log.stat().st_size > 0) and time.monotonic() < deadline:
        assert demo.poll() is None, demo.stdout.read().decode() if demo.stdout else ""
        time.sleep(0.2)
    running = read_state(state)
    assert len(running) == 5 and all(is_ours(item) for item in running)
    deadline = time.monotonic() + 60
    while len(_processes_mentioning(str(state / "trace"))) < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_processes_mentioning(str(state / "trace"))) >= 5  # launcher and ranks of the job
    demo.send_signal(signal.SIGTERM)
    output = demo.communicate(timeout=60)[0].decode()
    assert demo.returncode != 0
    assert "[5/5] stopping the stack" in output
    assert not any(is_ours(item) for item in running)
    assert _processes_mentioning(str(state)) == []


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line or environment contains `text` (the demo's job ranks carry its trace dir)."""
    found = []
    needle = text.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes() or needle in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found
