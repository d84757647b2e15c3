"""An address that drops connections as a partitioned node does: a listening socket whose accept queue
is kept full, so the kernel drops every further SYN (no RST) and a connect waits until it times out."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator


@contextlib.contextmanager
def blackholed(host: str, port: int = 0) -> Iterator[int]:
    """Yields a port (`port`, or one the kernel picks) on loopback `host` where a TCP connect hangs
    until its timeout."""
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        server.bind((host, port))
        server.listen(0)
        port = server.getsockname()[1]
        for _ in range(4):  # the queue holds backlog + 1; the rest wait in SYN retries, harmlessly
            filler = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect((host, port))
        time.sleep(0.2)
        probe = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        probe.settimeout(0.5)
        with contextlib.suppress(TimeoutError):
            probe.connect((host, port))
            raise RuntimeError(f"{host}:{port} accepted a connection: the blackhole does not hold")
        yield port
