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

import hashlib
import hmac
import json
import logging
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
    """A callback that is not from Feishu for this app, or is stale; nothing was done."""


def signature(timestamp: str, nonce: str, encrypt_key: str, body: bytes) -> str:
    return hashlib.sha256((timestamp + nonce + encrypt_key).encode() + body).hexdigest()


def verify_request(
    cfg: CallbackConfig, headers: Mapping[str, str], body: bytes, now: float
) -> dict[str, Any]:
    """The decrypted callback of a request-URL POST, or CallbackRejected saying why."""
    try:
        envelope = json.loads(body)
        encrypted = envelope["encrypt"]
        plain = json.loads(AESCipher(cfg.encrypt_key).decrypt_str(encrypted))
    except (ValueError, KeyError, TypeError) as exc:
        raise CallbackRejected(f"not an encrypted callback for this app ({type(exc).__name__})") from None
    if not isinstance(plain, dict):
        raise CallbackRejected("decrypted callback is not an object")
    if plain.get("type") == "url_verification":
        token = plain.get("token")
    else:
        token = (plain.get("header") or {}).get("token")
    if not isinstance(token, str) or not hmac.compare_digest(token, cfg.verification_token):
        raise CallbackRejected("wrong verification token")
    if plain.get("type") == "url_verification":
        return plain
    timestamp = headers.get("X-Lark-Request-Timestamp", "")
    nonce = headers.get("X-Lark-Request-Nonce", "")
    given = headers.get("X-Lark-Signature", "")
    if not hmac.compare_digest(given, signature(timestamp, nonce, cfg.encrypt_key, body)):
        raise CallbackRejected("signature mismatch")
    if not timestamp.isdigit() or abs(now - int(timestamp)) > cfg.max_skew_s:
        raise CallbackRejected(f"timestamp {timestamp!r} more than {cfg.max_skew_s:g}s off")
    if (plain.get("header") or {}).get("event_type") != CARD_ACTION:
        raise CallbackRejected(f"unsupported callback type {(plain.get('header') or {}).get('event_type')!r}")
    return plain


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
