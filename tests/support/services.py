"""Start real external programs (Prometheus, Alertmanager, node_exporter, our own servers) for tests.

Everything listens on loopback ports picked free at start, and is stopped when the context exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import socketserver
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import requests


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require_binary(name: str) -> str:
    """Path of an installed program; fails the test (never skips) when `make test` did not install it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; `make test` installs it from Debian packages")
    return path


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Wait until GET `url` answers 2xx; fail early if `proc` exits first."""
    deadline = time.monotonic() + timeout
    last: Exception | str = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            response = requests.get(url, timeout=2)
            if response.ok:
                return
            last = f"HTTP {response.status_code}"
        except requests.RequestException as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last}")


@contextlib.contextmanager
def running(
    argv: Sequence[str],
    ready_url: str,
    log_path: Path,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> Iterator[subprocess.Popen]:
    """Run `argv` with output to `log_path` until the block ends; wait for `ready_url` first."""
    log = open(log_path, "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        list(argv), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    try:
        try:
            wait_http(ready_url, timeout=timeout, proc=proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(
                f"{exc}\n--- {log_path} ---\n{Path(log_path).read_text(errors='replace')}"
            ) from exc
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


@contextlib.contextmanager
def serving(server: socketserver.BaseServer) -> Iterator[str]:
    """`server` answering in a thread for the duration of the block; yields its ``host:port``."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()


def prometheus_argv(config: Path, data_dir: Path, port: int) -> list[str]:
    """Command line of a real Prometheus server on 127.0.0.1:`port`."""
    return [
        require_binary("prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
    ]


def alertmanager_argv(
    config: Path, data_dir: Path, port: int, gossip: str = "", peers: Sequence[str] = ()
) -> list[str]:
    """Command line of a real Alertmanager on 127.0.0.1:`port`: non-clustered, or a member of an HA
    cluster gossiping on `gossip` (HOST:PORT) with `peers` (their gossip addresses)."""
    argv = [
        require_binary("prometheus-alertmanager"),
        f"--config.file={config}",
        f"--storage.path={data_dir}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--cluster.listen-address={gossip}",
    ]
    if gossip:
        argv += [f"--cluster.peer={peer}" for peer in peers]
        argv += [
            "--cluster.gossip-interval=100ms",
            "--cluster.pushpull-interval=2s",
            "--cluster.peer-timeout=3s",
        ]
    return argv
