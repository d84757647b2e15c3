"""The agent's HTTP endpoint: ``/metrics`` (Prometheus text or OpenMetrics), ``/healthz`` and an index,
plus a path per collector served on its own (``/metrics/tracer``: the tracer collector alone, for a
scrape interval of its own).

Each connection is served on its own thread, within a read deadline and a connection cap
(`megatrace.exporters.http_limits`); every scrape calls the collectors afresh. The Prometheus
text format (0.0.4, written by our fast encoder) is served to every client that accepts it — as
node_exporter does — including Prometheus, which lists OpenMetrics first but accepts text too;
OpenMetrics only goes to clients that accept nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from megatrace.exporters.exposition import render_text
from megatrace.exporters.http_limits import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
    BoundedHandler,
    BoundedHTTPServer,
)

log = logging.getLogger(__name__)
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

INDEX = b"""<html><head><title>Megatrace node agent</title></head><body>
<h1>Megatrace node agent</h1><p><a href="/metrics">/metrics</a> &middot; <a href="/healthz">/healthz</a></p>
</body></html>
"""


def accepts_text(accept: str) -> bool:
    """Whether an HTTP Accept header admits the Prometheus text format (no header admits anything)."""
    if not accept.strip():
        return True
    for part in accept.split(","):
        media, _, params = part.strip().partition(";")
        quality = next((p.split("=", 1)[1] for p in params.split(";") if p.strip().startswith("q=")), "1")
        if media.strip() in ("text/plain", "text/*", "*/*") and quality.strip() not in (
            "0",
            "0.0",
            "0.00",
            "0.000",
        ):
            return True
    return False


def negotiate(accept: str) -> tuple[Callable[[CollectorRegistry], bytes], str]:
    """The encoder and content type for a scrape with this Accept header."""
    if accepts_text(accept):
        return render_text, TEXT_CONTENT_TYPE
    return choose_encoder(accept)


class MetricsServer(BoundedHTTPServer):
    """A threading HTTP server that serves `registry`, within the bounds of `http_limits`."""

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        paths: dict[str, CollectorRegistry] | None = None,
    ) -> None:
        self.registry = registry
        # "/metrics" and each extra path -> the registry it serves
        self.registries = {**(paths or {}), "/metrics": registry}
        super().__init__(address, MetricsHandler, read_timeout_s, max_connections)


class MetricsHandler(BoundedHandler):
    server: MetricsServer
    server_version = "megatrace-exporter"
    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection between scrapes
    disable_nagle_algorithm = True  # headers and body go out at once, no delayed-ACK stall

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        registry = self.server.registries.get(path)
        if registry is not None:
            encoder, content_type = negotiate(self.headers.get("Accept", ""))
            try:
                body = encoder(registry)
            except Exception:
                log.exception("building the exposition failed")
                self._reply(500, b"exposition failed\n", "text/plain; charset=utf-8")
                return
            self._reply(200, body, content_type)
        elif path == "/healthz":
            self._reply(200, b"ok\n", "text/plain; charset=utf-8")
        elif path == "/":
            self._reply(200, INDEX, "text/html; charset=utf-8")
        else:
            self._reply(404, b"not found\n", "text/plain; charset=utf-8")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)
