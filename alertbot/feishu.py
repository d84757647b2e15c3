"""Feishu/Lark open platform clients: custom group bots (signed webhooks) and the app API (tenant
token, messages with an idempotency uuid, urgent phone/SMS/app, sheet append, file upload, chat history).

Every call returns a `SendResult` that says whether it worked, is worth retrying (and after how
long, when Feishu says) or can never work.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import requests

from megatrace.alertbot.kinds import Outcome

log = logging.getLogger(__name__)

RETRY_CODES = frozenset({11232, 99991400})
TOKEN_CODES = frozenset({99991661, 99991663, 99991665})
QUOTA_EXHAUSTED = 230024
BODY_LIMIT = 20 * 1024
HISTORY_PAGE = 50  # the most Feishu's message history returns per page


@dataclasses.dataclass
class SendResult:
    outcome: Outcome
    detail: str
    retry_after: float | None = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    code: int | None = None
    body: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.SENT


def sign(secret: str, timestamp: str) -> str:
    """Feishu custom bot signature: base64(HMAC-SHA256(key=timestamp + "\\n" + secret, msg=b""))."""
    key = f"{timestamp}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()


def _reset_after(response: requests.Response) -> float | None:
    value = response.headers.get("x-ogw-ratelimit-reset")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def classify(response: requests.Response) -> SendResult:
    """Turn a Feishu HTTP answer into a SendResult."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {}
    code = body.get("code", body.get("StatusCode"))
    msg = str(body.get("msg", body.get("StatusMessage", "")))[:300]
    found = body.get("data")
    data: dict[str, Any] = found if isinstance(found, dict) else {}
    detail = f"HTTP {response.status_code} code {code}: {msg}"
    if response.status_code == 429 or code in RETRY_CODES:
        return SendResult(Outcome.RETRY, detail, _reset_after(response), data, code, body)
    if response.status_code >= 500:
        return SendResult(Outcome.RETRY, detail, None, data, code, body)
    if response.status_code == 200 and code == 0:
        return SendResult(Outcome.SENT, "ok", None, data, 0, body)
    return SendResult(Outcome.FATAL, detail, None, data, code, body)


def _request(session: requests.Session, method: str, url: str, timeout: float, **kwargs: Any) -> SendResult:
    try:
        response = session.request(method, url, timeout=timeout, **kwargs)
    except requests.RequestException as exc:
        return SendResult(Outcome.RETRY, f"{type(exc).__name__}: network error")
    return classify(response)


def signed_body(body: dict[str, Any], secret: str, now: float | None = None) -> dict[str, Any]:
    """`body` with `timestamp` and `sign` at the top level when the bot has a secret."""
    if not secret:
        return body
    timestamp = str(int(time.time() if now is None else now))
    return {"timestamp": timestamp, "sign": sign(secret, timestamp), **body}


def post_group_bot(
    session: requests.Session, webhook: str, secret: str, body: dict[str, Any], timeout: float
) -> SendResult:
    """Send one message through a custom group bot."""
    data = json.dumps(signed_body(body, secret), ensure_ascii=False).encode()
    if len(data) > BODY_LIMIT:
        return SendResult(
            Outcome.FATAL, f"message is {len(data)} bytes, over Feishu's {BODY_LIMIT} byte limit"
        )
    return _request(
        session, "POST", webhook, timeout, data=data, headers={"Content-Type": "application/json"}
    )


class FeishuApp:
    """A Feishu app (self-built, internal): cached tenant token and the API calls the bot needs."""

    def __init__(self, base_url: str, app_id: str, app_secret: str, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.app_id = app_id
        self.app_secret = app_secret
        self.timeout = timeout
        self.session = requests.Session()
        self._lock = threading.Lock()
        self._token = ""
        self._expires = 0.0

    def token(self, force: bool = False) -> tuple[str, SendResult | None]:
        """The tenant access token, fetched when missing, forced, or within 5 minutes of expiry."""
        with self._lock:
            if self._token and not force and time.monotonic() < self._expires - 300:
                return self._token, None
            result = _request(
                self.session,
                "POST",
                f"{self.base_url}/open-apis/auth/v3/tenant_access_token/internal",
                self.timeout,
                json={"app_id": self.app_id, "app_secret": self.app_secret},
            )
            if not result.ok:
                return "", result
            token = str(result.body.get("tenant_access_token", ""))
            if not token:
                return "", SendResult(Outcome.FATAL, "token reply without tenant_access_token")
            expire = result.body.get("expire", 7200)
            self._token = token
            self._expires = time.monotonic() + (float(expire) if isinstance(expire, int | float) else 7200.0)
            return token, None

    def call(self, method: str, path: str, **kwargs: Any) -> SendResult:
        """An authenticated API call; an invalid-token answer refreshes the token and retries once."""
        for attempt in range(2):
            token, failure = self.token(force=attempt == 1)
            if failure is not None:
                return failure
            headers = {"Authorization": f"Bearer {token}", **kwargs.pop("headers", {})}
            result = _request(
                self.session, method, f"{self.base_url}{path}", self.timeout, headers=headers, **kwargs
            )
            if result.code not in TOKEN_CODES:
                return result
            log.info("Feishu rejected the tenant token (code %s); refreshing", result.code)
        return result

    def send_message(self, chat_id: str, msg_type: str, content: dict[str, Any], uuid: str) -> SendResult:
        body = {
            "receive_id": chat_id,
            "msg_type": msg_type,
            "content": json.dumps(content, ensure_ascii=False),
            "uuid": uuid,
        }
        return self.call(
            "POST", "/open-apis/im/v1/messages", params={"receive_id_type": "chat_id"}, json=body
        )

    def update_message(self, message_id: str, card: dict[str, Any]) -> SendResult:
        """Replace the card of a message the app sent (for everyone when the card says
        ``update_multi``): ``PATCH /open-apis/im/v1/messages/{message_id}``."""
        body = {"content": json.dumps(card, ensure_ascii=False)}
        return self.call("PATCH", f"/open-apis/im/v1/messages/{message_id}", json=body)

    def urgent(self, message_id: str, kind: str, user_ids: list[str]) -> SendResult:
        """Buzz people about a message the app sent: kind is urgent_phone, urgent_sms or urgent_app."""
        return self.call(
            "PATCH",
            f"/open-apis/im/v1/messages/{message_id}/{kind}",
            params={"user_id_type": "open_id"},
            json={"user_id_list": user_ids},
        )

    def append_rows(self, spreadsheet: str, sheet_id: str, rows: list[list[Any]]) -> SendResult:
        body = {"valueRange": {"range": f"{sheet_id}!A1:L{len(rows)}", "values": rows}}
        return self.call(
            "POST",
            f"/open-apis/sheets/v2/spreadsheets/{spreadsheet}/values_append",
            params={"insertDataOption": "INSERT_ROWS"},
            json=body,
        )

    def upload_file(self, path: Path) -> SendResult:
        with open(path, "rb") as handle:
            return self.call(
                "POST",
                "/open-apis/im/v1/files",
                data={"file_type": "xls", "file_name": path.name},
                files={"file": (path.name, handle, "application/octet-stream")},
            )

    def chat_messages(self, chat_id: str, start_time: float) -> SendResult:
        """Every message in a chat since `start_time` (Unix seconds), oldest first, in `data.items`:
        the history is read page by page (50 at most each) until Feishu says `has_more` is false."""
        params = {
            "container_id_type": "chat",
            "container_id": chat_id,
            "start_time": str(int(start_time)),
            "page_size": str(HISTORY_PAGE),
        }
        items: list[Any] = []
        while True:
            result = self.call("GET", "/open-apis/im/v1/messages", params=params)
            if not result.ok:
                return result
            items.extend(result.data.get("items") or [])
            token = result.data.get("page_token")
            if not result.data.get("has_more"):
                return dataclasses.replace(result, data={**result.data, "items": items})
            if not token or token == params.get("page_token"):
                return SendResult(Outcome.RETRY, "chat history says has_more but gives no new page_token")
            params["page_token"] = str(token)
