"""The running bot: HTTP intake (auth, malformed bodies), health and metrics, a real Alertmanager
routing to it, reconciliation through Alertmanager's API, silences, and kill -9 mid-delivery."""

from __future__ import annotations

import base64
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from megatrace.alertbot.payload import format_time
from megatrace.alertbot.service import Service
from tests.alertbot.conftest import TOKEN, alert, config, wait_until, webhook
from tests.support.feishu_server import FeishuServer
from tests.support.services import alertmanager_argv, free_port, running

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    bot = Service(config(tmp_path))
    bot.start()
    try:
        yield bot
    finally:
        bot.stop()


def url(bot: Service, path: str) -> str:
    return f"http://127.0.0.1:{bot.port}{path}"


def console_lines(bot_cfg_path: Path) -> list[dict]:
    return [json.loads(x) for x in bot_cfg_path.read_text().splitlines()] if bot_cfg_path.exists() else []


def test_webhook_needs_credentials(service: Service) -> None:
    body = json.dumps(webhook(alert(job="llm")))
    assert requests.post(url(service, "/alertmanager"), data=body, timeout=5).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert (
        requests.post(url(service, "/alertmanager"), data=body, headers=wrong, timeout=5).status_code == 401
    )
    answer = requests.post(url(service, "/alertmanager"), data=body, headers=AUTH, timeout=5)
    assert answer.status_code == 200 and answer.json() == {"status": "stored", "alerts": 1}


def test_basic_auth(tmp_path: Path) -> None:
    bot = Service(
        config(tmp_path, auth={"bearer_token": "", "basic_user": "am", "basic_password": "pw-1234"})
    )
    bot.start()
    try:
        body = json.dumps(webhook(alert(job="llm")))
        good = {"Authorization": "Basic " + base64.b64encode(b"am:pw-1234").decode()}
        bad = {"Authorization": "Basic " + base64.b64encode(b"am:pw-12345").decode()}
        assert requests.post(url(bot, "/alertmanager"), data=body, headers=bad, timeout=5).status_code == 401
        assert requests.post(url(bot, "/alertmanager"), data=body, headers=good, timeout=5).status_code == 200
    finally:
        bot.stop()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "body is not valid JSON"),
        (b"[]", "expected a JSON object"),
        (json.dumps({**webhook(alert()), "version": "3"}).encode(), 'version: expected "4"'),
        (json.dumps({**webhook(alert()), "alerts": []}).encode(), "alerts: expected a non-empty list"),
        (json.dumps(webhook({**alert(), "status": "pending"})).encode(), "alerts[0].status"),
        (json.dumps(webhook({**alert(), "startsAt": "yesterday"})).encode(), "alerts[0].startsAt"),
        (json.dumps(webhook({**alert(), "fingerprint": "../../etc"})).encode(), "alerts[0].fingerprint"),
        (json.dumps(webhook({**alert(), "labels": {"severity": "P0"}})).encode(), "'alertname' is missing"),
        (json.dumps(webhook({**alert(), "labels": {"alertname": 7}})).encode(), "alerts[0].labels.alertname"),
        (b"\xff\xfe", "body is not UTF-8 JSON"),
        (json.dumps(webhook(alert())).encode("utf-16"), "body is not UTF-8 JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_malformed_bodies_get_400_with_reason(service: Service, body: bytes, reason: str) -> None:
    answer = requests.post(url(service, "/alertmanager"), data=body, headers=AUTH, timeout=5)
    assert answer.status_code == 400
    assert reason in answer.json()["error"]
    assert service.store.db.query("SELECT COUNT(*) FROM inbox")[0][0] == 0
    assert requests.get(url(service, "/healthz"), timeout=5).status_code == 200


def test_oversized_body_and_unknown_paths(tmp_path: Path) -> None:
    bot = Service(config(tmp_path, max_body_bytes=1000))
    bot.start()
    try:
        big = json.dumps(webhook(*[alert(job="llm", rank=str(r)) for r in range(20)]))
        assert requests.post(url(bot, "/alertmanager"), data=big, headers=AUTH, timeout=5).status_code == 413
        assert requests.get(url(bot, "/nope"), timeout=5).status_code == 404
        assert requests.post(url(bot, "/nope"), data=b"{}", headers=AUTH, timeout=5).status_code == 404
    finally:
        bot.stop()


def test_health_metrics_and_console_delivery(service: Service) -> None:
    body = json.dumps(webhook(alert(job="llm", rank="4")))
    for _ in range(2):
        assert requests.post(url(service, "/alertmanager"), data=body, headers=AUTH, timeout=5).ok
    console = Path(service.cfg.delivery.console_path)
    wait_until(
        lambda: not service.store.inbox.unprocessed() and not service.store.outbox.queue_depth(),
        what="console delivery",
    )
    (line,) = console_lines(console)
    assert line["channel"] == "console" and line["msg_type"] == "interactive"
    assert line["card"]["header"]["title"]["content"].startswith("[P0] FIRING")
    health = requests.get(url(service, "/healthz"), timeout=5)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "queue": 0, "dead": 0, "quarantined": 0}
    metrics = requests.get(url(service, "/metrics"), timeout=5).text
    assert "megatrace_alertbot_alerts_received_total 2.0" in metrics
    assert "megatrace_alertbot_alerts_deduplicated_total 1.0" in metrics
    assert 'megatrace_alertbot_notifications_sent_total{channel="console"} 1.0' in metrics
    assert 'megatrace_alertbot_webhooks_total{outcome="accepted"} 2.0' in metrics
    assert "megatrace_alertbot_queue_depth 0.0" in metrics
    assert 'megatrace_alertbot_delivery_latency_seconds_count{channel="console"} 1.0' in metrics


def write_alertmanager(tmp_path: Path, webhook_url: str) -> Path:
    cfg = {
        "route": {
            "receiver": "megatrace",
            "group_by": ["alertname", "job", "rank"],
            "group_wait": "1s",
            "group_interval": "1s",
            "repeat_interval": "1h",
        },
        "receivers": [
            {
                "name": "megatrace",
                "webhook_configs": [
                    {
                        "url": webhook_url,
                        "send_resolved": True,
                        "http_config": {"authorization": {"type": "Bearer", "credentials": TOKEN}},
                    }
                ],
            }
        ],
    }
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def alertmanager_for(tmp_path: Path):
    """Start a real Alertmanager whose webhook points at the given URL; yields its base URL."""

    def start(webhook_url: str):
        port = free_port()
        argv = alertmanager_argv(write_alertmanager(tmp_path, webhook_url), tmp_path / "am-data", port)
        return running(
            argv, f"http://127.0.0.1:{port}/-/ready", tmp_path / "am.log"
        ), f"http://127.0.0.1:{port}"

    return start


def post_to_alertmanager(am: str, labels: dict[str, str], ends_at: float | None = None) -> None:
    item = {
        "labels": labels,
        "annotations": {
            "summary": f"{labels['alertname']} rank {labels.get('rank')}",
            "runbook_url": "https://rb",
        },
        "generatorURL": "http://prometheus.example/graph",
    }
    if ends_at is not None:
        item["endsAt"] = format_time(ends_at)
    requests.post(f"{am}/api/v2/alerts", json=[item], timeout=5).raise_for_status()


@pytest.mark.slow
def test_real_alertmanager_routes_firing_and_resolved_to_feishu(
    tmp_path: Path, feishu: FeishuServer, alertmanager_for
) -> None:
    hook = feishu.add_bot(secret="group-secret")
    bot_port = free_port()
    context, am = alertmanager_for(f"http://127.0.0.1:{bot_port}/alertmanager")
    with context:
        bot = Service(
            config(
                tmp_path,
                listen=f"127.0.0.1:{bot_port}",
                feishu={
                    "base_url": feishu.url,
                    "group_bots": {"P1": {"webhook": hook, "secret": "group-secret"}},
                },
                # reconciliation runs alongside the webhooks and must not add anything
                alertmanager={"url": am, "reconcile_interval_s": 0.3, "resolve_grace_s": 0.3},
            )
        )
        bot.start()
        try:
            labels = [
                {"alertname": "MegatraceSlowRank", "severity": "P1", "job": f"llm-{r}", "rank": str(r)}
                for r in (2, 6)
            ]
            for item in labels:
                post_to_alertmanager(am, item)
            feishu.wait_for(lambda: len(feishu.bot_posts(hook)) == 2)
            titles = sorted(p.body["card"]["header"]["title"]["content"] for p in feishu.bot_posts(hook))
            assert titles == [
                "[P1] FIRING: rank 2 is slow — job llm-2",
                "[P1] FIRING: rank 6 is slow — job llm-6",
            ]
            post_to_alertmanager(am, labels[0], ends_at=time.time() - 1)
            feishu.wait_for(lambda: len(feishu.bot_posts(hook)) == 3)
            resolved = feishu.bot_posts(hook)[2].body["card"]
            assert resolved["header"]["template"] == "green"
            assert resolved["header"]["title"]["content"] == "[P1] RESOLVED: rank 2 is slow — job llm-2"
            time.sleep(1.5)  # several reconciliation rounds
            assert len(feishu.bot_posts(hook)) == 3 and feishu.rejections == []
            episodes = bot.store.db.query("SELECT status FROM episodes ORDER BY id")
            assert sorted(e["status"] for e in episodes) == ["firing", "resolved"]
        finally:
            bot.stop()


@pytest.mark.slow
def test_reconciliation_catches_missed_webhooks_and_silences_work(tmp_path: Path, alertmanager_for) -> None:
    dead_end = f"http://127.0.0.1:{free_port()}/alertmanager"  # webhooks get lost
    context, am = alertmanager_for(dead_end)
    with context:
        bot = Service(
            config(
                tmp_path,
                alertmanager={
                    "url": am,
                    "receiver": "megatrace",
                    "reconcile_interval_s": 0.5,
                    "resolve_grace_s": 0.5,
                },
            )
        )
        bot.start()
        try:
            hang = {"alertname": "MegatraceRankHang", "severity": "P0", "job": "llm", "rank": "3"}
            post_to_alertmanager(am, hang)
            console = Path(bot.cfg.delivery.console_path)
            wait_until(lambda: len(console_lines(console)) == 1, what="reconciled firing")
            post_to_alertmanager(am, hang, ends_at=time.time() - 1)
            wait_until(lambda: len(console_lines(console)) == 2, what="reconciled resolve")
            assert console_lines(console)[1]["card"]["header"]["title"]["content"].startswith("[P0] RESOLVED")
            sources = [r["source"] for r in bot.store.db.query("SELECT source FROM inbox")]
            assert set(sources) == {"reconcile"}

            request = {
                "matchers": {"alertname": "MegatraceRankHang", "job": "llm"},
                "duration": "2h",
                "comment": "fixing",
            }
            assert requests.post(url(bot, "/silence"), json=request, timeout=5).status_code == 401
            made = requests.post(url(bot, "/silence"), json=request, headers=AUTH, timeout=5)
            assert made.status_code == 200
            silence = requests.get(f"{am}/api/v2/silence/{made.json()['silenceID']}", timeout=5).json()
            assert silence["status"]["state"] == "active" and silence["comment"] == "fixing"
            assert {(m["name"], m["value"]) for m in silence["matchers"]} == {
                ("alertname", "MegatraceRankHang"),
                ("job", "llm"),
            }
            bad = requests.post(
                url(bot, "/silence"), json={**request, "duration": "forever"}, headers=AUTH, timeout=5
            )
            assert bad.status_code == 400 and "duration" in bad.json()["error"]
        finally:
            bot.stop()


@pytest.mark.slow
def test_kill_9_mid_delivery_loses_nothing_and_posts_nothing_twice(
    tmp_path: Path, feishu: FeishuServer
) -> None:
    hook = feishu.add_bot(secret="group-secret", chat_id="oc_p1_group")
    port = free_port()
    cfg = {
        "listen": f"127.0.0.1:{port}",
        "auth": {"bearer_token": TOKEN},
        "store": {"path": str(tmp_path / "bot.db")},
        "dedupe": {"storm_threshold": 0},
        "feishu": {
            "base_url": feishu.url,
            "group_bots": {"P1": {"webhook": hook, "secret": "group-secret", "chat_id": "oc_p1_group"}},
            "app": {"app_id": feishu.app_id, "app_secret": feishu.app_secret, "chats": {"P0": "oc_p0_group"}},
        },
    }
    path = tmp_path / "bot.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "megatrace.cli", "alertbot", "--config", str(path)]
    ready = f"http://127.0.0.1:{port}/healthz"
    feishu.response_delay = 1.5  # every send is slow: the kill lands while requests are in flight
    # one job each: a job's alerts would share one incident card
    alerts = [alert("MegatraceSlowRank", severity="P1", job=f"slow-{r}", rank=str(r)) for r in range(4)]
    alerts += [alert("MegatraceRankHang", severity="P0", job=f"hang-{r}", rank=str(r)) for r in range(4)]
    with running(argv, ready, tmp_path / "bot-1.log") as first:
        for item in alerts:
            answer = requests.post(
                f"http://127.0.0.1:{port}/alertmanager", json=webhook(item), headers=AUTH, timeout=5
            )
            assert answer.status_code == 200
        feishu.wait_for(lambda: len(feishu.bot_posts()) >= 1 and len(feishu.messages()) >= 1)
        first.kill()  # SIGKILL: no cleanup, sends in flight
        first.wait()
    before = len(feishu.bot_posts()) + len(feishu.messages())
    assert before < 8  # the kill really interrupted the delivery
    feishu.response_delay = 0.0
    with running(argv, ready, tmp_path / "bot-2.log"):
        feishu.wait_for(lambda: len(feishu.bot_posts()) + len(feishu.messages()) >= 8, timeout=60)
        time.sleep(1.0)  # anything extra would have arrived by now
    refs = [p.body["card"]["elements"][-1]["elements"][0]["content"] for p in feishu.bot_posts()]
    refs += [m.body["content"]["elements"][-1]["elements"][0]["content"] for m in feishu.messages()]
    assert len(refs) == 8 and len(set(refs)) == 8
    bot_text = sorted(p.body["card"]["elements"][0]["text"]["content"] for p in feishu.bot_posts())
    assert [t.split("**Where**: ")[1].split("\n")[0] for t in bot_text] == [f"job slow-{r}" for r in range(4)]
    app_text = sorted(m.body["content"]["elements"][0]["text"]["content"] for m in feishu.messages())
    assert [t.split("**Where**: ")[1].split("\n")[0] for t in app_text] == [f"job hang-{r}" for r in range(4)]
    log = (tmp_path / "bot-2.log").read_text()
    assert "recovered" in log


def test_scheduler_job_runs_do_not_flood_the_log_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    unreachable = f"http://127.0.0.1:{free_port()}"
    bot = Service(config(tmp_path, alertmanager={"url": unreachable, "reconcile_interval_s": 0.2}))
    bot.start()
    try:
        failed = "reconciliation failed"
        wait_until(lambda: caplog.text.count(failed) >= 3, what="three reconciliation runs")
    finally:
        bot.stop()
    assert "alert bot listening on" in caplog.text  # the bot's own INFO lines are kept
    scheduler_lines = [r.getMessage() for r in caplog.records if r.name.startswith("apscheduler")]
    assert scheduler_lines == []
    assert "Running job" not in caplog.text and "executed successfully" not in caplog.text
