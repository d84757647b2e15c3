"""Delivery to the local Feishu server: signatures, tokens, retries, dead letters, phone fallback,
idempotency, rate limits, the sheet archive, card size and user templates."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatrace.alertbot.feishu import sign
from tests.alertbot.conftest import Bot, alert, config, webhook
from tests.support.feishu_server import FeishuServer, bot_sign

T0 = 1_790_000_000.0


def bot_config(tmp_path: Path, feishu: FeishuServer, secret: str = "bot-secret-1", **extra: object):
    hook = feishu.add_bot(secret=secret, chat_id="oc_p1")
    return config(
        tmp_path,
        feishu={"base_url": feishu.url, "group_bots": {"P1": {"webhook": hook, "secret": secret}}},
        **extra,
    ), hook


def app_config(tmp_path: Path, feishu: FeishuServer, **extra: object):
    return config(
        tmp_path,
        feishu={
            "base_url": feishu.url,
            "app": {
                "app_id": feishu.app_id,
                "app_secret": feishu.app_secret,
                "chats": {"P0": "oc_oncall"},
                "oncall": ["ou_alice", "ou_bob"],
            },
        },
        **extra,
    )


def slow_rank(rank: int = 5, job: str = "llm", **labels: str) -> dict:
    return alert("MegatraceSlowRank", severity="P1", job=job, rank=str(rank), instance="gpu-3:9450", **labels)


def test_signature_matches_feishu_definition() -> None:
    assert sign("secret", "1700000000") == bot_sign("secret", "1700000000")
    assert sign("secret", "1700000000") != sign("secret", "1700000001")


def test_signed_card_reaches_the_group(tmp_path: Path, feishu: FeishuServer) -> None:
    cfg, hook = bot_config(tmp_path, feishu)
    bot = Bot(cfg)
    bot.receive(webhook(slow_rank()))
    bot.drain()
    (post,) = feishu.bot_posts(hook)
    assert post.body["msg_type"] == "interactive"
    card = post.body["card"]
    assert card["header"] == {
        "title": {"tag": "plain_text", "content": "[P1] FIRING: rank 5 is slow on gpu-3 — job llm"},
        "template": "orange",
    }
    text = card["elements"][0]["text"]["content"]
    assert "**Where**: job llm, node gpu-3" in text
    assert "**Culprit**: rank **5** on node **gpu-3**" in text
    buttons = {b["text"]["content"]: b["url"] for b in card["elements"][1]["actions"]}
    assert buttons["Runbook"] == "https://runbooks.example/megatrace"
    assert buttons["Silence"].startswith(
        "http://alertmanager.example:9093/#/silences/new?filter=%7Balertname%3D%22MegatraceSlowRank%22"
    )
    assert bot.metrics.sent.labels("bot")._value.get() == 1


def test_wrong_secret_is_a_visible_dead_letter_without_retries(
    tmp_path: Path, feishu: FeishuServer, caplog: pytest.LogCaptureFixture
) -> None:
    hook = feishu.add_bot(secret="the-real-secret")
    cfg = config(
        tmp_path,
        feishu={"base_url": feishu.url, "group_bots": {"P1": {"webhook": hook, "secret": "wrong-secret"}}},
    )
    bot = Bot(cfg)
    bot.receive(webhook(slow_rank()))
    with caplog.at_level(logging.ERROR):
        bot.drain()
    (dead,) = bot.store.outbox.dead_letters()
    assert dead.attempts == 1 and "code 19021" in dead.last_error
    assert feishu.bot_posts() == []
    assert bot.metrics.dead.labels("bot")._value.get() == 1
    assert "DEAD LETTER" in caplog.text and "19021" in caplog.text
    assert "wrong-secret" not in caplog.text


def test_rate_limit_and_server_errors_are_retried(tmp_path: Path, feishu: FeishuServer) -> None:
    cfg, hook = bot_config(tmp_path, feishu)
    bot = Bot(cfg)
    feishu.fail("bot", "rate_limit", "server_error")
    bot.receive(webhook(slow_rank()))
    bot.drain()
    assert len(feishu.bot_posts(hook)) == 1
    row = bot.store.outbox.find()[0]
    assert row.state == "sent" and row.attempts == 3
    outcomes = [a.outcome for a in bot.store.outbox.attempts_of(row.id)]
    assert outcomes == ["retry", "retry", "sent"]


def test_gives_up_after_max_attempts(tmp_path: Path, feishu: FeishuServer) -> None:
    cfg, _ = bot_config(tmp_path, feishu, delivery={"max_attempts": 2, "backoff_base_s": 0.01})
    bot = Bot(cfg)
    feishu.fail("bot", "server_error", "server_error", "server_error")
    bot.receive(webhook(slow_rank()))
    bot.drain()
    (dead,) = bot.store.outbox.dead_letters()
    assert dead.attempts == 2 and "HTTP 500" in dead.last_error


def test_app_honours_ratelimit_reset_header(tmp_path: Path, feishu: FeishuServer) -> None:
    bot = Bot(app_config(tmp_path, feishu, delivery={"backoff_base_s": 0.01}))
    feishu.fail("message", "http_429")
    bot.receive(webhook(alert(job="llm", rank="0")))
    bot.delivery.deliver_due()
    row = bot.store.outbox.find(kind="firing")[0]
    attempt = bot.store.outbox.attempts_of(row.id)[0]
    assert row.state == "pending" and "99991400" in row.last_error
    assert row.not_before - attempt.finished_at >= 1.0  # x-ogw-ratelimit-reset: 1
    bot.drain()
    assert len(feishu.messages("oc_oncall")) == 1


def test_p0_phones_oncall_with_sms_fallback_and_invalid_users(
    tmp_path: Path, feishu: FeishuServer, caplog: pytest.LogCaptureFixture
) -> None:
    bot = Bot(app_config(tmp_path, feishu))
    feishu.invalid_users.add("ou_bob")
    feishu.fail("urgent_phone", "quota")
    bot.receive(webhook(alert(job="llm", rank="0")))
    with caplog.at_level(logging.WARNING):
        bot.drain()
    (message,) = feishu.messages("oc_oncall")
    assert message.body["msg_type"] == "interactive" and message.body["uuid"].startswith("mt-")
    (sms,) = feishu.select("urgent_sms")
    assert sms.key == message.message_id and sms.body["user_id_list"] == ["ou_alice", "ou_bob"]
    assert feishu.select("urgent_phone") == [] and feishu.select("urgent_app") == []
    urgent = bot.store.outbox.find(kind="urgent")[0]
    assert urgent.state == "sent"
    detail = bot.store.outbox.attempts_of(urgent.id)[-1].detail
    assert "urgent_sms: 1 of 2 reached" in detail and "ou_bob" in detail
    assert "quota exhausted" in caplog.text and "invalid ids" in caplog.text


def test_all_urgent_quota_gone_falls_back_to_in_app(tmp_path: Path, feishu: FeishuServer) -> None:
    bot = Bot(app_config(tmp_path, feishu))
    feishu.fail("urgent_phone", "quota")
    feishu.fail("urgent_sms", "quota")
    bot.receive(webhook(alert(job="llm", rank="0")))
    bot.drain()
    assert len(feishu.select("urgent_app")) == 1


def test_token_is_cached_and_refreshed_when_rejected(tmp_path: Path, feishu: FeishuServer) -> None:
    bot = Bot(app_config(tmp_path, feishu, dedupe={"storm_threshold": 0}))
    bot.receive(webhook(*[alert(job=f"llm-{r}", rank=str(r)) for r in range(3)]))
    bot.drain()
    assert len(feishu.select("token")) == 1
    feishu.expire_tokens()
    bot.receive(webhook(alert(job="llm-9", rank="9")))
    bot.drain()
    assert len(feishu.select("token")) == 2
    assert len(feishu.messages("oc_oncall")) == 4
    assert [code for _, code, _ in feishu.rejections] == [99991663]  # refused once, then refreshed


def test_app_uuid_makes_a_resend_harmless(tmp_path: Path, feishu: FeishuServer) -> None:
    bot = Bot(app_config(tmp_path, feishu))
    bot.receive(webhook(alert(job="llm", rank="1")))
    bot.drain()
    row = bot.store.outbox.find(kind="firing")[0]
    message = json.loads(row.payload)
    again = bot.delivery.send(row, message)  # e.g. a resend after a crash left it in doubt
    assert again.ok and again.data["message_id"] == row.message_id
    assert len(feishu.messages("oc_oncall")) == 1


def test_bot_rate_limit_is_respected(tmp_path: Path, feishu: FeishuServer) -> None:
    cfg, hook = bot_config(tmp_path, feishu, dedupe={"storm_threshold": 0})
    bot = Bot(cfg)
    bot.receive(webhook(*[slow_rank(rank, job=f"llm-{rank}") for rank in range(12)]))
    bot.drain(timeout=30)
    assert len(feishu.bot_posts(hook)) == 12
    assert feishu.rejections == []  # the server enforces 5/s and 100/min and never had to refuse
    times = sorted(p.time for p in feishu.bot_posts(hook))
    assert all(b - a >= 1.0 for a, b in zip(times, times[5:], strict=False))


def test_sheet_archive_is_batched(tmp_path: Path, feishu: FeishuServer) -> None:
    cfg = app_config(tmp_path, feishu, dedupe={"storm_threshold": 0})
    cfg.feishu.sheet.spreadsheet_token = "shtcnMegatrace"
    cfg.feishu.sheet.sheet_id = "0bxR7V"
    cfg.feishu.sheet.batch_size = 20
    bot = Bot(cfg)
    ranks = [alert("MegatraceRankHang", job="llm", rank=str(r)) for r in range(15)]
    bot.receive(webhook(*ranks))
    bot.receive(webhook(*[{**a, "status": "resolved", "endsAt": "2026-09-21T12:00:00Z"} for a in ranks]))
    assert bot.delivery.flush_archive() == 30
    calls = feishu.select("sheet", "shtcnMegatrace")
    assert [len(c.body["valueRange"]["values"]) for c in calls] == [20, 10]
    assert calls[0].body["valueRange"]["range"] == "0bxR7V!A1:L20"
    first = calls[0].body["valueRange"]["values"][0]
    assert first[1:6] == ["P0", "MegatraceRankHang", "firing", "llm", ""] and len(first) == 12
    events = [row[3] for c in calls for row in c.body["valueRange"]["values"]]
    assert events.count("firing") == 15 and events.count("resolved") == 15
    assert bot.delivery.flush_archive() == 0


def test_huge_alert_is_shrunk_to_fit_feishu_limit(tmp_path: Path, feishu: FeishuServer) -> None:
    cfg, hook = bot_config(tmp_path, feishu)
    bot = Bot(cfg)
    big = slow_rank()
    big["annotations"]["description"] = "x" * 50_000
    big["labels"].update({f"label{i}": "y" * 500 for i in range(60)})
    bot.receive(webhook(big))
    bot.drain()
    (post,) = feishu.bot_posts(hook)
    assert len(json.dumps(post.body, ensure_ascii=False).encode()) <= 20 * 1024


def test_user_template_overrides_and_broken_template_falls_back(tmp_path: Path, feishu: FeishuServer) -> None:
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "card_alert.json.j2").write_text(
        '{"header": {"title": {"tag": "plain_text", "content": {{ ("CUSTOM " ~ alertname) | tojson }}},'
        ' "template": {{ colour | tojson }}}, "elements": [{"tag": "div", "text": {"tag": "lark_md",'
        ' "content": {{ where | tojson }}}}]}'
    )
    (templates / "card_storm.json.j2").write_text("{ not json {{ count }}")
    cfg, hook = bot_config(
        tmp_path, feishu, templates_dir=str(templates), dedupe={"storm_threshold": 1, "storm_hold_s": 0}
    )
    bot = Bot(cfg)
    bot.receive(webhook(*(slow_rank(rank, job=f"llm-{rank}") for rank in (1, 2, 3))))
    bot.drain()
    posts = feishu.bot_posts(hook)
    assert posts[0].body["card"]["header"]["title"]["content"] == "CUSTOM MegatraceSlowRank"
    assert posts[1].body["card"]["header"]["title"]["content"] == "[P1] STORM: 2 × MegatraceSlowRank"


def test_p3_goes_to_its_low_priority_chat_and_never_to_a_phone(tmp_path: Path, feishu: FeishuServer) -> None:
    app = {
        "app_id": feishu.app_id,
        "app_secret": feishu.app_secret,
        "chats": {"P0": "oc_p0", "P3": "oc_low"},
        "phone_levels": ["P0", "P3"],  # a P3 listed by mistake still rings no one
        "oncall": ["ou_alice"],
    }
    cfg = config(tmp_path, feishu={"base_url": feishu.url, "app": app}, delivery={"report_only_levels": []})
    bot = Bot(cfg)
    bot.receive(webhook(alert(job="a"), alert("MegatraceClockSkew", severity="info", job="b")))
    bot.drain()
    sent = {m.key: m.message_id for m in feishu.messages()}
    assert set(sent) == {"oc_p0", "oc_low"}
    assert [r.key for r in feishu.select("urgent_phone")] == [sent["oc_p0"]]
