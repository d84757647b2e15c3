"""Feishu card-action callbacks reach the bot in one of two ways (``feishu.callback.mode``):

- ``request_url``: Feishu POSTs to ``/feishu/callback``. `verify_request` applies the platform's
  rules before anything is acted on: the body ``{"encrypt": …}`` is AES-256-CBC under the SHA-256 of
  the encrypt key (IV = the first 16 bytes, PKCS#7 padding; decrypted with lark-oapi's `AESCipher`);
  ``X-Lark-Signature`` = hex SHA-256 of timestamp + nonce + encrypt key + raw body; the decrypted
  ``header.token`` (``token`` for ``url_verification``) equals the verification token. On top of
  Feishu's rules the bot refuses a timestamp more than ``max_skew_s`` off and an event id seen before.
- ``long_connection``: lark-oapi's websocket client (`lark_oapi.ws.Client`) keeps a connection to
  Feishu open; it authenticates once when connecting (app id and secret) and callbacks arrive in
  plain text over it; the SDK's event dispatcher hands ``card.action.trigger`` to the bot.

Both end in `Actions.handle`, which also refuses replays (event ids) and people off the roster.
"""

from __future__ import annotations

import base64
import contextlib
import email.message
import hashlib
import hmac
import json
import logging
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import lark_oapi
from lark_oapi.core.utils import AESCipher
from lark_oapi.event.callback.model.p2_card_action_trigger import (
    P2CardActionTrigger,
    P2CardActionTriggerResponse,
)

from megatrace.alertbot.config import CallbackConfig
from megatrace.alertbot.long_connection import GuardedClient

log = logging.getLogger(__name__)
CARD_ACTION = "card.action.trigger"


class CallbackRejected(Exception):
    """A callback that is not from Feishu for this app, is stale or is malformed; nothing was done.
    `status` is the HTTP answer: 401 when it is not authenticated, 400 when it is but cannot be read."""

    def __init__(self, reason: str, status: int = 401) -> None:
        super().__init__(reason)
        self.status = status


SIGNATURE_HEADERS = ("X-Lark-Request-Timestamp", "X-Lark-Request-Nonce", "X-Lark-Signature")
TIMESTAMP = re.compile(r"[0-9]{1,12}")  # ASCII digits only: str.isdigit() also takes "²"


def signature(timestamp: str, nonce: str, encrypt_key: str, body: bytes) -> str:
    return hashlib.sha256((timestamp + nonce + encrypt_key).encode() + body).hexdigest()


def verify_request(
    cfg: CallbackConfig, headers: Mapping[str, str] | email.message.Message, body: bytes, now: float
) -> dict[str, Any]:
    """The decrypted callback of a request-URL POST, or CallbackRejected saying why.

    Authentication comes first and reads only the headers and the raw bytes: a signed request's
    signature and timestamp are checked before anything is decrypted or parsed. Only an unsigned
    ``url_verification`` (Feishu sends the challenge without signature headers) is decrypted
    without them, and it must still carry the verification token."""
    signed = any(headers.get(name) for name in SIGNATURE_HEADERS)
    if signed:
        authenticate(cfg, headers, body, now)
    plain = decrypt(cfg, body, status=400 if signed else 401)
    kind = plain.get("type")
    found = plain.get("header")
    header: dict[str, Any] = found if isinstance(found, dict) else {}
    token = plain.get("token") if kind == "url_verification" else header.get("token")
    if not isinstance(token, str) or not hmac.compare_digest(token, cfg.verification_token):
        raise CallbackRejected("wrong verification token")
    if kind == "url_verification":
        return plain
    if not signed:
        raise CallbackRejected("signature mismatch: unsigned callback")
    if header.get("event_type") != CARD_ACTION:
        raise CallbackRejected(f"unsupported callback type {header.get('event_type')!r}", status=400)
    return plain


def authenticate(
    cfg: CallbackConfig, headers: Mapping[str, str] | email.message.Message, body: bytes, now: float
) -> None:
    """Check the signature over the raw body and the timestamp's freshness, or CallbackRejected."""
    timestamp = headers.get("X-Lark-Request-Timestamp", "")
    nonce = headers.get("X-Lark-Request-Nonce", "")
    given = headers.get("X-Lark-Signature", "")
    expected = signature(timestamp, nonce, cfg.encrypt_key, bytes(body))
    if not hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode()):
        raise CallbackRejected("signature mismatch")
    if not TIMESTAMP.fullmatch(timestamp) or abs(now - int(timestamp)) > cfg.max_skew_s:
        raise CallbackRejected(f"timestamp {timestamp[:20]!r} more than {cfg.max_skew_s:g}s off")


def decrypt(cfg: CallbackConfig, body: bytes, status: int) -> dict[str, Any]:
    """The JSON object inside ``{"encrypt": …}``; any malformed body is CallbackRejected(`status`)."""
    try:
        envelope = json.loads(body)
        plain = json.loads(AESCipher(cfg.encrypt_key).decrypt_str(envelope["encrypt"]))
    except Exception as exc:  # bad JSON, nesting past the recursion limit, bad base64 or padding
        raise CallbackRejected(
            f"not an encrypted callback for this app ({type(exc).__name__})", status=status
        ) from None
    if not isinstance(plain, dict):
        raise CallbackRejected("decrypted callback is not an object", status=status)
    return plain


def warm_up(cfg: CallbackConfig) -> None:
    """Set up the cipher once at start, so that the first real callback pays for no lazy set-up
    (Feishu allows 1 s for ``url_verification``); a block of zeros decrypts to bad padding."""
    with contextlib.suppress(Exception):
        AESCipher(cfg.encrypt_key).decrypt_str(base64.b64encode(bytes(32)).decode())


Handler = Callable[[dict[str, Any], str], dict[str, Any]]


def long_connection(app_id: str, app_secret: str, domain: str, handle: Handler) -> GuardedClient:
    """lark-oapi's websocket client, delivering card actions to `handle(callback, source)`."""

    def on_card_action(data: P2CardActionTrigger) -> P2CardActionTriggerResponse:
        callback = json.loads(lark_oapi.JSON.marshal(data))
        return P2CardActionTriggerResponse(handle(callback, "long_connection"))

    dispatcher = (
        lark_oapi.EventDispatcherHandler.builder("", "")
        .register_p2_card_action_trigger(on_card_action)
        .build()
    )
    return GuardedClient(
        app_id, app_secret, event_handler=dispatcher, domain=domain, log_level=lark_oapi.LogLevel.WARNING
    )


def start_long_connection(client: lark_oapi.ws.Client) -> threading.Thread:
    """Run the client in a daemon thread (it reconnects by itself and has no stop; it ends with the
    process)."""
    thread = threading.Thread(target=client.start, name="alertbot-feishu-ws", daemon=True)
    thread.start()
    return thread
