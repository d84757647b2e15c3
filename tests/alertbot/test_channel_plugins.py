"""A channel with settings is one file and one table row: configured through `alertbot.config.load`
from YAML, allowed by the Helm chart's schema, and delivering the neutral notification through the
real `Delivery` to a local HTTP server."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import pytest
import yaml

from megatrace.alertbot import config as bot_config
from megatrace.alertbot.channels import CHANNELS
from megatrace.config import ConfigError
from megatrace.logsetup import redact
from tests.alertbot.conftest import TOKEN, Bot, alert, webhook
from tests.alertbot.webhook_channel import WebhookChannel, WebhookSettings
from tests.support.services import serving

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hook-secret-4f1c"


class Receiver:
    """A local HTTP endpoint that records each JSON body and its signature header."""

    def __init__(self) -> None:
        self.posts: list[tuple[dict[str, object], str]] = []
        posts = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                posts.append((json.loads(body), self.headers.get("X-Megatrace-Signature", "")))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    with serving(found.server):
        yield found


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(CHANNELS, WebhookChannel.name, WebhookChannel())  # the one table row


def write_config(tmp_path: Path, channels: dict[str, object]) -> Path:
    path = tmp_path / "alertbot.yaml"
    data = {
        "listen": "127.0.0.1:0",
        "auth": {"bearer_token": TOKEN},
        "store": {"path": str(tmp_path / "bot.db")},
        "delivery": {"console_path": str(tmp_path / "console.jsonl")},
        "report": {"directory": str(tmp_path / "reports")},
        "channels": channels,
    }
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_webhook_channel_with_settings_delivers_the_neutral_notification(
    tmp_path: Path, receiver: Receiver, registered: None
) -> None:
    path = write_config(tmp_path, {"webhook": {"url": receiver.url, "levels": ["P1"], "secret": SECRET}})
    cfg = bot_config.load(path)
    assert cfg.channels["webhook"] == WebhookSettings(url=receiver.url, levels=["P1"], secret=SECRET)
    bot = Bot(cfg)
    bot.receive(webhook(alert("GpuThrottled", severity="P1", instance="gpu-1:9450", job="llm")))
    bot.receive(webhook(alert("NodeDown", severity="P0", instance="gpu-2:9450")))
    bot.drain()
    [(body, signature)] = receiver.posts
    assert body["kind"] == "firing" and body["level"] == "P1"
    assert "GpuThrottled" in str(body["title"]) and "msg_type" not in body  # not a Feishu card
    assert body["facts"]["Where"].startswith("job llm")  # type: ignore[index]
    raw = json.dumps(body, sort_keys=True).encode()
    assert signature == hmac.new(SECRET.encode(), raw, hashlib.sha256).hexdigest()
    assert [line["level"] for line in bot.console()] == ["P0"]  # P0 has no webhook: console


def test_the_channels_settings_are_checked_when_the_configuration_loads(
    tmp_path: Path, registered: None
) -> None:
    with pytest.raises(ConfigError, match=r"channels.webhook.*levels"):
        bot_config.load(write_config(tmp_path, {"webhook": {"url": "http://x", "levels": "P1"}}))
    with pytest.raises(ConfigError, match=r"channels.webhook: key 'retries': unknown key"):
        bot_config.load(write_config(tmp_path, {"webhook": {"url": "http://x", "retries": 3}}))
    with pytest.raises(ConfigError, match=r"no channel with settings named pager"):
        bot_config.load(write_config(tmp_path, {"pager": {}}))


def test_a_channels_secret_never_reaches_the_log(tmp_path: Path, registered: None) -> None:
    secret = f"log-only-{tmp_path.name}"
    assert secret in redact(f"posting with {secret}")  # not known as a secret before it is configured
    bot_config.load(write_config(tmp_path, {"webhook": {"url": "http://x", "secret": secret}}))
    assert secret not in redact(f"posting with {secret}")


def test_the_helm_chart_allows_a_channels_settings() -> None:
    schema = json.loads((ROOT / "helm" / "megatrace" / "values.schema.json").read_text())
    values = yaml.safe_load((ROOT / "helm" / "megatrace" / "values.yaml").read_text())
    values["alertbot"]["config"] = {  # the bot's configuration, as the chart passes it through
        "channels": {"webhook": {"url": "https://hooks.example/x", "levels": ["P1"]}}
    }
    jsonschema.validate(values, schema)
