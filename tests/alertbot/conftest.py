"""Shared helpers for the alert bot tests: configurations, Alertmanager-shaped payloads, a fake Feishu."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from megatrace.alertbot.cards import CardRenderer
from megatrace.alertbot.config import AlertbotConfig, check
from megatrace.alertbot.delivery import ConsoleSink, Delivery
from megatrace.alertbot.feishu import FeishuApp
from megatrace.alertbot.metrics import BotMetrics
from megatrace.alertbot.payload import format_time
from megatrace.alertbot.pipeline import Pipeline
from megatrace.alertbot.store import open_store
from megatrace.config import validate
from tests.support.feishu_server import FeishuServer
from tests.support.postgres import PostgresServer, running_postgres

TOKEN = "webhook-token-for-tests"


def config(tmp_path: Path, **sections: Any) -> AlertbotConfig:
    """A checked configuration with a store and console file under `tmp_path`, plus `sections`."""
    data: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "auth": {"bearer_token": TOKEN},
        "store": {"path": str(tmp_path / "bot.db"), "synchronous": "NORMAL"},
        "delivery": {"console_path": str(tmp_path / "console.jsonl"), "backoff_base_s": 0.05},
        "report": {"directory": str(tmp_path / "reports")},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return check(validate(AlertbotConfig, data, "test"), "test")


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout}s")
        time.sleep(0.05)


def fingerprint(labels: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]


def alert(
    name: str = "MegatraceRankHang",
    status: str = "firing",
    starts_at: float = 1_790_000_000.0,
    ends_at: float | None = None,
    severity: str = "P0",
    **labels: str,
) -> dict[str, Any]:
    """One alert as Alertmanager puts it in a webhook."""
    full = {"alertname": name, "severity": severity, **labels}
    return {
        "status": status,
        "labels": full,
        "annotations": {
            "summary": f"{name} on {labels.get('instance', 'the cluster')}",
            "description": "Ranks stopped making progress.",
            "runbook_url": "https://runbooks.example/megatrace",
        },
        "startsAt": format_time(starts_at),
        "endsAt": format_time(ends_at if status == "resolved" else None),
        "generatorURL": "http://prometheus.example:9090/graph?g0.expr=up",
        "fingerprint": fingerprint(full),
    }


def webhook(*alerts: dict[str, Any]) -> dict[str, Any]:
    """An Alertmanager webhook (version 4) carrying `alerts`."""
    firing = any(a["status"] == "firing" for a in alerts)
    return {
        "version": "4",
        "groupKey": '{}:{alertname="MegatraceRankHang"}',
        "truncatedAlerts": 0,
        "status": "firing" if firing else "resolved",
        "receiver": "megatrace",
        "groupLabels": {},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager.example:9093",
        "alerts": list(alerts),
    }


class Bot:
    """The bot's stages wired in-process (no HTTP server, no threads): feed webhooks, run delivery."""

    def __init__(self, cfg: AlertbotConfig) -> None:
        self.cfg = cfg
        self.store = open_store(cfg.store.url, cfg.store.path, cfg.store.synchronous)
        self.metrics = BotMetrics(self.store.outbox.queue_depth)
        self.pipeline = Pipeline(self.store, cfg, [], self.metrics)
        self.renderer = CardRenderer(cfg.templates_dir, cfg.links)
        app = cfg.feishu.app
        self.app = FeishuApp(cfg.feishu.base_url, app.app_id, app.app_secret, 5) if app.app_id else None
        self.delivery = Delivery(
            self.store, cfg, self.renderer, self.metrics, self.app, ConsoleSink(cfg.delivery.console_path)
        )

    def receive(self, body: dict[str, Any], now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.store.inbox.add("webhook", json.dumps(body), now)
        while self.pipeline.process_inbox(now):
            pass

    def drain(self, timeout: float = 20.0) -> None:
        """Deliver until nothing is pending (retries included)."""
        deadline = time.monotonic() + timeout
        while self.store.outbox.queue_depth():
            if time.monotonic() > deadline:
                raise TimeoutError(f"outbox not drained: {[dict(r) for r in self.store.outbox.due(1e12)]}")
            self.delivery.deliver_due()
            time.sleep(0.02)

    def console(self) -> list[dict[str, Any]]:
        path = Path(self.cfg.delivery.console_path)
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def feishu() -> Iterator[FeishuServer]:
    with FeishuServer() as server:
        yield server


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One real PostgreSQL server per test process."""
    with running_postgres() as server:
        yield server


@pytest.fixture
def pg_url(postgres: PostgresServer) -> str:
    """A fresh, empty database on the test PostgreSQL server."""
    return postgres.database()
