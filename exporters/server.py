"""The agent's HTTP endpoint: ``/metrics`` (Prometheus text or OpenMetrics), ``/healthz`` and an index.

Each request is served on its own thread; every scrape calls the collectors afresh.
"""

from __future__ import annotations

import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from megatrace.exporters.exposition import render_text

log = logging.getLogger(__name__)

INDEX = b"""<html><head><title>Megatrace node agent</title></head><body>
<h1>Megatrace node agent</h1><p><a href="/metrics">/metrics</a> &middot; <a href="/healthz">/healthz</a></p>
</body></html>
"""


class MetricsServer(ThreadingHTTPServer):
    """A threading HTTP server that serves `registry`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry) -> None:
        self.registry = registry
        super().__init__(address, MetricsHandler)


class MetricsHandler(BaseHTTPRequestHandler):
    server: MetricsServer
    server_version = "megatrace-exporter"
    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection between scrapes
    disable_nagle_algorithm = True  # headers and body go out at once, no delayed-ACK stall

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            if content_type.startswith("text/plain"):
                # choose_encoder names the text format it picked (0.0.4), which render_text writes;
                # CONTENT_TYPE_LATEST names another version in newer prometheus_client releases.
                encoder = render_text
            try:
                body = encoder(self.server.registry)
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
