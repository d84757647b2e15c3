"""Bounds on the agent's HTTP servers (``/metrics`` and the trace endpoint): a deadline for reading each
request and a cap on open connections, so that clients that connect and then send slowly, or nothing,
cannot hold the agent's threads.

A connection is *waiting* from the moment it is accepted (or has been answered, on a kept-alive
connection) until its request line and headers are in; it is *serving* while its request is
answered. A waiting connection past ``read_timeout_s`` is shut down, however many bytes it trickled
in (checked every half second by the serving loop). At ``max_connections`` open, a new connection
takes the place of the waiting one that has waited longest, so half-sent requests can never keep a
whole request out; only when every open connection is being served is a new one closed unserved.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 64
WARN_EVERY_S = 60.0


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` of them, each with `read_timeout_s` to send
    its request."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BoundedHandler],
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._waiting: dict[socket.socket, float] = {}  # connection -> when it began waiting
        self._shed = {"timed out": 0, "replaced": 0, "refused": 0}
        self._warned_at = -WARN_EVERY_S
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if len(self._open) >= self.max_connections:
                oldest = min(self._waiting, key=self._waiting.__getitem__, default=None)
                if oldest is None:  # every open connection is being answered: no room
                    self._shed["refused"] += 1
                    self.shutdown_request(request)
                    return
                self._drop(oldest, "replaced")
            self._open.add(request)
            self._waiting[request] = time.monotonic()
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.discard(request)
                self._waiting.pop(request, None)

    def service_actions(self) -> None:
        """Shut down the connections that have waited past the deadline (run by `serve_forever`)."""
        super().service_actions()
        now = time.monotonic()
        with self._lock:
            for connection, since in list(self._waiting.items()):
                if now - since > self.read_timeout_s:
                    self._drop(connection, "timed out")
            shed = {reason: count for reason, count in self._shed.items() if count}
            if shed and now - self._warned_at >= WARN_EVERY_S:
                self._warned_at = now
                self._shed = dict.fromkeys(self._shed, 0)
                log.warning(
                    "%s:%d: connections shed (%s): clients that did not send a request within %gs, "
                    "or more than %d connections at once",
                    *self.server_address[:2],
                    ", ".join(f"{count} {reason}" for reason, count in shed.items()),
                    self.read_timeout_s,
                    self.max_connections,
                )

    def waiting(self, connection: socket.socket) -> None:
        with self._lock:
            if connection in self._open:
                self._waiting[connection] = time.monotonic()

    def serving(self, connection: socket.socket) -> bool:
        """Mark `connection` as being answered; False when it was shut down while it waited."""
        with self._lock:
            if connection not in self._open:
                return False
            self._waiting.pop(connection, None)
            return True

    def _drop(self, connection: socket.socket, reason: str) -> None:
        """Shut `connection` down (its thread's read returns at once and the thread ends); lock held."""
        self._waiting.pop(connection, None)
        self._open.discard(connection)
        self._shed[reason] += 1
        with contextlib.suppress(OSError):  # the client is gone already
            connection.shutdown(socket.SHUT_RDWR)


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler that tells its `BoundedHTTPServer` when it waits for a request and when it
    answers one; each read and write also times out after the server's `read_timeout_s`."""

    server: BoundedHTTPServer

    def setup(self) -> None:
        self.timeout = self.server.read_timeout_s
        super().setup()

    def handle_one_request(self) -> None:
        self.server.waiting(self.connection)
        super().handle_one_request()

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers; a shut-down connection ends them early
        if not self.server.serving(self.connection):
            self.close_connection = True
            return False
        return parsed
