"""A local HTTP server speaking the parts of the Feishu/Lark open platform API that Megatrace uses.

It checks what a real Feishu checks (custom-bot signatures and timestamps, tenant tokens, payload
shapes, the 20 KB body limit, per-bot rate limits, `uuid` idempotency), records what it accepted,
and can be told to fail the way Feishu fails. Usage::

    with FeishuServer() as feishu:
        hook = feishu.add_bot(secret="s3cret", chat_id="oc_p0")
        feishu.fail("bot", "rate_limit")          # next bot post answers code 11232
        ...                                       # point the code under test at feishu.url / hook
        feishu.wait_for(lambda: len(feishu.bot_posts()) == 1)

Endpoints: ``POST /open-apis/bot/v2/hook/<token>``, ``POST /open-apis/auth/v3/tenant_access_token/internal``,
``POST|GET /open-apis/im/v1/messages``, ``PATCH /open-apis/im/v1/messages/<id>/urgent_{phone,sms,app}``,
``POST /open-apis/im/v1/files``, ``POST /open-apis/sheets/v2/spreadsheets/<token>/values_append``,
``PATCH /open-apis/im/v1/messages/<id>`` (card update: an interactive message whose card, before and
after, declares ``config.update_multi``; body ≤ 30 KB), ``POST /callback/ws/endpoint`` (long
connection, see `feishu_callbacks`, which also sends card-action callbacks).
Failure modes for `fail`: ``rate_limit`` (HTTP 200, code 11232), ``http_429`` (HTTP 429, code
99991400, ``x-ogw-ratelimit-reset``), ``server_error`` (HTTP 500), ``quota`` (code 230024),
``bad_signature`` (19021), ``invalid_token`` (HTTP 400, code 99991663).
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import email.parser
import email.policy
import hashlib
import hmac
import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.support.feishu_callbacks import LongConnectionServer

BODY_LIMIT = 20 * 1024
FAILURES = {
    "rate_limit": (200, 11232, "frequency limited"),
    "http_429": (429, 99991400, "request trigger frequency limit"),
    "server_error": (500, 1, "internal error"),
    "quota": (200, 230024, "urgent quota exhausted"),
    "bad_signature": (200, 19021, "sign match fail or timestamp is not within one hour from current time"),
    "invalid_token": (400, 99991663, "Invalid access token for authorization"),
}


@dataclasses.dataclass
class Record:
    """One accepted request: what Feishu would have done."""

    endpoint: str
    body: Any
    time: float
    key: str = ""  # bot token, chat id, message id or spreadsheet token
    message_id: str = ""


def bot_sign(secret: str, timestamp: str) -> str:
    key = f"{timestamp}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()


class FeishuServer:
    """The fake Feishu; thread-safe; start with `with` or `start()`/`stop()`."""

    def __init__(self, app_id: str = "cli_megatrace_test", app_secret: str = "app-secret-for-tests") -> None:
        self.app_id = app_id
        self.app_secret = app_secret
        self.token_ttl = 7200
        self.invalid_users: set[str] = set()
        self.response_delay = 0.0
        self.records: list[Record] = []
        self.rejections: list[tuple[str, int, str]] = []
        self._bots: dict[str, dict[str, str]] = {}
        self._tokens: dict[str, float] = {}
        self._failures: dict[str, collections.deque[str]] = collections.defaultdict(collections.deque)
        self._uuids: dict[str, str] = {}
        self._bot_times: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.long_connection: LongConnectionServer | None = None
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- control --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> FeishuServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_long_connection(self) -> LongConnectionServer:
        """Accept lark-oapi long connections (endpoint discovery here, the websocket beside)."""
        self.long_connection = LongConnectionServer()
        return self.long_connection

    def stop(self) -> None:
        if self.long_connection is not None:
            self.long_connection.stop()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> FeishuServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_bot(self, secret: str = "", chat_id: str = "") -> str:
        """Create a custom group bot; returns its webhook URL. `chat_id` names the group it posts to."""
        token = f"hook-{next(self._ids)}-{hashlib.sha1(str(time.time()).encode()).hexdigest()[:12]}"
        with self._lock:
            self._bots[token] = {"secret": secret, "chat_id": chat_id}
        return f"{self.url}/open-apis/bot/v2/hook/{token}"

    def fail(self, endpoint: str, *modes: str) -> None:
        """Make the next requests to `endpoint` (bot, token, message, urgent_phone, urgent_sms,
        urgent_app, sheet, file, history) fail, one mode per request, in order."""
        unknown = [m for m in modes if m not in FAILURES]
        if unknown:
            raise ValueError(f"unknown failure modes {unknown}; known: {sorted(FAILURES)}")
        with self._lock:
            self._failures[endpoint].extend(modes)

    def expire_tokens(self) -> None:
        """Invalidate every tenant token issued so far (the next use gets code 99991663)."""
        with self._lock:
            self._tokens.clear()

    def select(self, endpoint: str, key: str | None = None) -> list[Record]:
        with self._lock:
            return [r for r in self.records if r.endpoint == endpoint and (key is None or r.key == key)]

    def bot_posts(self, webhook: str | None = None) -> list[Record]:
        return self.select("bot", None if webhook is None else webhook.rsplit("/", 1)[-1])

    def messages(self, chat_id: str | None = None) -> list[Record]:
        return self.select("message", chat_id)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"condition not met in {timeout}s; records: {self.summary()}")
                self._changed.wait(min(left, 0.2))

    def summary(self) -> dict[str, int]:
        return dict(collections.Counter(r.endpoint for r in self.records))

    # -- internals -------------------------------------------------------------------------------

    def _record(self, record: Record) -> None:
        with self._changed:
            self.records.append(record)
            self._changed.notify_all()

    def _take_failure(self, endpoint: str) -> str | None:
        with self._lock:
            queue = self._failures.get(endpoint)
            return queue.popleft() if queue else None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

            def answer(
                self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
            ) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def reject(self, endpoint: str, status: int, code: int, msg: str) -> None:
                with server._lock:
                    server.rejections.append((endpoint, code, msg))
                self.answer(status, {"code": code, "msg": msg, "data": {}})

            def failed(self, endpoint: str) -> bool:
                mode = server._take_failure(endpoint)
                if mode is None:
                    return False
                status, code, msg = FAILURES[mode]
                headers = {"x-ogw-ratelimit-reset": "1"} if mode == "http_429" else None
                with server._lock:
                    server.rejections.append((endpoint, code, msg))
                self.answer(status, {"code": code, "msg": msg, "data": {}}, headers)
                return True

            def raw_body(self) -> bytes:
                self.raw = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
                return self.raw

            def json_body(self, endpoint: str) -> Any:
                raw = self.raw_body()
                try:
                    return json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    self.reject(endpoint, 400, 9499, "Bad Request: body is not JSON")
                    return None

            def authorized(self, endpoint: str) -> bool:
                header = self.headers.get("Authorization", "")
                token = header[7:] if header.startswith("Bearer ") else ""
                with server._lock:
                    valid = server._tokens.get(token, 0) > time.time()
                if not valid:
                    self.reject(endpoint, 400, 99991663, "Invalid access token for authorization")
                return valid

            def route(self, method: str) -> None:
                parts = urlsplit(self.path)
                path, query = parts.path, {k: v[0] for k, v in parse_qs(parts.query).items()}
                if method == "POST" and path.startswith("/open-apis/bot/v2/hook/"):
                    return self.bot(path.rsplit("/", 1)[-1])
                if method == "POST" and path == "/open-apis/auth/v3/tenant_access_token/internal":
                    return self.token()
                if method == "POST" and path == "/open-apis/im/v1/messages":
                    return self.message(query)
                if method == "GET" and path == "/open-apis/im/v1/messages":
                    return self.history(query)
                urgent = re.fullmatch(
                    r"/open-apis/im/v1/messages/([^/]+)/(urgent_phone|urgent_sms|urgent_app)", path
                )
                if method == "PATCH" and urgent:
                    return self.urgent(urgent.group(1), urgent.group(2), query)
                update = re.fullmatch(r"/open-apis/im/v1/messages/([^/]+)", path)
                if method == "PATCH" and update:
                    return self.update(update.group(1))
                if method == "POST" and path == "/callback/ws/endpoint":
                    return self.ws_endpoint()
                if method == "POST" and path == "/open-apis/im/v1/files":
                    return self.file()
                sheet = re.fullmatch(r"/open-apis/sheets/v2/spreadsheets/([^/]+)/values_append", path)
                if method == "POST" and sheet:
                    return self.sheet(sheet.group(1), query)
                self.answer(404, {"code": 404, "msg": "not found"})

            def do_POST(self) -> None:
                self.route("POST")

            def do_GET(self) -> None:
                self.route("GET")

            def do_PATCH(self) -> None:
                self.route("PATCH")

            # -- endpoints ---------------------------------------------------------------------

            def bot(self, token: str) -> None:
                raw = self.raw_body()
                with server._lock:
                    bot = server._bots.get(token)
                if bot is None:
                    return self.reject(
                        "bot", 200, 19001, "param invalid: incoming webhook access token invalid"
                    )
                if len(raw) > BODY_LIMIT:
                    return self.reject("bot", 200, 9499, f"Bad Request: body of {len(raw)} bytes over 20 KB")
                try:
                    body = json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    return self.reject("bot", 400, 9499, "Bad Request")
                if self.failed("bot"):
                    return
                if bot["secret"]:
                    timestamp = str(body.get("timestamp", ""))
                    fresh = timestamp.isdigit() and abs(time.time() - int(timestamp)) < 3600
                    if not fresh or body.get("sign") != bot_sign(bot["secret"], timestamp):
                        return self.reject(
                            "bot", 200, 19021, "sign match fail or timestamp is not within one hour"
                        )
                problem = check_message(body.get("msg_type"), body.get("card") or body.get("content"))
                if problem:
                    return self.reject("bot", 200, 9499, f"Bad Request: {problem}")
                now = time.time()
                with server._lock:
                    sent = server._bot_times[token]
                    while sent and sent[0] <= now - 60:
                        sent.popleft()
                    too_fast = len(sent) >= 100 or sum(1 for t in sent if t > now - 1) >= 5
                    if not too_fast:
                        sent.append(now)
                if too_fast:
                    return self.reject(
                        "bot", 200, 11232, "frequency limited psm[lark.oapi.app_platform_runtime]"
                    )
                message_id = f"om_bot_{next(server._ids)}"
                server._record(Record("bot", body, now, token, message_id))
                if server.response_delay:
                    time.sleep(server.response_delay)
                self.answer(200, {"code": 0, "msg": "success", "data": {}})

            def token(self) -> None:
                body = self.json_body("token")
                if body is None or self.failed("token"):
                    return
                if body.get("app_id") != server.app_id or body.get("app_secret") != server.app_secret:
                    return self.reject("token", 400, 10014, "app secret invalid")
                token = f"t-{hashlib.sha1(f'{time.time()}{next(server._ids)}'.encode()).hexdigest()}"
                with server._lock:
                    server._tokens[token] = time.time() + server.token_ttl
                server._record(Record("token", {"app_id": body["app_id"]}, time.time()))
                self.answer(
                    200, {"code": 0, "msg": "ok", "tenant_access_token": token, "expire": server.token_ttl}
                )

            def message(self, query: dict[str, str]) -> None:
                body = self.json_body("message")
                if body is None or not self.authorized("message") or self.failed("message"):
                    return
                if query.get("receive_id_type") != "chat_id" or not str(
                    body.get("receive_id", "")
                ).startswith("oc_"):
                    return self.reject("message", 400, 230001, "invalid receive_id or receive_id_type")
                uuid = body.get("uuid", "")
                if not isinstance(uuid, str) or len(uuid) > 50:
                    return self.reject("message", 400, 230001, "uuid longer than 50 characters")
                if not isinstance(body.get("content"), str):
                    return self.reject("message", 400, 230001, "content must be a JSON string")
                try:
                    content = json.loads(body["content"])
                except json.JSONDecodeError:
                    return self.reject("message", 400, 230001, "content is not valid JSON")
                msg_type = body.get("msg_type")
                problem = (
                    ("file_key missing" if not content.get("file_key") else "")
                    if msg_type == "file"
                    else check_message(msg_type, content)
                )
                if problem or len(json.dumps(body).encode()) > 30 * 1024:
                    return self.reject("message", 400, 230025, problem or "message too large")
                with server._lock:
                    known = server._uuids.get(uuid) if uuid else None
                if known is not None:  # same uuid within an hour: not sent again
                    return self.answer(200, {"code": 0, "msg": "success", "data": {"message_id": known}})
                message_id = f"om_{next(server._ids)}"
                if uuid:
                    with server._lock:
                        server._uuids[uuid] = message_id
                record = Record(
                    "message", body | {"content": content}, time.time(), body["receive_id"], message_id
                )
                server._record(record)
                if server.response_delay:
                    time.sleep(server.response_delay)
                self.answer(200, {"code": 0, "msg": "success", "data": {"message_id": message_id}})

            def history(self, query: dict[str, str]) -> None:
                if not self.authorized("history") or self.failed("history"):
                    return
                chat = query.get("container_id", "")
                if query.get("container_id_type") != "chat" or not chat:
                    return self.reject("history", 400, 230001, "container_id_type must be chat")
                start = float(query.get("start_time", "0") or 0)
                with server._lock:
                    bots = {t for t, b in server._bots.items() if b["chat_id"] == chat}
                    items = [
                        {
                            "message_id": r.message_id,
                            "msg_type": r.body.get("msg_type"),
                            "create_time": str(int(r.time * 1000)),
                            "body": {"content": json.dumps(r.body.get("card") or r.body.get("content"))},
                        }
                        for r in server.records
                        if r.time >= start
                        and (
                            (r.endpoint == "bot" and r.key in bots)
                            or (r.endpoint == "message" and r.key == chat)
                        )
                    ]
                size_text = query.get("page_size", "20")
                if not size_text.isdigit() or not 1 <= int(size_text) <= 50:
                    return self.reject("history", 400, 230001, "page_size must be 1 to 50")
                token = query.get("page_token", "")
                offset = int(token) if token.isdigit() else 0
                end = offset + int(size_text)
                data: dict[str, Any] = {"has_more": end < len(items), "items": items[offset:end]}
                if end < len(items):
                    data["page_token"] = str(end)
                self.answer(200, {"code": 0, "msg": "success", "data": data})

            def urgent(self, message_id: str, kind: str, query: dict[str, str]) -> None:
                body = self.json_body(kind)
                if body is None or not self.authorized(kind) or self.failed(kind):
                    return
                if query.get("user_id_type") != "open_id":
                    return self.reject(kind, 400, 230001, "user_id_type must be open_id")
                if not any(r.message_id == message_id for r in server.select("message")):
                    return self.reject(kind, 400, 230011, "message not found or not sent by this app")
                users = body.get("user_id_list")
                if not isinstance(users, list) or not users:
                    return self.reject(kind, 400, 230001, "user_id_list must be a non-empty list")
                invalid = [u for u in users if u in server.invalid_users]
                server._record(Record(kind, {"user_id_list": users}, time.time(), message_id))
                self.answer(200, {"code": 0, "msg": "success", "data": {"invalid_user_id_list": invalid}})

            def update(self, message_id: str) -> None:
                """Replace an app message's card (``PATCH /open-apis/im/v1/messages/{id}``)."""
                body = self.json_body("update")
                if body is None or not self.authorized("update") or self.failed("update"):
                    return
                sent = [r for r in server.select("message") if r.message_id == message_id]
                if not sent:
                    return self.reject("update", 400, 230011, "message not found or not sent by this app")
                if sent[0].body.get("msg_type") != "interactive":
                    return self.reject("update", 400, 230001, "only interactive messages can be updated")
                if len(self.raw) > 30 * 1024:
                    return self.reject("update", 400, 230025, "card update body over 30 KB")
                try:
                    card = json.loads(body.get("content", ""))
                except (TypeError, json.JSONDecodeError):
                    return self.reject("update", 400, 230001, "content must be a card as a JSON string")
                problem = check_message("interactive", card)
                if problem:
                    return self.reject("update", 400, 230001, problem)
                before = sent[0].body["content"].get("config", {}).get("update_multi")
                if before is not True or card.get("config", {}).get("update_multi") is not True:
                    return self.reject(
                        "update",
                        400,
                        230001,
                        'a shared card needs config "update_multi": true before and after',
                    )
                server._record(Record("update", {"card": card}, time.time(), message_id, message_id))
                self.answer(200, {"code": 0, "msg": "success", "data": {}})

            def ws_endpoint(self) -> None:
                """Long-connection endpoint discovery (lark-oapi ``ws.Client``): app id and secret in,
                a websocket URL out."""
                body = self.json_body("ws_endpoint")
                if body is None:
                    return
                if body.get("AppID") != server.app_id or body.get("AppSecret") != server.app_secret:
                    return self.reject("ws_endpoint", 200, 1000040343, "app id or secret invalid")
                if server.long_connection is None:
                    return self.reject("ws_endpoint", 200, 1, "system busy")
                server._record(Record("ws_endpoint", {"AppID": body["AppID"]}, time.time()))
                self.answer(200, server.long_connection.endpoint())

            def file(self) -> None:
                raw = self.raw_body()
                if not self.authorized("file") or self.failed("file"):
                    return
                header = f"Content-Type: {self.headers.get('Content-Type', '')}\r\n\r\n".encode()
                parsed = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(header + raw)
                fields = {
                    part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
                    for part in parsed.iter_parts()
                }
                if not fields.get("file") or not fields.get("file_name") or fields.get("file_type") is None:
                    return self.reject("file", 400, 234001, "file, file_name and file_type are required")
                if len(fields["file"]) > 30 * 1024 * 1024:
                    return self.reject("file", 400, 234006, "file larger than 30 MB")
                file_key = f"file_v3_{next(server._ids)}"
                record = {
                    "file_type": fields["file_type"].decode(),
                    "file_name": fields["file_name"].decode(),
                    "data": fields["file"],
                }
                server._record(Record("file", record, time.time(), file_key))
                self.answer(200, {"code": 0, "msg": "success", "data": {"file_key": file_key}})

            def sheet(self, spreadsheet: str, query: dict[str, str]) -> None:
                body = self.json_body("sheet")
                if body is None or not self.authorized("sheet") or self.failed("sheet"):
                    return
                if query.get("insertDataOption") not in (None, "INSERT_ROWS", "OVERWRITE"):
                    return self.reject("sheet", 400, 90202, "invalid insertDataOption")
                value_range = body.get("valueRange") if isinstance(body, dict) else None
                values = value_range.get("values") if isinstance(value_range, dict) else None
                if not isinstance(values, list) or not values or len(values) > 5000:
                    return self.reject("sheet", 400, 90202, "valueRange.values must hold 1..5000 rows")
                if not re.fullmatch(r"[^!]+![A-Z]+\d+(:[A-Z]+\d+)?", str(value_range.get("range", ""))):
                    return self.reject("sheet", 400, 90202, "invalid range")
                server._record(Record("sheet", body, time.time(), spreadsheet))
                self.answer(
                    200, {"code": 0, "msg": "success", "data": {"updates": {"updatedRows": len(values)}}}
                )

        return Handler


def check_message(msg_type: Any, content: Any) -> str:
    """What is wrong with a text or interactive message, or "" when it is well formed."""
    if msg_type == "text":
        return "" if isinstance(content, dict) and isinstance(content.get("text"), str) else "text missing"
    if msg_type != "interactive":
        return f"unsupported msg_type {msg_type!r}"
    if not isinstance(content, dict):
        return "card missing"
    title = content.get("header", {}).get("title", {})
    if title.get("tag") != "plain_text" or not title.get("content"):
        return "card header.title must be plain_text with content"
    elements = content.get("elements")
    if not isinstance(elements, list) or not elements:
        return "card elements missing"
    if any(not isinstance(e, dict) or "tag" not in e for e in elements):
        return "every card element needs a tag"
    return ""


AT_TAG = re.compile(r"<at\s+(?:id|user_id|open_id|email)\s*=\s*['\"]?([^'\" >]*)", re.IGNORECASE)


def mentions(content: Any) -> list[str]:
    """Who a card or text message pings, as Feishu reads it: the ``<at …>`` tags of its lark_md
    fields (cards) or of its text ("all" for everyone)."""
    if isinstance(content, dict) and content.get("tag") == "lark_md":
        return AT_TAG.findall(str(content.get("content", "")))
    if isinstance(content, dict) and set(content) == {"text"}:
        return AT_TAG.findall(str(content["text"]))
    if isinstance(content, dict):
        return [who for value in content.values() for who in mentions(value)]
    if isinstance(content, list):
        return [who for value in content for who in mentions(value)]
    return []
