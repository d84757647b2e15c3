"""Sliding-window rate limits, counted as Feishu counts them: in the process, and in the database
shared by replicas (SQLite and a real PostgreSQL), where two replicas together stay under Feishu's
per-chat limit as the stand-in counts it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import requests

from megatrace.alertbot.ratelimit import Limiter, RateLimiter, SharedRateLimiter
from megatrace.alertbot.service import Service
from megatrace.alertbot.store import Store, open_store
from tests.alertbot.conftest import TOKEN, alert, config, webhook
from tests.support.feishu_server import FeishuServer

FIVE_PER_SECOND = [("bot", 5.0, 1.0)]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(params=["process", "sqlite", "postgresql"])
def limiter(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Limiter]:
    if request.param == "process":
        yield RateLimiter()
        return
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else ""
    store: Store = open_store(url, tmp_path / "bot.db")
    try:
        yield SharedRateLimiter(store)
    finally:
        store.close()


def test_a_full_window_makes_the_next_request_wait(limiter: Limiter) -> None:
    assert [limiter.acquire(FIVE_PER_SECOND, 10.0 + i / 10) for i in range(5)] == [0.0] * 5
    assert limiter.acquire(FIVE_PER_SECOND, 10.5) == 0.5
    assert limiter.acquire(FIVE_PER_SECOND, 11.0) == 0.0


def test_a_request_that_finished_late_counts_from_when_it_finished(limiter: Limiter) -> None:
    """Feishu counts a request when it arrives: one slowed on its way counts later than its slot."""
    assert limiter.acquire(FIVE_PER_SECOND, 10.0) == 0.0
    limiter.settle(FIVE_PER_SECOND, 10.0, 10.6)
    for i in range(1, 5):
        assert limiter.acquire(FIVE_PER_SECOND, 10.6 + i / 10) == 0.0
        limiter.settle(FIVE_PER_SECOND, 10.6 + i / 10, 10.6 + i / 10)
    assert abs(limiter.acquire(FIVE_PER_SECOND, 11.2) - 0.4) < 1e-9  # not free at 11.0, as the slot was
    assert limiter.acquire(FIVE_PER_SECOND, 11.6) == 0.0


def test_settle_of_an_unknown_request_changes_nothing(limiter: Limiter) -> None:
    limiter.settle(FIVE_PER_SECOND, 3.0, 4.0)
    assert limiter.acquire(FIVE_PER_SECOND, 3.0) == 0.0
    limiter.settle(FIVE_PER_SECOND, 2.0, 9.0)
    assert [limiter.acquire(FIVE_PER_SECOND, 3.0) for _ in range(5)] == [0.0] * 4 + [1.0]


def busiest_second(times: list[float]) -> int:
    """The most requests in any window of one second."""
    times = sorted(times)
    return max((sum(1 for t in times[i:] if t - start < 1.0) for i, start in enumerate(times)), default=0)


@pytest.mark.slow
def test_two_replicas_together_stay_under_the_per_chat_limit(
    tmp_path: Path, pg_url: str, feishu: FeishuServer
) -> None:
    """Each replica alone keeps 5/s per chat; without shared windows the two together send 10/s."""
    bots = []
    for name in ("a", "b"):
        cfg = config(
            tmp_path / name,
            store={"url": pg_url, "lease_s": 7},
            dedupe={"storm_threshold": 0},
            feishu={
                "base_url": feishu.url,
                "timeout_s": 2,
                "app": {"app_id": feishu.app_id, "app_secret": feishu.app_secret, "chats": {"P2": "oc_p2"}},
            },
        )
        bots.append(Service(cfg))
    alerts = 40
    try:
        for bot in bots:
            bot.start()
        for first in range(0, alerts, 10):
            body = json.dumps(
                webhook(*[alert("XidOther", severity="P2", rank=str(r)) for r in range(first, first + 10)])
            )
            for bot in bots:  # as an Alertmanager HA pair sends every group to every replica
                url = f"http://127.0.0.1:{bot.port}/alertmanager"
                answer = requests.post(url, data=body, headers=AUTH, timeout=20)
                assert answer.status_code == 200
        feishu.wait_for(lambda: len(feishu.messages("oc_p2")) >= alerts, timeout=120)
    finally:
        for bot in bots:
            bot.stop()
    with psycopg.connect(pg_url) as db:
        senders = dict(db.execute("SELECT lease_owner, COUNT(*) FROM outbox GROUP BY lease_owner").fetchall())
    assert set(senders) == {bot.replica for bot in bots}, senders  # both replicas sent
    assert len(feishu.messages("oc_p2")) == alerts
    assert busiest_second([m.time for m in feishu.messages("oc_p2")]) <= 5
