"""The bot against bad and hostile input on loopback: every bad request gets a clear 4xx, one bad
alert is quarantined instead of blocking the others, health says when alerts stop moving, bursts of
connections are all accepted, and a failed start says why and leaves nothing behind."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from megatrace.alertbot import alertmanager
from megatrace.alertbot.alertmanager import reconcile
from megatrace.alertbot.service import Service
from tests.alertbot.conftest import TOKEN, Bot, alert, config, wait_until, webhook

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PAST_9999_IN_UTC = "9999-12-31T23:59:59-23:59"
BOT = [sys.executable, "-m", "megatrace.cli", "alertbot"]


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    bot = Service(config(tmp_path, read_timeout_s=1.0, alertmanager={"url": "http://127.0.0.1:9"}))
    bot.start()
    try:
        yield bot
    finally:
        bot.stop()


def post(bot: Service, path: str, body: bytes) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{bot.port}{path}", data=body, headers=AUTH, timeout=20)


def raw_request(bot: Service, head: bytes, body: bytes) -> bytes:
    """Send `head` + `body` on a fresh connection; the status line of the answer."""
    with socket.create_connection(("127.0.0.1", bot.port), timeout=20) as conn:
        conn.sendall(head + body)
        return conn.makefile("rb").readline()


def delivered(bot: Service) -> list[dict]:
    path = Path(bot.cfg.delivery.console_path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_bad_bodies_get_a_clear_4xx_and_what_was_accepted_is_delivered(service: Service) -> None:
    surrogate = json.dumps(webhook(alert(job="llm", rank="1"))).replace('"llm"', '"\\ud800"').encode()
    long_number = json.dumps(webhook(alert(job="llm"))).replace(
        '"truncatedAlerts": 0', f'"truncatedAlerts": {"9" * 5000}'
    )
    deep_silence = b'{"matchers": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path, body, reason in (
        ("/alertmanager", surrogate, "lone surrogate"),
        ("/alertmanager", long_number.encode(), "not usable JSON"),
        ("/silence", deep_silence, "nested too deeply"),
        ("/alertmanager", json.dumps(webhook({**alert(), "startsAt": PAST_9999_IN_UTC})).encode(), "9999"),
    ):
        answer = post(service, path, body)
        assert answer.status_code == 400, (path, reason)
        assert reason in answer.json()["error"]
    assert service.store.db.query("SELECT COUNT(*) FROM inbox")[0][0] == 0

    good = json.dumps(webhook(alert(job="llm", rank="7"))).encode()
    assert post(service, "/alertmanager", good).status_code == 200
    wait_until(lambda: delivered(service), what="console delivery")
    assert [line["channel"] for line in delivered(service)] == ["console"]
    assert service.store.outbox.dead_letters() == []


def test_content_length_must_be_plain_digits_and_slow_bodies_time_out(service: Service) -> None:
    head = (
        b"POST /alertmanager HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n"
        b"Content-Type: application/json\r\n"
    )
    assert b" 400 " in raw_request(service, head + b"Content-Length: 2_0\r\n\r\n", b"{}")
    assert b" 400 " in raw_request(service, head + b"Content-Length: +20\r\n\r\n", b"{}")
    assert b" 408 " in raw_request(service, head + b"Content-Length: 100\r\n\r\n", b'{"version"')
    assert requests.get(f"http://127.0.0.1:{service.port}/healthz", timeout=20).status_code == 200


def test_an_alert_a_stored_body_cannot_process_is_quarantined_not_a_blocker(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        feishu={
            "base_url": "http://127.0.0.1:9",
            "app": {"app_id": "cli_test", "app_secret": "app-secret-for-tests"},
            "sheet": {"spreadsheet_token": "shtTest", "sheet_id": "s1"},
        },
    )
    bot = Bot(cfg)
    bad = {**alert(job="llm", rank="1"), "startsAt": PAST_9999_IN_UTC}
    # stored by a version that accepted it; this one must set it aside and process the rest
    bot.store.inbox.add("webhook", json.dumps(webhook(bad, alert(job="llm", rank="2"))), time.time())
    bot.receive(webhook(alert(job="llm", rank="3")))

    (kept,) = bot.store.inbox.quarantined()
    assert "startsAt" in kept.reason and json.loads(kept.alert)["startsAt"] == PAST_9999_IN_UTC
    ranks = {json.loads(row["labels"])["rank"] for row in bot.store.db.query("SELECT labels FROM episodes")}
    assert ranks == {"2", "3"}
    assert bot.store.inbox.unprocessed() == []
    assert bot.metrics.quarantined._value.get() == 1
    bot.store.close()

    again = Bot(cfg)  # a restart neither loses the quarantine nor processes it again
    assert again.store.inbox.unprocessed() == [] and again.store.inbox.quarantine_count() == 1
    again.store.close()


def test_an_alert_whose_processing_fails_is_undone_alone_and_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bot = Bot(config(tmp_path))
    firing = bot.pipeline._firing

    def poisoned(item, external_url, now) -> None:
        firing(item, external_url, now)
        if item.labels.get("rank") == "1":
            raise ValueError("cannot render this alert")

    monkeypatch.setattr(bot.pipeline, "_firing", poisoned)
    bot.receive(webhook(alert(job="llm", rank="1"), alert(job="llm", rank="2")))
    ranks = [json.loads(row["labels"])["rank"] for row in bot.store.db.query("SELECT labels FROM episodes")]
    assert ranks == ["2"]
    assert [row.reason for row in bot.store.inbox.quarantined()] == [
        "processing failed: ValueError: cannot render this alert"
    ]
    bot.drain()
    assert len(bot.console()) == 1


def test_reconciliation_quarantines_an_episode_it_cannot_write_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bot = Bot(config(tmp_path))
    bot.receive(webhook(alert(job="llm", rank="1")), now=1_790_000_100.0)
    bad_start = 253_402_387_139.0  # 9999-12-31T23:59:59-23:59, as an older version stored it
    bot.store.db.run("UPDATE episodes SET starts_at = ?", (bad_start,))
    bot.receive(webhook(alert(job="llm", rank="2")), now=1_790_000_100.0)
    monkeypatch.setattr(alertmanager, "fetch_alerts", lambda cfg: [])
    seen: list[str] = []
    am = bot.cfg.alertmanager
    am.url, am.resolve_grace_s = "http://alertmanager.example:9093", 0.0

    assert reconcile(bot.store, am, 1_790_000_200.0, lambda *args: seen.append(args[2])) == (0, 1)
    assert [row["status"] for row in bot.store.db.query("SELECT status FROM episodes ORDER BY id")] == [
        "quarantined",
        "firing",
    ]
    assert len(seen) == 1 and "cannot be resolved" in seen[0]
    assert bot.pipeline.process_inbox(1_790_000_200.0) == 1
    assert reconcile(bot.store, am, 1_790_000_300.0, lambda *args: seen.append(args[2])) == (0, 0)
    assert len(seen) == 1


def test_health_fails_when_alerts_stop_moving(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    def stuck(*args, **kwargs) -> None:
        raise RuntimeError("delivery cannot run")

    health = f"http://127.0.0.1:{service.port}/healthz"
    assert requests.get(health, timeout=20).status_code == 200
    monkeypatch.setattr(service.delivery, "deliver_due", stuck)
    service.stall_after_s = 0.5
    wait_until(lambda: requests.get(health, timeout=20).status_code == 503, what="health 503")
    assert requests.get(health, timeout=20).json()["status"] == "worker stuck"


def test_a_burst_of_a_thousand_connections_is_accepted_and_answered(tmp_path: Path) -> None:
    bot = Service(config(tmp_path))  # bound, not yet accepting: the kernel's backlog holds them all
    clients = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(1000)]
    try:
        for client in clients:
            client.setblocking(False)
            assert client.connect_ex(("127.0.0.1", bot.port)) in (0, 115)  # EINPROGRESS
        pending = set(clients)
        deadline = time.monotonic() + 10
        # epoll, not select(): a test process may already hold enough descriptors that these pass 1024
        with selectors.DefaultSelector() as waiting:
            for client in clients:
                waiting.register(client, selectors.EVENT_WRITE)
            while pending and time.monotonic() < deadline:
                for key, _events in waiting.select(0.5):
                    if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        pending.discard(key.fileobj)
                        waiting.unregister(key.fileobj)
        assert not pending, f"{len(pending)} of 1000 connections not established"
        bot.start()
        for client in clients:
            client.setblocking(True)
            client.settimeout(60)
            client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answered = sum(client.makefile("rb").readline().startswith(b"HTTP/1.1 200") for client in clients)
        assert answered == 1000
    finally:
        for client in clients:
            client.close()
        bot.stop()


def write_config(tmp_path: Path, **values: object) -> Path:
    path = tmp_path / "bot.yaml"
    path.write_text(yaml.safe_dump({"auth": {"bearer_token": TOKEN}, **values}))
    return path


def test_a_busy_port_is_named_and_a_failed_start_leaves_no_database(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = write_config(tmp_path, listen=f"127.0.0.1:{port}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRACE_")}
        result = subprocess.run(
            [*BOT, "--config", str(cfg)], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env
        )
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in result.stderr and "in use" in result.stderr
    assert "Traceback" not in result.stderr and "Errno" not in result.stderr
    assert not (tmp_path / "alertbot.db").exists()


def test_report_without_a_config_asks_for_the_database_not_for_credentials(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRACE_")}
    result = subprocess.run(
        [*BOT, "report", "--since", "2026-11-09", "--until", "2026-11-16"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1
    assert "bearer_token" not in result.stderr
    assert "alertbot.db" in result.stderr and "store.path" in result.stderr


def big_group(count: int, description_bytes: int) -> bytes:
    """One Alertmanager group of `count` alerts with long descriptions, as one webhook body."""
    alerts = [alert("MegatraceNodeDown", instance=f"gpu-{i}:9450") for i in range(count)]
    for item in alerts:
        item["annotations"]["description"] = "x" * description_bytes
    body = webhook(*alerts) | {"groupKey": '{}:{alertname="MegatraceNodeDown"}'}
    return json.dumps(body).encode()


def test_a_group_of_1100_alerts_with_8_kb_descriptions_is_taken(service: Service) -> None:
    body = big_group(1100, 8 * 1024)
    assert len(body) > 9_000_000
    answer = post(service, "/alertmanager", body)
    assert answer.status_code == 200 and answer.json() == {"status": "stored", "alerts": 1100}


def test_a_refused_body_is_counted_and_logged_with_its_group_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bot = Service(config(tmp_path, max_body_bytes=100_000))
    bot.start()
    try:
        assert post(bot, "/alertmanager", big_group(20, 8 * 1024)).status_code == 413
        metrics = requests.get(f"http://127.0.0.1:{bot.port}/metrics", timeout=20).text
    finally:
        bot.stop()
    assert 'megatrace_alertbot_webhooks_total{outcome="too_large"} 1.0' in metrics
    [record] = [r for r in caplog.records if "max_body_bytes" in r.getMessage()]
    assert record.levelname == "ERROR"
    assert '{}:{alertname=\\"MegatraceNodeDown\\"}' in record.getMessage()
    assert "lost unless alertmanager.url is set" in record.getMessage()
    assert any("reconciliation is off" in r.getMessage() for r in caplog.records)
