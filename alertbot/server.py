"""The bot's HTTP endpoints: ``POST /alertmanager`` (webhook intake), ``POST /silence``,
``POST /feishu/callback`` (card actions, request-URL mode), ``GET /healthz`` (liveness),
``GET /readyz`` (readiness) and ``GET /metrics``.

The webhook answers 200 only after the validated body is committed to the store; everything else
(dedupe, delivery) happens afterwards in the service's worker.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import re
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from megatrace.alertbot.alertmanager import AlertmanagerError, create_silence
from megatrace.alertbot.config import AuthConfig, listen_address
from megatrace.alertbot.payload import PayloadError, load_json, parse_webhook

if TYPE_CHECKING:
    from megatrace.alertbot.service import Service

log = logging.getLogger(__name__)

DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_SILENCE_S = 30 * 86400
# Connections the kernel queues for accept(): an alert storm from an Alertmanager HA pair arrives at
# once, and the kernel caps this at net.core.somaxconn (4096 on current kernels).
LISTEN_BACKLOG = 4096
# A refused body's first bytes are read for the group key Alertmanager writes near the start.
GROUP_KEY_SCAN = 64 * 1024
GROUP_KEY = re.compile(rb'"groupKey"\s*:\s*"((?:[^"\\]|\\.){0,2000})"')
# A card callback is a few kB; its limit is its own, far below the webhook's.
CALLBACK_MAX_BODY = 1024 * 1024


def authorized(header: str | None, auth: AuthConfig) -> bool:
    """Constant-time check of a Bearer token or Basic credentials against the configuration."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and auth.bearer_token:
        return hmac.compare_digest(value.encode(), auth.bearer_token.encode())
    if scheme.lower() == "basic" and auth.basic_user:
        try:
            user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        same_user = hmac.compare_digest(user.encode(), auth.basic_user.encode())
        same_password = hmac.compare_digest(password.encode(), auth.basic_password.encode())
        return same_user and same_password
    return False


def parse_duration(value: Any) -> float:
    """``90``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1d"`` → seconds (0 < d ≤ 30 days)."""
    match = DURATION.match(str(value).strip())
    if match is None:
        raise ValueError(f"duration: expected e.g. 30m, 2h or 1d, got {value!r}")
    seconds = float(match.group(1)) * UNITS[match.group(2)]
    if not 0 < seconds <= MAX_SILENCE_S:
        raise ValueError("duration: must be more than 0 and at most 30d")
    return seconds


def silence_request(body: bytes) -> tuple[dict[str, str], float, str, str]:
    """Validate a silence request: {matchers: {label: value}, duration, comment?, createdBy?}."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise ValueError("body: expected a JSON object")
    matchers = data.get("matchers")
    if not isinstance(matchers, dict) or not matchers:
        raise ValueError("matchers: expected a non-empty object of label: value")
    if not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in matchers.items()):
        raise ValueError("matchers: every label name and value must be a non-empty string")
    duration = parse_duration(data.get("duration", ""))
    comment = data.get("comment") or "silenced from the megatrace alert bot"
    created_by = data.get("createdBy") or "megatrace-alertbot"
    if not isinstance(comment, str) or not isinstance(created_by, str):
        raise ValueError("comment and createdBy must be strings")
    return matchers, duration, comment[:500], created_by[:100]


class BotHandler(BaseHTTPRequestHandler):
    """One connection to the bot: Alertmanager's webhook and silences (authenticated), Feishu's card
    callbacks (signed), and the probes and metrics."""

    server_version = "megatrace-alertbot"
    protocol_version = "HTTP/1.1"
    server: BotHTTPServer

    @property
    def service(self) -> Service:
        return self.server.service

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.service.cfg.read_timeout_s)  # each read; an idle keep-alive ends too

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), fmt % args)

    def reply(self, status: int, payload: Any, content_type: str = "application/json") -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="megatrace", Basic realm="megatrace"')
        self.end_headers()
        self.wfile.write(data)

    def read_body(self, limit: int, refuse: Callable[[int], None]) -> bytearray | None:
        """The whole body, or None after answering why not (`refuse(length)` when over `limit`)."""
        header = self.headers.get("Content-Length")
        if header is None:
            self.close_connection = True
            self.reply(411, {"error": "Content-Length header required"})
            return None
        if not re.fullmatch(r"[0-9]{1,19}", header.strip()):
            self.close_connection = True
            self.reply(400, {"error": "Content-Length: expected a decimal number of bytes"})
            return None
        length = int(header)
        if length > limit:
            refuse(length)
            return None
        body = bytearray(length)  # one buffer, filled in place: no chunks joined into a copy
        try:
            received = self.rfile.readinto(body) or 0
            while 0 < received < length and (more := self.rfile.readinto(memoryview(body)[received:])):
                received += more
        except TimeoutError:
            received = 0
        if received < length:
            self.close_connection = True
            self.reply(408, {"error": f"body not received within {self.service.cfg.read_timeout_s:g}s"})
            return None
        return body

    def refuse_large_callback(self, length: int) -> None:
        """413 for a callback body over `CALLBACK_MAX_BODY`, before a byte of it is read."""
        self.close_connection = True
        self.service.metrics.webhooks.labels("callback_rejected").inc()
        log.warning("refused a %d-byte Feishu callback from %s", length, self.address_string())
        self.reply(413, {"error": f"body larger than {CALLBACK_MAX_BODY} bytes"})

    def refuse_too_large(self, length: int) -> None:
        """413 for a body over `max_body_bytes`, counted and logged with the group key its
        first bytes name (Alertmanager writes ``groupKey`` near the start), so that what
        Alertmanager gives up on is known; reconciliation, when on, recovers the group."""
        self.close_connection = True
        try:
            head = self.rfile.read(min(length, GROUP_KEY_SCAN))
        except TimeoutError:
            head = b""
        found = GROUP_KEY.search(head)
        group = found.group(1).decode("utf-8", "replace") if found else "(not in the first bytes)"
        self.service.metrics.webhooks.labels("too_large").inc()
        log.error(
            "refused a %d-byte request to %s over max_body_bytes %d, group key %s; %s",
            length,
            self.path.split("?", 1)[0],
            self.service.cfg.max_body_bytes,
            group,
            "reconciliation will fetch its alerts"
            if self.service.cfg.alertmanager.url
            else "its alerts are lost unless alertmanager.url is set (reconciliation)",
        )
        self.reply(413, {"error": f"body larger than {self.service.cfg.max_body_bytes} bytes"})

    def authenticate(self) -> bool:
        if authorized(self.headers.get("Authorization"), self.service.cfg.auth):
            return True
        self.service.metrics.webhooks.labels("unauthorized").inc()
        self.reply(401, {"error": "missing or wrong credentials"})
        return False

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self.reply(*self.service.liveness())
        elif path == "/readyz":
            self.reply(*self.service.readiness())
        elif path == "/metrics":
            self.reply(200, self.service.metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self.reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/feishu/callback" and self.service.cfg.feishu.callback.mode == "request_url":
            body = self.read_body(CALLBACK_MAX_BODY, self.refuse_large_callback)
            if body is not None:
                self.card_callback(bytes(body))
            return
        if path not in ("/alertmanager", "/silence"):
            self.reply(404, {"error": "not found"})
            return
        if not self.authenticate():
            return
        body = self.read_body(self.service.cfg.max_body_bytes, self.refuse_too_large)
        if body is None:
            return
        if path == "/alertmanager":
            self.webhook(body)
        else:
            self.silence(bytes(body))

    def webhook(self, body: bytearray) -> None:
        try:
            text = body.decode("utf-8")
            del body[:]  # a large group is held once, as the text the store keeps
            webhook = parse_webhook(text)
        except UnicodeDecodeError:
            self.service.metrics.webhooks.labels("rejected").inc()
            self.reply(400, {"error": "body is not UTF-8 JSON"})
            return
        except PayloadError as exc:
            self.service.metrics.webhooks.labels("rejected").inc()
            log.warning("rejected webhook from %s: %s", self.address_string(), exc)
            self.reply(400, {"error": str(exc)})
            return
        try:
            self.service.store.inbox.add("webhook", text, time.time())
        except Exception:
            log.exception("cannot store webhook")
            self.service.metrics.webhooks.labels("store_failed").inc()
            self.reply(503, {"error": "cannot store the alert now; retry"})
            return
        self.service.metrics.webhooks.labels("accepted").inc()
        self.service.wake()
        self.reply(200, {"status": "stored", "alerts": len(webhook.alerts)})

    def card_callback(self, body: bytes) -> None:
        """A Feishu card action (request-URL mode): authenticated by Feishu's signature and
        verification token instead of our credentials; answered within Feishu's 3 s. The
        module (and lark-oapi) was loaded when the service started (`Service.__init__`)."""
        from megatrace.alertbot.callbacks import CallbackRejected, verify_request

        try:
            callback = verify_request(self.service.cfg.feishu.callback, self.headers, body, time.time())
        except CallbackRejected as exc:
            self.service.metrics.webhooks.labels("callback_rejected").inc()
            log.warning("rejected Feishu callback from %s: %s", self.address_string(), exc)
            self.reply(exc.status, {"msg": "rejected"})
            return
        if callback.get("type") == "url_verification":
            self.reply(200, {"challenge": callback.get("challenge", "")})
            return
        self.reply(200, self.service.card_action(callback, "request_url"))

    def silence(self, body: bytes) -> None:
        if not self.service.cfg.alertmanager.url:
            self.reply(503, {"error": "alertmanager.url is not configured"})
            return
        try:
            matchers, duration, comment, created_by = silence_request(body)
        except ValueError as exc:
            self.reply(400, {"error": str(exc)})
            return
        now = time.time()
        try:
            silence_id = create_silence(
                self.service.cfg.alertmanager, matchers, now, now + duration, created_by, comment
            )
        except AlertmanagerError as exc:
            self.reply(502, {"error": str(exc)})
            return
        log.info("silence %s created for %s for %.0fs by %s", silence_id, matchers, duration, created_by)
        self.reply(200, {"silenceID": silence_id})


def make_server(service: Service) -> BotHTTPServer:
    """An HTTP server bound to the configured listen address, serving `service`."""
    host, port = listen_address(service.cfg.listen)
    try:
        return BotHTTPServer((host, port), service)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {service.cfg.listen}: {exc.strerror or exc}") from None


class BotHTTPServer(ThreadingHTTPServer):
    """One thread per connection, and a listen backlog deep enough for an alert storm."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], service: Service) -> None:
        self.service = service
        super().__init__(address, BotHandler)
