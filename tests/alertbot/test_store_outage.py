"""A store that fails does not stop the bot: the worker survives any exception, readiness (not
liveness) goes down while the database is gone, the webhook answers 503 so Alertmanager retries, and
once the database is back every alert is delivered exactly once without a restart."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from megatrace.alertbot.service import Service
from tests.alertbot.conftest import TOKEN, alert, config, wait_until, webhook
from tests.support.feishu_server import FeishuServer
from tests.support.postgres import PostgresServer, running_postgres

AUTH = {"Authorization": f"Bearer {TOKEN}"}
BURST = 500
PER_WEBHOOK = 10


def get(bot: Service, path: str) -> requests.Response:
    return requests.get(f"http://127.0.0.1:{bot.port}{path}", timeout=20)


def workers_alive(bot: Service) -> bool:
    return all(thread.is_alive() for thread in bot._threads)


def test_the_worker_survives_a_store_failure_between_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bot = Service(config(tmp_path))
    failures = iter(range(3))
    next_due = bot.store.outbox.next_due

    def flaky() -> float | None:
        if next(failures, None) is not None:
            raise sqlite3.OperationalError("database is locked")
        return next_due()

    monkeypatch.setattr(bot.store.outbox, "next_due", flaky)
    bot.start()
    try:
        body = json.dumps(webhook(alert(job="llm", rank="1")))
        post = requests.post(f"http://127.0.0.1:{bot.port}/alertmanager", data=body, headers=AUTH, timeout=20)
        assert post.status_code == 200
        wait_until(lambda: Path(bot.cfg.delivery.console_path).exists(), what="the alert delivered")
        assert workers_alive(bot)
        assert get(bot, "/readyz").status_code == 200
    finally:
        bot.stop()


def test_a_worker_failing_for_another_reason_fails_liveness_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bot = Service(config(tmp_path))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug, not the database")

    monkeypatch.setattr(bot.delivery, "deliver_due", broken)
    bot.stall_after_s = 0.5
    bot.start()
    try:
        wait_until(lambda: get(bot, "/readyz").status_code == 503, what="readiness down")
        assert get(bot, "/readyz").json()["error"] == "RuntimeError"
        wait_until(lambda: get(bot, "/healthz").status_code == 503, what="liveness down")
        assert get(bot, "/healthz").json()["status"] == "worker stuck"
        assert workers_alive(bot)
    finally:
        bot.stop()


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A server of this test's own: it is stopped and started again mid-test."""
    with running_postgres() as server:
        yield server


def numbered(rank: int) -> dict:
    item = alert("MegatraceGpuXidOther", severity="P2", rank=str(rank))
    item["annotations"]["summary"] = f"rank {rank}"  # the card's title ends with it
    return item


def send_burst(bot_url: str, ranks: range, answers: list[int], stop: threading.Event) -> None:
    """Post alerts `ranks` in webhooks of PER_WEBHOOK, each retried on 5xx as Alertmanager does."""
    for first in range(ranks.start, ranks.stop, PER_WEBHOOK):
        body = json.dumps(webhook(*[numbered(r) for r in range(first, first + PER_WEBHOOK)]))
        while not stop.is_set():
            try:
                status = requests.post(bot_url, data=body, headers=AUTH, timeout=20).status_code
            except requests.ConnectionError:
                status = 0
            answers.append(status)
            if status == 200:
                break
            time.sleep(0.2)
        time.sleep(0.05)


@pytest.mark.slow
def test_a_postgresql_outage_fails_readiness_only_and_loses_nothing(
    tmp_path: Path, own_postgres: PostgresServer, feishu: FeishuServer
) -> None:
    """One replica, in process; tests/cluster/test_store_outage.py runs 15 s and 120 s outages
    against the Alertmanager pair and two replicas."""
    outage_s = 15
    cfg = config(
        tmp_path,
        store={"url": own_postgres.database(), "lease_s": 7},
        dedupe={"storm_threshold": 0},
        delivery={"chat_per_second": 1000, "app_per_second": 1000, "app_per_minute": 100000},
        feishu={
            "base_url": feishu.url,
            "timeout_s": 2,
            "app": {"app_id": feishu.app_id, "app_secret": feishu.app_secret, "chats": {"P2": "oc_p2"}},
        },
    )
    bot = Service(cfg)
    bot.start()
    answers: list[int] = []
    stop = threading.Event()
    hook = f"http://127.0.0.1:{bot.port}/alertmanager"
    # The first half is stored before the outage, the second half is sent during it.
    sender = threading.Thread(target=send_burst, args=(hook, range(BURST // 2, BURST), answers, stop))
    try:
        send_burst(hook, range(BURST // 2), answers, stop)
        wait_until(lambda: len(feishu.messages("oc_p2")) >= 50, timeout=120, what="delivery under way")
        own_postgres.halt()
        sender.start()
        down_since = time.monotonic()
        wait_until(lambda: get(bot, "/readyz").status_code == 503, what="readiness down")
        assert get(bot, "/readyz").json()["status"] == "store unavailable"
        while time.monotonic() - down_since < outage_s:
            assert get(bot, "/healthz").status_code == 200  # a restart cannot bring the database back
            assert workers_alive(bot)
            time.sleep(1)
        assert 503 in answers  # webhooks sent while it was down were refused, to be retried
        own_postgres.resume()
        wait_until(lambda: get(bot, "/readyz").status_code == 200, timeout=60, what="readiness back")
        sender.join(timeout=240)
        assert not sender.is_alive()
        feishu.wait_for(lambda: len(feishu.messages("oc_p2")) >= BURST, timeout=240)
        time.sleep(2)  # anything sent twice would have arrived by now
    finally:
        stop.set()
        bot.stop()
        if sender.is_alive():
            sender.join()
    titles = [m.body["content"]["header"]["title"]["content"] for m in feishu.messages("oc_p2")]
    ranks = sorted(int(title.rsplit(" ", 1)[-1]) for title in titles)
    assert ranks == list(range(BURST))  # every alert exactly once


def test_liveness_does_not_queue_on_a_store_known_to_be_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While rounds fail on the store, webhook threads queue on it reconnecting: liveness must answer
    from what the worker saw, within the kubelet's timeout, not wait its turn at the store."""
    bot = Service(config(tmp_path))

    def down() -> None:
        raise sqlite3.OperationalError("unable to open database file")

    def hanging() -> int:
        time.sleep(60)
        return 0

    monkeypatch.setattr(bot.delivery, "deliver_due", down)
    bot.start()
    try:
        wait_until(lambda: bot._round_error is not None, what="a round failed on the store")
        monkeypatch.setattr(bot.store.outbox, "queue_depth", hanging)
        answer = requests.get(f"http://127.0.0.1:{bot.port}/healthz", timeout=5)
        assert (answer.status_code, answer.json()["status"]) == (200, "store unavailable")
    finally:
        monkeypatch.undo()
        bot.stop()
