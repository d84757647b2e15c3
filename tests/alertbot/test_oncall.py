"""On call from the card, through the Feishu stand-in: claim, silence through a real Alertmanager,
notes, the audit, refused callbacks (forged, unsigned, replayed, stale, off the roster), escalation
in compressed time, the rotation, and the long connection through lark-oapi's own client."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openpyxl
import pytest
import requests

from megatrace.alertbot.config import OncallConfig, Person, RotationOverride
from megatrace.alertbot.oncall import rotation
from megatrace.alertbot.service import Service
from tests.alertbot.conftest import TOKEN, config, wait_until
from tests.alertbot.test_service import alertmanager_for, post_to_alertmanager  # noqa: F401
from tests.support.feishu_callbacks import CallbackSender, alert_with_card, card_action_event
from tests.support.feishu_server import FeishuServer
from tests.support.services import free_port

AUTH = {"Authorization": f"Bearer {TOKEN}"}
VERIFY, KEY = "verification-token-for-tests", "encrypt-key-for-tests"
ALICE, BOB, CAROL, MALLORY = "ou_alice", "ou_bob", "ou_carol", "ou_mallory"
ROSTER = [
    {"name": "alice", "open_id": ALICE},
    {"name": "bob", "open_id": BOB},
    {"name": "carol", "open_id": CAROL},
]
WEEK = 7 * 86400


def oncall_config(tmp_path: Path, feishu: FeishuServer, am: str, **callback: Any) -> Any:
    return config(
        tmp_path,
        dedupe={"storm_threshold": 0},
        alertmanager={"url": am},
        feishu={
            "base_url": feishu.url,
            "app": {
                "app_id": feishu.app_id,
                "app_secret": feishu.app_secret,
                "chats": {"P0": "oc_p0", "P1": "oc_p1"},
            },
            "sheet": {"spreadsheet_token": "shtcn_test", "sheet_id": "s1"},
            "callback": {"mode": "request_url", "verification_token": VERIFY, "encrypt_key": KEY, **callback},
        },
        oncall={
            "roster": ROSTER,
            "rotation_start": "2026-01-05T09:00:00+00:00",
            "escalation": {"P0": {"next_after_s": 600}, "P1": {"raise_after_s": 1800}},
        },
    )


@pytest.fixture
def oncall_bot(tmp_path: Path, feishu: FeishuServer, alertmanager_for) -> Iterator[tuple[Service, str]]:  # noqa: F811
    port = free_port()
    context, am = alertmanager_for(f"http://127.0.0.1:{port}/alertmanager")
    with context:
        cfg = oncall_config(tmp_path, feishu, am)
        cfg.listen = f"127.0.0.1:{port}"
        bot = Service(cfg)
        bot.start()
        try:
            yield bot, am
        finally:
            bot.stop()


def fire(bot: Service, am: str, feishu: FeishuServer, labels: dict[str, str]) -> tuple[dict, str]:
    """Post the alert to Alertmanager; wait for its app card, until the bot has recorded the card's
    message id (a click names its card); returns (episode, message id)."""
    before = len(feishu.messages())
    post_to_alertmanager(am, labels)
    feishu.wait_for(lambda: len(feishu.messages()) > before)
    message = feishu.messages()[-1]
    wait_until(lambda: bot.store.outbox.card_episodes(message.message_id), what="the card's send recorded")
    episode = bot.store.db.query("SELECT * FROM episodes ORDER BY id DESC LIMIT 1")[0]
    return dict(episode), message.message_id


def buttons(card: dict) -> list[str]:
    found = [e for e in card["elements"] if e["tag"] == "action"][-1]["actions"]
    return [b["text"]["content"] for b in found if "value" in b]


def updates(feishu: FeishuServer, message_id: str) -> list[dict]:
    return [r.body["card"] for r in feishu.select("update", message_id)]


@pytest.mark.slow
def test_claim_silence_note_through_the_card(oncall_bot, feishu: FeishuServer, tmp_path: Path) -> None:
    bot, am = oncall_bot
    sender = CallbackSender(f"http://127.0.0.1:{bot.port}/feishu/callback", VERIFY, KEY)
    hang = {"alertname": "MegatraceRankHang", "severity": "P0", "job": "llm", "rank": "3"}
    wider = {**hang, "gpu": "1"}  # carries every label of `hang` and one more
    episode, message_id = fire(bot, am, feishu, hang)
    card = feishu.messages()[-1].body["content"]
    assert card["config"]["update_multi"] is True
    assert buttons(card) == ["Claim", "Silence 1h", "Silence 4h", "Silence 24h"]
    feishu.wait_for(lambda: len(feishu.select("urgent_phone")) == 1)
    primary = rotation(bot.cfg.oncall, time.time())[0].open_id
    assert feishu.select("urgent_phone")[0].body["user_id_list"] == [primary]
    post_to_alertmanager(am, wider)  # joins the incident of `hang`: no card of its own
    wait_until(
        lambda: len(bot.store.db.query("SELECT id FROM episodes")) == 2, what="the wider alert received"
    )

    answer = sender.click(ALICE, {"episode": episode["id"], "action": "claim"}, message_id)
    assert answer.status_code == 200 and answer.json()["toast"]["type"] == "success"
    feishu.wait_for(lambda: len(updates(feishu, message_id)) == 1)
    claimed = updates(feishu, message_id)[0]
    assert "Claimed** by alice" in str(claimed) and "Claim" not in buttons(claimed)

    answer = sender.click(BOB, {"episode": episode["id"], "action": "silence", "duration": "4h"}, message_id)
    assert answer.json()["toast"]["type"] == "success", answer.json()
    silence_id = bot.store.episodes.get(episode["id"]).silence_id
    silence = requests.get(f"{am}/api/v2/silence/{silence_id}", timeout=5).json()
    assert silence["status"]["state"] == "active" and silence["createdBy"] == "bob"
    assert {m["name"]: m["value"] for m in silence["matchers"]} == {**hang, "gpu": ""}

    def state(labels: dict[str, str]) -> str:
        alerts = requests.get(f"{am}/api/v2/alerts", timeout=5).json()
        return next(a["status"]["state"] for a in alerts if a["labels"] == labels)

    wait_until(lambda: state(hang) == "suppressed", what="the silenced alert suppressed")
    assert state(wider) == "active"  # the silence covers this alert only
    feishu.wait_for(lambda: len(updates(feishu, message_id)) == 2)
    assert "Unsilence" in buttons(updates(feishu, message_id)[1])

    answer = sender.click(
        CAROL, {"episode": episode["id"], "action": "note"}, message_id, form_value={"note": "NIC reseated"}
    )
    assert answer.json()["toast"]["type"] == "success"
    answer = sender.click(ALICE, {"episode": episode["id"], "action": "unsilence"}, message_id)
    assert answer.json()["toast"]["type"] == "success"
    assert requests.get(f"{am}/api/v2/silence/{silence_id}", timeout=5).json()["status"]["state"] == "expired"

    audit = [(a.actor_name, a.action) for a in bot.store.coordination.actions_of(episode["id"])]
    assert audit == [("alice", "claim"), ("bob", "silence"), ("carol", "note"), ("alice", "unsilence")]
    bot.delivery.flush_archive()
    rows = [row for r in feishu.select("sheet") for row in r.body["valueRange"]["values"]]
    assert any(row[3] == "note by carol: note: NIC reseated" for row in rows)
    assert any(row[3].startswith("claim by alice") for row in rows)

    summary = bot.queue_report(*week_around(time.time()), on_demand=True)
    assert summary["notes"] == 1 and summary["actions"] == 4
    sheet = openpyxl.load_workbook(summary["path"])["On call"]
    cells = [c for row in sheet.iter_rows(values_only=True) for c in row if c]
    assert "note: NIC reseated" in cells and "carol" in cells and "alice" in cells


def week_around(now: float) -> tuple[Any, Any]:
    from datetime import UTC, datetime, timedelta

    day = datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return day - timedelta(days=3), day + timedelta(days=4)


@pytest.mark.slow
def test_refused_callbacks_change_nothing_and_are_logged(
    oncall_bot, feishu: FeishuServer, caplog: pytest.LogCaptureFixture
) -> None:
    bot, am = oncall_bot
    url = f"http://127.0.0.1:{bot.port}/feishu/callback"
    sender = CallbackSender(url, VERIFY, KEY)
    episode, message_id = fire(
        bot, am, feishu, {"alertname": "MegatraceRankHang", "severity": "P0", "job": "x"}
    )
    claim = {"episode": episode["id"], "action": "claim"}
    caplog.set_level(logging.WARNING)

    assert sender.click(ALICE, claim, message_id, sign=False).status_code == 401
    assert sender.click(ALICE, claim, message_id, key="someone-elses-key").status_code == 401
    assert sender.click(ALICE, claim, message_id, timestamp=int(time.time()) - 3600).status_code == 401
    forged_token = CallbackSender(url, "wrong-token", KEY)
    assert forged_token.click(ALICE, claim, message_id).status_code == 401
    off_roster = sender.click(MALLORY, claim, message_id)
    assert off_roster.json()["toast"]["type"] == "error"
    assert bot.store.episodes.get(episode["id"]).claimed_by is None

    assert sender.click(BOB, claim, message_id).json()["toast"]["type"] == "success"
    replayed = sender.replay()
    assert replayed.json()["toast"] == {"type": "error", "content": "This action was already received."}
    assert [a.actor_name for a in bot.store.coordination.actions_of(episode["id"])] == ["bob"]
    logged = caplog.text
    for reason in (
        "signature mismatch",
        "more than 300s off",
        "wrong verification token",
        "not on the on-call roster",
        "seen before (replay)",
    ):
        assert reason in logged
    assert KEY not in logged and VERIFY not in logged

    challenge = sender.post({"challenge": "c-123", "type": "url_verification", "token": VERIFY}, sign=False)
    assert challenge.json() == {"challenge": "c-123"}


@pytest.mark.slow
def test_escalation_in_compressed_time(oncall_bot, feishu: FeishuServer) -> None:
    bot, am = oncall_bot
    sender = CallbackSender(f"http://127.0.0.1:{bot.port}/feishu/callback", VERIFY, KEY)
    episode, message_id = fire(
        bot, am, feishu, {"alertname": "MegatraceRankHang", "severity": "P0", "job": "e"}
    )
    feishu.wait_for(lambda: len(feishu.select("urgent_phone")) == 1)
    first = bot.store.coordination.escalations_of(episode["id"])[0]
    order = [p.open_id for p in rotation(bot.cfg.oncall, first.at)]

    assert bot.escalate(now=first.at + 599) == 0
    assert bot.escalate(now=first.at + 601) == 1
    assert bot.escalate(now=first.at + 602) == 0  # that step is taken: at most once
    feishu.wait_for(lambda: len(feishu.select("urgent_phone")) == 2)
    assert feishu.select("urgent_phone")[1].body["user_id_list"] == [order[1]]

    sender.click(order[1], {"episode": episode["id"], "action": "claim"}, message_id)
    assert bot.escalate(now=first.at + 5000) == 0  # claimed: no third call
    time.sleep(0.5)
    assert len(feishu.select("urgent_phone")) == 2

    slow = {"alertname": "MegatraceSlowRank", "severity": "P1", "job": "e", "rank": "5"}
    p1, _ = fire(bot, am, feishu, slow)
    assert feishu.messages()[-1].key == "oc_p1" and len(feishu.select("urgent_phone")) == 2
    assert bot.escalate(now=p1["starts_at"] + 1799) == 0
    assert bot.escalate(now=p1["starts_at"] + 1801) == 1
    feishu.wait_for(
        lambda: any(
            m.key == "oc_p0"
            and m.body["content"]["header"]["title"]["content"].startswith("[P0] FIRING: rank 5 is slow")
            for m in feishu.messages()
        )
    )
    feishu.wait_for(lambda: len(feishu.select("urgent_phone")) == 3)
    raised = bot.store.episodes.get(p1["id"])
    assert raised.level == "P0" and raised.escalated == 1
    assert [a.action for a in bot.store.coordination.actions_of(p1["id"])] == ["raise"]


def test_weekly_rotation_with_overrides() -> None:
    roster = [Person(r["name"], r["open_id"]) for r in ROSTER]
    oncall = OncallConfig(
        roster=roster,
        rotation_start="2026-01-05T09:00:00+00:00",
        overrides=[RotationOverride("2026-01-20T00:00:00+00:00", "2026-01-21T00:00:00+00:00", "alice")],
    )
    start = 1767603600.0  # 2026-01-05 09:00 UTC
    names = [[p.name for p in rotation(oncall, start + w * WEEK + 3600)] for w in range(4)]
    assert names == [
        ["alice", "bob", "carol"],
        ["bob", "carol", "alice"],
        ["carol", "alice", "bob"],
        ["alice", "bob", "carol"],
    ]
    in_override = 1768899600.0  # 2026-01-20 09:00 UTC, carol's week
    assert [p.name for p in rotation(oncall, in_override)] == ["alice", "carol", "bob"]
    assert rotation(oncall, start - 60)[0].name == "carol"  # the minute before the rotation's first week


def test_long_connection_through_lark_oapi(tmp_path: Path, feishu: FeishuServer) -> None:
    ws = feishu.serve_long_connection()
    cfg = oncall_config(tmp_path, feishu, "", mode="long_connection", verification_token="", encrypt_key="")
    bot = Service(cfg)
    bot.start()
    try:
        assert alert_with_card(bot.store, "om_1") == 1
        assert ws.connected.wait(20), feishu.summary()
        answer = ws.push(card_action_event("", BOB, {"episode": 1, "action": "claim"}, "om_1"))
        assert answer == {"code": 200, "data": {"toast": {"type": "success", "content": "claimed"}}}
        assert bot.store.episodes.get(1).claimed_by == "bob"
        refused = ws.push(card_action_event("", MALLORY, {"episode": 1, "action": "claim"}, "om_1"))
        assert refused["data"]["toast"]["type"] == "error"
        elsewhere = ws.push(card_action_event("", BOB, {"episode": 1, "action": "note"}, "om_other"))
        assert elsewhere["data"]["toast"] == {
            "type": "error",
            "content": "message 'om_other' is not a card of this alert",
        }
        assert [(a.actor_name, a.source) for a in bot.store.coordination.actions_of(1)] == [
            ("bob", "long_connection")
        ]
        assert feishu.select("ws_endpoint")
    finally:
        bot.stop()


def bot_silences(am: str, episode: dict) -> list[dict]:
    """The silences the bot made for `episode` (they carry its comment), as Alertmanager holds them."""
    comment = f"from the Feishu card of alert {episode['id']} ({episode['alertname']})"
    return [s for s in requests.get(f"{am}/api/v2/silences", timeout=5).json() if s["comment"] == comment]


@pytest.mark.slow
def test_silence_is_idempotent_and_unsilence_expires_every_silence(oncall_bot, feishu: FeishuServer) -> None:
    bot, am = oncall_bot
    sender = CallbackSender(f"http://127.0.0.1:{bot.port}/feishu/callback", VERIFY, KEY)
    episode, message_id = fire(
        bot, am, feishu, {"alertname": "MegatraceRankHang", "severity": "P0", "job": "s"}
    )
    silence = {"episode": episode["id"], "action": "silence", "duration": "1h"}

    first = sender.click(ALICE, silence, message_id).json()["toast"]
    second = sender.click(BOB, silence | {"duration": "4h"}, message_id).json()["toast"]
    assert first["type"] == "success" and second["type"] == "error"
    assert second["content"].startswith("already silenced")
    answers: list[dict] = []
    clicks = [
        threading.Thread(target=lambda: answers.append(sender.click(CAROL, silence, message_id).json()))
        for _ in range(30)
    ]
    for click in clicks:
        click.start()
    for click in clicks:
        click.join()
    assert len(answers) == 30 and all(a["toast"]["type"] == "error" for a in answers)
    assert len(bot_silences(am, episode)) == 1

    # One made by an older version of the bot (two clicks made two silences then): expired too.
    older = dict(bot_silences(am, episode)[0])
    older.pop("id")
    older["createdBy"] = "an older replica"
    requests.post(f"{am}/api/v2/silences", json=older, timeout=5).raise_for_status()
    assert len([s for s in bot_silences(am, episode) if s["status"]["state"] == "active"]) == 2
    unsilence = sender.click(ALICE, {"episode": episode["id"], "action": "unsilence"}, message_id).json()
    assert unsilence["toast"]["type"] == "success"
    assert {s["status"]["state"] for s in bot_silences(am, episode)} == {"expired"}
    again = sender.click(BOB, silence, message_id).json()["toast"]  # silencing again makes a new one
    assert again["type"] == "success"
    assert sorted(s["status"]["state"] for s in bot_silences(am, episode)) == ["active", "expired", "expired"]


@pytest.mark.slow
def test_a_card_action_acts_only_on_its_own_cards_alert(oncall_bot, feishu: FeishuServer) -> None:
    bot, am = oncall_bot
    sender = CallbackSender(f"http://127.0.0.1:{bot.port}/feishu/callback", VERIFY, KEY)
    a, card_a = fire(bot, am, feishu, {"alertname": "MegatraceRankHang", "severity": "P0", "job": "a"})
    b, card_b = fire(bot, am, feishu, {"alertname": "MegatraceRankHang", "severity": "P0", "job": "b"})
    crossed = sender.click(ALICE, {"episode": b["id"], "action": "claim"}, card_a).json()["toast"]
    assert crossed == {"type": "error", "content": f"message {card_a!r} is not a card of this alert"}
    assert sender.click(ALICE, {"episode": b["id"], "action": "claim"}, "om_unknown").json()["toast"][
        "type"
    ] == ("error")
    assert (
        bot.store.episodes.get(b["id"]).claimed_by is None
        and bot.store.coordination.actions_of(b["id"]) == []
    )
    assert (
        sender.click(ALICE, {"episode": b["id"], "action": "claim"}, card_b).json()["toast"]["type"]
        == "success"
    )
    assert bot.store.episodes.get(a["id"]).claimed_by is None
