"""The agent's two HTTP servers against clients that connect and then send slowly or nothing: a read
deadline and a connection cap keep them from holding the agent's threads or keeping a request out."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from megatrace.exporters.cli import build_registry
from megatrace.exporters.guard import GuardedCollectors
from megatrace.exporters.server import MetricsServer
from megatrace.exporters.trace_endpoint import TraceEndpoint

TOKEN = "limits-token-1234"
CAP = 8
DEADLINE_S = 2.0
HALF_SENT = 40


@dataclass
class Served:
    address: tuple[str, int]
    path: str
    headers: dict[str, str]

    def get(self) -> requests.Response:
        host, port = self.address
        return requests.get(f"http://{host}:{port}{self.path}", headers=self.headers, timeout=30)


@pytest.fixture(params=["metrics", "traces"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Served]:
    if request.param == "metrics":
        registry = build_registry(GuardedCollectors({}))
        server = MetricsServer(("127.0.0.1", 0), registry, read_timeout_s=DEADLINE_S, max_connections=CAP)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield Served(server.server_address[:2], "/metrics", {})
        server.shutdown()
        server.server_close()
        return
    token = tmp_path / "token"
    token.write_text(TOKEN)
    endpoint = TraceEndpoint(
        tmp_path, ("127.0.0.1", 0), token, 100, 1 << 20, 2, read_timeout_s=DEADLINE_S, max_connections=CAP
    )
    yield Served(endpoint.address[:2], "/v1/jobs", {"Authorization": f"Bearer {TOKEN}"})
    endpoint.close()


def handler_threads() -> int:
    return sum(1 for thread in threading.enumerate() if "process_request_thread" in thread.name)


def closed_by_server(sock: socket.socket, within_s: float = 60.0) -> bool:
    """Whether the server ends the connection (EOF or reset) within `within_s` seconds."""
    ready, _, _ = select.select([sock], [], [], within_s)
    if not ready:
        return False
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def half_sent(served: Served) -> socket.socket:
    sock = socket.create_connection(served.address, timeout=30)
    sock.sendall(f"GET {served.path} HTTP/1.1\r\nHost: agent\r\n".encode())  # no blank line: never ends
    return sock


def test_half_sent_requests_neither_hold_the_threads_nor_keep_a_request_out(served: Served) -> None:
    before = handler_threads()
    stalled = [half_sent(served) for _ in range(HALF_SENT)]
    try:
        for _ in range(3):
            response = served.get()
            assert response.status_code == 200, response.text
        deadline = time.monotonic() + 60
        while handler_threads() - before > CAP and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handler_threads() - before <= CAP
        assert all(
            closed_by_server(sock) for sock in stalled
        )  # the replaced ones, then the rest by the deadline
    finally:
        for sock in stalled:
            sock.close()
    assert served.get().status_code == 200


def test_a_request_trickled_byte_by_byte_is_cut_at_the_deadline(served: Served) -> None:
    sock = socket.create_connection(served.address, timeout=30)
    try:
        sock.sendall(f"GET {served.path} HTTP/1.1\r\nX-Slow: ".encode())
        started = time.monotonic()
        cut = False
        while not cut and time.monotonic() - started < 120:
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            cut = closed_by_server(sock, within_s=0.2)
        assert cut, "a client sending a byte at a time kept its connection for 2 minutes"
    finally:
        sock.close()
    assert served.get().status_code == 200
