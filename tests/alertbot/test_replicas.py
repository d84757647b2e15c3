"""Two bot replicas on one real PostgreSQL, fed by a real Alertmanager that sends every webhook to
both, with ``kill -9`` of either at random moments during a 1,000-alert run: nothing is lost, no card
is sent twice (counted at the Feishu stand-in), and the weekly report is written once."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.alertbot.conftest import TOKEN
from tests.support.feishu_server import FeishuServer
from tests.support.services import alertmanager_argv, free_port, running, wait_http

ALERTS = 1000


def alertmanager_config(path: Path, bot_ports: list[int]) -> Path:
    hooks = [
        {
            "url": f"http://127.0.0.1:{port}/alertmanager",
            "send_resolved": True,
            "http_config": {"authorization": {"type": "Bearer", "credentials": TOKEN}},
        }
        for port in bot_ports
    ]
    route = {
        "receiver": "bots",
        "group_by": ["alertname", "rank"],
        "group_wait": "1s",
        "group_interval": "2s",
    }
    path.write_text(
        yaml.safe_dump({"route": route, "receivers": [{"name": "bots", "webhook_configs": hooks}]})
    )
    return path


def bot_config(tmp_path: Path, name: str, port: int, pg_url: str, feishu: FeishuServer) -> Path:
    cfg = {
        "listen": f"127.0.0.1:{port}",
        "auth": {"bearer_token": TOKEN},
        "store": {"url": pg_url, "lease_s": 7},
        "dedupe": {"storm_threshold": 0},
        "delivery": {"chat_per_second": 1000, "app_per_second": 1000, "app_per_minute": 100000},
        "feishu": {
            "base_url": feishu.url,
            "timeout_s": 2,
            "app": {"app_id": feishu.app_id, "app_secret": feishu.app_secret, "chats": {"P2": "oc_p2"}},
        },
        "report": {"directory": str(tmp_path / name / "reports"), "cron": "* * * * *", "chat": "oc_report"},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_two_replicas_survive_kill_9(tmp_path: Path, pg_url: str, feishu: FeishuServer) -> None:
    ports = [free_port(), free_port()]
    configs = [bot_config(tmp_path, f"r{i}", port, pg_url, feishu) for i, port in enumerate(ports)]
    am_port = free_port()
    am = f"http://127.0.0.1:{am_port}"
    argv = alertmanager_argv(alertmanager_config(tmp_path / "am.yml", ports), tmp_path / "am-data", am_port)
    procs: list[subprocess.Popen | None] = [None, None]
    logs = [open(tmp_path / f"r{i}.log", "ab") for i in range(2)]  # noqa: SIM115 - closed below

    def start(i: int) -> None:
        command = [sys.executable, "-m", "megatrace.cli", "alertbot", "--config", str(configs[i])]
        procs[i] = subprocess.Popen(command, stdout=logs[i], stderr=subprocess.STDOUT)
        wait_http(f"http://127.0.0.1:{ports[i]}/healthz", timeout=60, proc=procs[i])

    kills: list[tuple[int, int]] = []
    stop = threading.Event()

    def chaos() -> None:
        rng = random.Random(19)
        while not stop.is_set() and len(kills) < 6:
            time.sleep(rng.uniform(1.0, 4.0))
            victim = rng.randrange(2)
            proc = procs[victim]
            assert proc is not None
            proc.kill()  # SIGKILL
            proc.wait()
            kills.append((victim, len(feishu.messages())))
            start(victim)

    try:
        with running(argv, f"{am}/-/ready", tmp_path / "am.log"):
            start(0)
            start(1)
            killer = threading.Thread(target=chaos, daemon=True)
            killer.start()
            for first in range(0, ALERTS, 100):
                batch = [
                    {
                        "labels": {"alertname": "MegatraceGpuXidOther", "severity": "P2", "rank": str(r)},
                        "annotations": {"summary": f"rank {r}"},
                    }
                    for r in range(first, first + 100)
                ]
                requests.post(f"{am}/api/v2/alerts", json=batch, timeout=10).raise_for_status()
            feishu.wait_for(lambda: len(feishu.messages("oc_p2")) >= ALERTS, timeout=240)
            stop.set()
            killer.join()
            feishu.wait_for(lambda: len(feishu.select("file")) >= 1, timeout=90)  # cron: every minute
            time.sleep(3)  # anything doubled would arrive by now
    finally:
        stop.set()
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    cards = feishu.messages("oc_p2")
    ranks = [m.body["content"]["header"]["title"]["content"].rsplit(" ", 1)[-1] for m in cards]
    assert len(kills) >= 3, kills
    assert sorted(ranks, key=int) == [str(r) for r in range(ALERTS)]  # each once: none lost, none doubled
    assert len(feishu.select("file")) == 1  # the weekly report, written and sent once
