"""The Feishu stand-in's side of card-action callbacks (``card.action.trigger``, schema 2.0).

Request-URL mode (`CallbackSender`): the body is ``{"encrypt": base64(IV + AES-256-CBC(SHA-256(encrypt
key), PKCS#7(JSON)))}``, the headers carry ``X-Lark-Request-Timestamp``, ``X-Lark-Request-Nonce`` and
``X-Lark-Signature`` = hex SHA-256(timestamp + nonce + encrypt key + body). It can also send unsigned,
forged and replayed requests, as an attacker would.

Long-connection mode (`LongConnectionServer`): what lark-oapi's `ws.Client` talks to. The client
POSTs ``/callback/ws/endpoint`` with ``{"AppID", "AppSecret"}`` (served by `FeishuServer`) and gets
``{"code": 0, "data": {"URL": "wss://…?device_id=…&service_id=…", "ClientConfig": {…}}}``; it
opens that websocket; every message is a protobuf ``pbbp2.Frame`` (the SDK's own ``pbbp2_pb2``):
method 0 = control (headers ``type`` ``ping``/``pong``), 1 = data (headers ``type`` ``event``,
``message_id``, ``trace_id``, ``sum``, ``seq``; payload = the callback JSON). The client answers a
data frame with the same frame whose payload is ``{"code": 200, "data": base64(JSON answer)}``.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import queue
import secrets
import threading
import time
from typing import Any

import requests
from Crypto.Cipher import AES
from lark_oapi.ws.pb.pbbp2_pb2 import Frame
from websockets.sync.server import ServerConnection, serve

from megatrace.alertbot.kinds import EpisodeStatus, NotificationKind
from megatrace.alertbot.store import Store
from megatrace.alertbot.store.records import NewEpisode, NewNotification


def encrypt(encrypt_key: str, plain: dict[str, Any]) -> str:
    key = hashlib.sha256(encrypt_key.encode()).digest()
    data = json.dumps(plain).encode()
    pad = 16 - len(data) % 16
    iv = os.urandom(16)
    return base64.b64encode(iv + AES.new(key, AES.MODE_CBC, iv).encrypt(data + bytes([pad]) * pad)).decode()


def card_action_event(
    token: str, operator: str, value: dict[str, Any], message_id: str, form_value: dict | None = None
) -> dict[str, Any]:
    """A ``card.action.trigger`` callback as Feishu sends it (schema 2.0)."""
    action: dict[str, Any] = {"tag": "button", "value": value}
    if form_value is not None:
        action["form_value"] = form_value
    return {
        "schema": "2.0",
        "header": {
            "event_id": secrets.token_hex(16),
            "token": token,
            "create_time": str(int(time.time() * 1000)),
            "event_type": "card.action.trigger",
            "tenant_key": "tenant-test",
            "app_id": "cli_megatrace_test",
        },
        "event": {
            "operator": {"tenant_key": "tenant-test", "open_id": operator, "union_id": "on_x"},
            "token": "c-update-token",
            "action": action,
            "host": "im_message",
            "context": {"open_message_id": message_id, "open_chat_id": "oc_p0"},
        },
    }


class CallbackSender:
    """Posts callbacks to a bot's request URL the way Feishu does; keeps the last for replays."""

    def __init__(self, url: str, token: str, encrypt_key: str) -> None:
        self.url, self.token, self.encrypt_key = url, token, encrypt_key
        self.last: tuple[bytes, dict[str, str]] | None = None

    def post(
        self, plain: dict[str, Any], sign: bool = True, key: str | None = None, timestamp: int | None = None
    ) -> requests.Response:
        """Encrypt and sign `plain` (with `key` instead of the app's to forge; `sign=False` drops the
        signature headers); `timestamp` overrides the current time."""
        key = self.encrypt_key if key is None else key
        body = json.dumps({"encrypt": encrypt(key, plain)}).encode()
        stamp, nonce = str(int(time.time()) if timestamp is None else timestamp), secrets.token_hex(8)
        headers = {"Content-Type": "application/json"}
        if sign:
            digest = hashlib.sha256((stamp + nonce + key).encode() + body).hexdigest()
            headers |= {
                "X-Lark-Request-Timestamp": stamp,
                "X-Lark-Request-Nonce": nonce,
                "X-Lark-Signature": digest,
            }
        self.last = (body, headers)
        return requests.post(self.url, data=body, headers=headers, timeout=5)

    def replay(self) -> requests.Response:
        """The last request again, byte for byte (a captured request sent by someone else)."""
        assert self.last is not None
        body, headers = self.last
        return requests.post(self.url, data=body, headers=headers, timeout=5)

    def click(
        self, operator: str, value: dict[str, Any], message_id: str, **kwargs: Any
    ) -> requests.Response:
        form_value = kwargs.pop("form_value", None)
        return self.post(card_action_event(self.token, operator, value, message_id, form_value), **kwargs)


def data_frame(payload: bytes, method: int = 1, **headers: str | None) -> Frame:
    """A frame as Feishu sends an event: headers ``type`` event, ``message_id``, ``trace_id``, ``sum``
    1, ``seq`` 0, each replaced by `headers` (None leaves one out)."""
    frame = Frame(SeqID=1, LogID=0, service=7, method=method, payload=payload)
    fields = {
        "type": "event",
        "message_id": "msg-0",
        "trace_id": secrets.token_hex(8),
        "sum": "1",
        "seq": "0",
    }
    for key, value in (fields | headers).items():
        if value is not None:
            frame.headers.add(key=key, value=value)
    return frame


class LongConnectionServer:
    """The websocket end of Feishu's long connection, on a loopback port."""

    def __init__(self) -> None:
        self._clients: list[ServerConnection] = []
        self._answers: dict[str, queue.Queue[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.connected = threading.Event()
        self.connections = 0  # accepted since the start: a client that reconnects adds one
        self.pings = 0
        self._server = serve(self._serve, "127.0.0.1", 0)
        self.port = self._server.socket.getsockname()[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def endpoint(self) -> dict[str, Any]:
        """What ``POST /callback/ws/endpoint`` answers (see the module docstring)."""
        url = f"ws://127.0.0.1:{self.port}/ws?device_id=dev-{next(self._ids)}&service_id=7"
        config = {"ReconnectCount": -1, "ReconnectInterval": 1, "ReconnectNonce": 0, "PingInterval": 5}
        return {"code": 0, "msg": "ok", "data": {"URL": url, "ClientConfig": config}}

    def _serve(self, conn: ServerConnection) -> None:
        with self._lock:
            self._clients.append(conn)
            self.connections += 1
        self.connected.set()
        for message in conn:
            frame = Frame()
            frame.ParseFromString(message)
            headers = {h.key: h.value for h in frame.headers}
            if frame.method == 0 and headers.get("type") == "ping":
                self.pings += 1
                pong = Frame(SeqID=0, LogID=0, service=frame.service, method=0)
                pong.headers.add(key="type", value="pong")
                conn.send(pong.SerializeToString())
            elif frame.method == 1:
                answer = json.loads(frame.payload)
                data = json.loads(base64.b64decode(answer["data"])) if answer.get("data") else None
                self._answers[headers["message_id"]].put({"code": answer["code"], "data": data})
        with self._lock:
            self._clients.remove(conn)

    def push(self, callback: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """Send one callback down the newest connection; returns the client's answer
        ``{"code": HTTP status, "data": the handler's answer}``."""
        self.connected.wait(timeout)
        with self._lock:
            conn = self._clients[-1]
        message_id = f"msg-{next(self._ids)}"
        self._answers[message_id] = queue.Queue()
        conn.send(data_frame(json.dumps(callback).encode(), message_id=message_id).SerializeToString())
        return self._answers[message_id].get(timeout=timeout)

    def send_raw(self, message: bytes | str) -> None:
        """Send `message` as it is down the newest connection: what a hostile or broken peer sends."""
        self.connected.wait(10)
        with self._lock:
            conn = self._clients[-1]
        conn.send(message)

    def drop_newest(self) -> None:
        """Close the newest connection from this end (Feishu restarting, a network cut)."""
        with self._lock:
            conn = self._clients[-1]
        conn.close()

    def stop(self) -> None:
        self._server.shutdown()


def alert_with_card(store: Store, message_id: str, alertname: str = "MegatraceRankHang") -> int:
    """An alert episode and its card, recorded as sent as message `message_id` (a card action names
    the card it came from); returns the episode's id. For tests that click without a real send."""
    with store.transaction():
        episode = store.episodes.insert(
            NewEpisode(
                fingerprint=f"f-{message_id}",
                starts_at=1.0,
                alertname=alertname,
                labels={},
                annotations={},
                generator_url="",
                external_url="",
                status=EpisodeStatus.FIRING,
                severity="P0",
                level="P0",
                escalated=False,
                recurrence=0,
                recent=0,
                flapping=False,
                first_seen=1.0,
                last_seen=1.0,
                ends_at=None,
            )
        ).id
        card = store.outbox.enqueue(
            NewNotification(
                kind=NotificationKind.FIRING,
                channel="app",
                destination="oc_p0",
                level="P0",
                idem_key=f"card-{message_id}",
                created_at=1.0,
                not_before=1.0,
                episode_id=episode,
            )
        )
        assert card is not None
        store.outbox.update(card, state="sent", message_id=message_id)
    return episode
