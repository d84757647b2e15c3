"""Channels as a table: routing and delivery go through `CHANNELS` only, so a channel registered there
(here a generic webhook defined by the test) is routed to and sent through with nothing else changed;
card updates stored by an older version are carried over to the table's app channel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatrace.alertbot.channels import CHANNELS, Context, FeishuCardChannel, routes
from megatrace.alertbot.config import AlertbotConfig
from megatrace.alertbot.feishu import SendResult
from megatrace.alertbot.store import MIGRATIONS, sqlite_store
from megatrace.alertbot.store import database as database_module
from tests.alertbot.conftest import Bot, alert, config, webhook


class RecordingWebhook(FeishuCardChannel):
    """A channel as a new module would add one: routed for P1, edits nothing, records what it sends."""

    name = "webhook"

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def destinations(self, cfg: AlertbotConfig, level: str) -> list[str]:
        return ["https://hooks.example/megatrace"] if level == "P1" else []

    def send(self, ctx: Context, row: Any, message: dict[str, Any]) -> SendResult:
        self.sent.append((row.kind, message))
        return SendResult("sent", "ok", data={"message_id": f"wh-{len(self.sent)}"})


def test_a_registered_channel_is_routed_and_sent_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = RecordingWebhook()
    monkeypatch.setitem(CHANNELS, hook.name, hook)
    cfg = config(tmp_path)
    assert routes(cfg, "P1") == [("webhook", "https://hooks.example/megatrace")]
    assert routes(cfg, "P0") == [("console", "P0")]  # no channel for P0: the console
    assert routes(cfg, "P3") == []  # report only
    bot = Bot(cfg)
    bot.receive(webhook(alert("GpuThrottled", severity="P1", instance="gpu-1:9450")))
    bot.drain()
    assert [(kind, message["msg_type"]) for kind, message in hook.sent] == [("firing", "interactive")]
    assert "GpuThrottled" in hook.sent[0][1]["card"]["header"]["title"]["content"]
    assert bot.console() == []


def test_card_updates_of_an_older_version_move_to_the_app_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "old.db"
    with monkeypatch.context() as older:
        older.setattr(database_module, "MIGRATIONS", MIGRATIONS[:3])
        old = sqlite_store(path)
    columns = "kind, channel, destination, level, state, idem_key, created_at, not_before, message_id"
    old.db.run(
        f"INSERT INTO outbox ({columns}) VALUES ('firing', 'app', 'oc_p0', 'P0', 'sent', 'k1', 0, 0, 'om_7')"
    )
    old.db.run(
        f"INSERT INTO outbox ({columns}) "
        "VALUES ('card-update', 'app-update', 'om_7', 'P0', 'pending', 'k2', 0, 0, NULL)"
    )
    old.close()
    store = sqlite_store(path)
    assert store.db.schema_version() == len(MIGRATIONS)
    update = store.db.query("SELECT * FROM outbox WHERE idem_key = 'k2'")[0]
    assert (update["channel"], update["destination"], update["parent_id"]) == ("app", "oc_p0", 1)
