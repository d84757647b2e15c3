"""The request-URL callback endpoint authenticates before it parses: its own 1 MiB body limit, the
signature checked over the raw bytes before any decryption or JSON, a 4xx for every malformed
body, and the callback code loaded when the bot starts (not in the first request)."""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from megatrace.alertbot.server import CALLBACK_MAX_BODY
from megatrace.alertbot.service import Service
from tests.alertbot.conftest import config
from tests.support.feishu_callbacks import CallbackSender, card_action_event, encrypt

VERIFY, KEY = "verification-token-for-tests", "encrypt-key-for-tests"
CALLBACK = {"mode": "request_url", "verification_token": VERIFY, "encrypt_key": KEY}
SECTIONS = {
    "feishu": {
        "base_url": "http://127.0.0.1:9",  # nothing is sent in these tests
        "app": {"app_id": "cli_test", "app_secret": "app-secret-for-tests"},
        "callback": CALLBACK,
    },
    "oncall": {"roster": [{"name": "alice", "open_id": "ou_a"}]},
}


@pytest.fixture
def bot(tmp_path: Path) -> Iterator[Service]:
    service = Service(config(tmp_path, **SECTIONS))
    service.start()
    try:
        yield service
    finally:
        service.stop()


def endpoint(bot: Service) -> str:
    return f"http://127.0.0.1:{bot.port}/feishu/callback"


def signed_headers(body: bytes, stamp: str, key: str = KEY) -> dict[str, str]:
    nonce = secrets.token_hex(8)
    digest = hashlib.sha256((stamp + nonce + key).encode() + body).hexdigest()
    return {
        "Content-Type": "application/json",
        "X-Lark-Request-Timestamp": stamp,
        "X-Lark-Request-Nonce": nonce,
        "X-Lark-Signature": digest,
    }


def test_a_body_over_the_callback_limit_is_refused_before_it_is_read(bot: Service) -> None:
    # Only the headers are sent: a limit checked after reading would wait for the body (408).
    with socket.create_connection(("127.0.0.1", bot.port), timeout=20) as client:
        client.sendall(
            b"POST /feishu/callback HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {CALLBACK_MAX_BODY + 1}\r\n\r\n".encode()
        )
        assert client.recv(200).startswith(b"HTTP/1.1 413 ")
    assert bot.cfg.max_body_bytes > CALLBACK_MAX_BODY  # the webhook keeps its own, larger limit


def test_twelve_parallel_large_bodies_are_all_refused(bot: Service) -> None:
    body = b"x" * (CALLBACK_MAX_BODY + 1)
    answers: list[int] = []

    def post() -> None:
        try:
            answers.append(requests.post(endpoint(bot), data=body, timeout=30).status_code)
        except requests.ConnectionError:  # the bot closed the connection after its 413
            answers.append(413)

    threads = [threading.Thread(target=post) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [413] * 12


def test_every_malformed_body_gets_a_4xx(bot: Service) -> None:
    deep = b'{"encrypt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    not_base64 = json.dumps({"encrypt": "%%% not base64 %%%"}).encode()
    bad_padding = json.dumps({"encrypt": "A" * 44}).encode()
    stamp = str(int(time.time()))
    for body in (deep, not_base64, bad_padding, b"\xff\xfe", b"[]", b'{"encrypt": 7}'):
        unsigned = requests.post(endpoint(bot), data=body, timeout=20)
        assert unsigned.status_code == 401, body[:20]
        signed = requests.post(endpoint(bot), data=body, headers=signed_headers(body, stamp), timeout=20)
        assert signed.status_code == 400, body[:20]  # authentic, but cannot be read


def test_a_timestamp_that_is_not_ascii_digits_is_refused(bot: Service) -> None:
    body = json.dumps({"encrypt": encrypt(KEY, card_action_event(VERIFY, "ou_a", {}, "om_1"))}).encode()
    for stamp in ("²", "³¹", "-5", "1e9", "7.0", ""):  # "²".isdigit() is True
        answer = requests.post(endpoint(bot), data=body, headers=signed_headers(body, stamp), timeout=20)
        assert answer.status_code == 401, stamp


def test_url_verification_with_signature_headers_must_be_signed_right(bot: Service) -> None:
    challenge = {"type": "url_verification", "challenge": "c-9", "token": VERIFY}
    sender = CallbackSender(endpoint(bot), VERIFY, KEY)
    assert sender.post(challenge).json() == {"challenge": "c-9"}  # signed
    assert sender.post(challenge, sign=False).json() == {"challenge": "c-9"}  # as Feishu sends it
    assert sender.post(challenge, key="someone-elses-key").status_code == 401
    assert sender.post(challenge, timestamp=int(time.time()) - 3600).status_code == 401
    assert sender.post(challenge | {"token": "wrong-token"}, sign=False).status_code == 401


def test_the_callback_code_is_loaded_when_the_bot_starts(tmp_path: Path) -> None:
    """lark-oapi takes seconds to import: done in a request, Feishu's 1 s for the challenge is gone."""
    path = tmp_path / "bot.yaml"
    settings = {"store": {"path": str(tmp_path / "bot.db")}, "auth": {"bearer_token": "t"}, **SECTIONS}
    path.write_text(json.dumps(settings))
    probe = f"""
import sys
from megatrace.alertbot.config import load
from megatrace.alertbot.service import Service
before = "lark_oapi" in sys.modules
Service(load({str(path)!r}), listen=False).store.close()
print(before, "lark_oapi" in sys.modules)
"""
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=repo, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "True"], out.stderr
