"""Dedupe, recurrence, flapping, storm collapse, grading and escalation, on a real SQLite store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrace.alertbot.config import GradingConfig
from megatrace.alertbot.grading import base_level, grade, load_policy
from megatrace.alertbot.payload import format_time, parse_time
from megatrace.config import ConfigError
from tests.alertbot.conftest import Bot, alert, config, webhook
from tests.support.feishu_server import FeishuServer, mentions

T0 = 1_790_000_000.0


def kinds(bot: Bot) -> list[tuple[str, str]]:
    return [(r["kind"], r["state"]) for r in bot.store.db.query("SELECT * FROM outbox ORDER BY id")]


def test_ha_duplicates_give_one_notification(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    hang = alert(job="llm", rank="3", instance="gpu-7:9450")
    bot.receive(webhook(hang), T0)
    bot.receive(webhook(hang), T0 + 1)  # the second Alertmanager of the HA pair
    bot.drain()
    assert kinds(bot) == [("firing", "sent")]
    episode = bot.store.db.query("SELECT * FROM episodes")[0]
    assert episode["duplicates"] == 1
    sent = bot.console()
    assert len(sent) == 1 and sent[0]["card"]["header"]["template"] == "red"
    assert "[P0] FIRING" in sent[0]["card"]["header"]["title"]["content"]


def test_resolve_follows_firing_and_stale_firing_is_ignored(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    bot.receive(webhook(alert(job="llm", rank="1")), T0)
    bot.receive(webhook(alert(job="llm", rank="1", status="resolved", ends_at=T0 + 600)), T0 + 600)
    bot.receive(webhook(alert(job="llm", rank="1")), T0 + 601)  # late duplicate of the firing webhook
    bot.drain()
    assert kinds(bot) == [("firing", "sent"), ("resolved", "sent")]
    resolved = bot.console()[1]["card"]
    assert resolved["header"]["template"] == "green"
    assert "Resolved** after 10m" in resolved["elements"][0]["text"]["content"]


def test_resolved_arriving_first_reports_the_whole_episode_once(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    bot.receive(webhook(alert(job="llm", status="resolved", ends_at=T0 + 120)), T0 + 130)
    bot.receive(webhook(alert(job="llm")), T0 + 131)  # the firing webhook, out of order
    bot.drain()
    assert kinds(bot) == [("resolved", "sent")]
    assert bot.store.db.query("SELECT status FROM episodes")[0]["status"] == "resolved"


def test_repeat_interval_and_recurrence(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path, dedupe={"repeat_interval_s": 3600, "flap_threshold": 10}))
    hang = alert(job="llm", rank="2")
    bot.receive(webhook(hang), T0)
    bot.receive(webhook(hang), T0 + 1800)  # Alertmanager repeat inside our interval: dropped
    bot.receive(webhook(hang), T0 + 3700)  # past it: a reminder
    bot.receive(webhook(alert(job="llm", rank="2", status="resolved", ends_at=T0 + 4000)), T0 + 4000)
    again = alert(job="llm", rank="2", starts_at=T0 + 5000)  # same alert, new episode
    bot.receive(webhook(again), T0 + 5000)
    bot.drain()
    assert [k for k, _ in kinds(bot)] == ["firing", "repeat", "resolved", "firing"]
    episodes = bot.store.db.query("SELECT recurrence FROM episodes ORDER BY id")
    assert [e["recurrence"] for e in episodes] == [0, 1]
    last = bot.console()[-1]["card"]["elements"][0]["text"]["content"]
    assert "**Recurrence**: #2 of this alert" in last
    assert "Still firing (reminder)" in bot.console()[1]["card"]["elements"][0]["text"]["content"]


def test_flapping_alert_is_held_back_and_dropped_when_it_resolves_in_time(tmp_path: Path) -> None:
    cfg = config(tmp_path, dedupe={"flap_threshold": 3, "flap_window_s": 3600, "flap_hold_s": 300})
    bot = Bot(cfg)
    for i in range(3):
        start = T0 + i * 100
        bot.receive(webhook(alert("MegatraceSlowRank", severity="P1", starts_at=start, job="j")), start)
        bot.receive(
            webhook(alert("MegatraceSlowRank", "resolved", start, start + 50, "P1", job="j")), start + 50
        )
    bot.delivery.deliver_due(T0 + 10_000)
    rows = kinds(bot)
    assert rows[:4] == [("firing", "sent"), ("resolved", "sent"), ("firing", "sent"), ("resolved", "sent")]
    assert rows[4:] == [("firing", "suppressed")]  # third episode: flapping, resolved while held
    flapping = bot.store.db.query("SELECT flapping FROM episodes ORDER BY id")
    assert [f["flapping"] for f in flapping] == [0, 0, 1]
    assert bot.metrics.suppressed._value.get() == 1


def test_flapping_alert_still_firing_after_the_hold_is_sent(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path, dedupe={"flap_threshold": 2, "flap_hold_s": 300}))
    bot.receive(webhook(alert(starts_at=T0, job="j")), T0)
    bot.receive(webhook(alert(status="resolved", starts_at=T0, ends_at=T0 + 5, job="j")), T0 + 5)
    bot.receive(webhook(alert(starts_at=T0 + 10, job="j")), T0 + 10)
    assert bot.delivery.deliver_due(T0 + 11) == 2  # first firing + its resolve; second held
    assert bot.delivery.deliver_due(T0 + 311) == 1
    card = bot.console()[-1]["card"]["elements"][0]["text"]["content"]
    assert "**Flapping**" in card


def test_storm_collapses_into_one_summary(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path, dedupe={"storm_threshold": 3, "storm_window_s": 120, "storm_hold_s": 5}))
    links = [
        alert("MegatraceIBLinkDown", severity="P0", instance=f"gpu-{i}:9450", device="mlx5_0")
        for i in range(40)
    ]
    for i in range(0, 40, 10):
        bot.receive(webhook(*links[i : i + 10]), T0)
    bot.delivery.deliver_due(T0 + 1)
    assert [k for k, _ in kinds(bot)] == ["firing"] * 3 + ["storm"]
    assert bot.delivery.deliver_due(T0 + 6) == 1
    sent = bot.console()
    assert len(sent) == 4
    storm = sent[3]["card"]
    assert storm["header"]["title"]["content"] == "[P0] STORM: 37 × MegatraceIBLinkDown"
    text = storm["elements"][0]["text"]["content"]
    assert "instance=gpu-3:9450" in text and "instance=gpu-39:9450" in text
    # a later alert of the same kind opens a new summary; resolves of members are not sent one by one
    bot.receive(webhook(alert("MegatraceIBLinkDown", severity="P0", instance="gpu-99:9450")), T0 + 10)
    bot.receive(webhook({**links[5], "status": "resolved", "endsAt": "2026-09-21T00:00:00Z"}), T0 + 11)
    bot.delivery.deliver_due(T0 + 20)
    assert [k for k, _ in kinds(bot)][4:] == ["storm", "storm-resolved"]
    assert [m["kind"] for m in bot.console()[4:]] == ["storm"]  # the resolved summary waits its hold
    assert "1 × MegatraceIBLinkDown" in bot.console()[-1]["card"]["header"]["title"]["content"]


def link_down(i: int) -> dict:
    return alert("MegatraceIBLinkDown", severity="P0", instance=f"gpu-{i}:9450", device="mlx5_0")


def resolved(item: dict, ends_at: float) -> dict:
    return {**item, "status": "resolved", "endsAt": format_time(ends_at)}


def storm_bot(tmp_path: Path) -> Bot:
    dedupe = {"storm_threshold": 3, "storm_hold_s": 5, "storm_resolve_hold_s": 30}
    return Bot(config(tmp_path, dedupe=dedupe))


def card_text(message: dict) -> tuple[str, str]:
    card = message["card"]
    return card["header"]["title"]["content"], card["elements"][0]["text"]["content"]


def test_storm_resolves_into_one_summary_then_a_final_one_across_a_restart(tmp_path: Path) -> None:
    bot = storm_bot(tmp_path)
    links = [link_down(i) for i in range(10)]
    bot.receive(webhook(*links), T0)  # 3 sent on their own, 7 collapse into the storm
    bot.delivery.deliver_due(T0 + 6)
    assert [m["kind"] for m in bot.console()] == ["firing"] * 3 + ["storm"]
    bot.receive(webhook(*(resolved(x, T0 + 95) for x in [links[0], *links[3:8]])), T0 + 100)
    bot.receive(webhook(resolved(links[3], T0 + 95)), T0 + 101)  # the HA twin: nothing new
    assert bot.delivery.deliver_due(T0 + 120) == 1  # member 0 was sent alone: its own resolved card
    assert bot.delivery.deliver_due(T0 + 131) == 1
    assert [m["kind"] for m in bot.console()[4:]] == ["resolved", "storm-resolved"]
    title, text = card_text(bot.console()[-1])
    assert title == "[P0] STORM RECOVERING: 5 of 7 × MegatraceIBLinkDown resolved"
    recovered, firing = text.split("**Still firing** (2):")
    assert [f"instance=gpu-{i}:9450" in recovered for i in range(3, 10)] == [True] * 5 + [False] * 2
    assert "instance=gpu-8:9450 device=mlx5_0" in firing and "instance=gpu-9:9450" in firing
    assert bot.console()[-1]["card"]["header"]["template"] == "wathet"

    bot.store.close()
    bot = storm_bot(tmp_path)  # a restart: what was sent and queued is in the store
    bot.receive(webhook(resolved(links[8], T0 + 300)), T0 + 300)
    assert bot.delivery.deliver_due(T0 + 1000) == 0  # one member still fires: no new summary
    bot.receive(webhook(resolved(links[9], T0 + 310)), T0 + 310)
    bot.receive(webhook(resolved(links[9], T0 + 310)), T0 + 311)
    assert bot.delivery.deliver_due(T0 + 1000) == 1
    assert bot.delivery.deliver_due(T0 + 2000) == 0
    title, text = card_text(bot.console()[-1])
    assert title == "[P0] STORM RESOLVED: 7 × MegatraceIBLinkDown resolved"
    assert bot.console()[-1]["card"]["header"]["template"] == "green"
    assert "All recovered." in text and "Still firing" not in text
    assert all(f"instance=gpu-{i}:9450" in text for i in range(3, 10))
    assert [k for k, _ in kinds(bot)] == ["firing"] * 3 + ["storm", "resolved"] + ["storm-resolved"] * 2


def test_storm_that_recovers_at_once_gets_one_resolved_summary_after_its_storm_card(tmp_path: Path) -> None:
    bot = storm_bot(tmp_path)
    links = [link_down(i) for i in range(8)]
    bot.receive(webhook(*links), T0)
    for i, item in enumerate(links[3:]):  # members resolve one by one, before the storm card is out
        bot.receive(webhook(resolved(item, T0 + 1 + i)), T0 + 1 + i)
    bot.delivery.deliver_due(T0 + 1000)
    assert [m["kind"] for m in bot.console()] == ["firing"] * 3 + ["storm", "storm-resolved"]
    title, text = card_text(bot.console()[-1])
    assert title == "[P0] STORM RESOLVED: 5 × MegatraceIBLinkDown resolved"
    assert "All recovered." in text
    assert [k for k, _ in kinds(bot)].count("storm-resolved") == 1


def test_escalation_raises_recurring_alert_one_level(tmp_path: Path) -> None:
    bot = Bot(
        config(
            tmp_path, grading={"escalate_after": 3, "escalate_window_s": 86400}, dedupe={"flap_threshold": 99}
        )
    )
    for i in range(4):
        start = T0 + i * 3600
        bot.receive(
            webhook(alert("GpuThrottled", severity="P2", starts_at=start, instance="gpu-1:9450")), start
        )
        bot.receive(
            webhook(alert("GpuThrottled", "resolved", start, start + 60, "P2", instance="gpu-1:9450")),
            start + 60,
        )
    levels = bot.store.db.query("SELECT level, escalated FROM episodes ORDER BY id")
    assert [(r["level"], r["escalated"]) for r in levels] == [("P2", 0), ("P2", 0), ("P1", 1), ("P1", 1)]
    bot.drain()
    raised = [m for m in bot.console() if "raised to P1" in m["card"]["elements"][0]["text"]["content"]]
    assert [m["kind"] for m in raised] == ["firing", "resolved", "firing", "resolved"]


def test_p3_goes_to_the_report_only(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    bot.receive(webhook(alert("NodeInfo", severity="info", instance="gpu-1:9450")), T0)
    assert kinds(bot) == []
    assert bot.store.db.query("SELECT level FROM episodes")[0]["level"] == "P3"


def test_grading_words_policy_and_default(tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        "rules:\n"
        "  - match: {alertname: GpuThrottled}\n    match_re: {instance: 'gpu-(1|2):.*'}\n    level: P1\n"
        "  - match: {team: storage}\n    level: P3\n"
    )
    policy = load_policy(policy_file)
    assert (
        base_level({"alertname": "GpuThrottled", "instance": "gpu-1:9450", "severity": "P2"}, policy, "P2")
        == "P1"
    )
    assert (
        base_level({"alertname": "GpuThrottled", "instance": "gpu-3:9450", "severity": "P2"}, policy, "P2")
        == "P2"
    )
    assert base_level({"alertname": "X", "team": "storage", "severity": "critical"}, policy, "P2") == "P3"
    assert base_level({"alertname": "X", "severity": "critical"}, [], "P2") == "P0"
    assert base_level({"alertname": "X", "severity": "warning"}, [], "P2") == "P2"
    assert base_level({"alertname": "X", "severity": "p1"}, [], "P2") == "P1"
    assert base_level({"alertname": "X"}, [], "P3") == "P3"
    assert grade({"alertname": "X", "severity": "P0"}, [], GradingConfig(escalate_after=1), 5).level == "P0"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules: [{match: {a: b}, level: P7}]", "rules[0].level"),
        ("rules: [{level: P1}]", "needs at least one matcher"),
        ("rules: [{match_re: {a: '('}, level: P1}]", "invalid regular expression"),
        ("rulez: []", "unknown key"),
    ],
)
def test_bad_policy_file_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"policy\.yaml") as exc:
        load_policy(path)
    assert message in str(exc.value)


def test_most_urgent_level_is_delivered_first(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    bot.receive(webhook(alert("GpuThrottled", severity="P2", instance="gpu-1:9450")), T0)
    bot.receive(webhook(alert("MegatraceSlowRank", severity="P1", job="llm")), T0 + 1)
    bot.receive(webhook(alert("MegatraceRankHang", job="llm")), T0 + 2)
    bot.delivery.deliver_due(T0 + 3)
    assert [line["level"] for line in bot.console()] == ["P0", "P1", "P2"]


def test_webhook_nanoseconds_and_api_milliseconds_are_one_episode(tmp_path: Path) -> None:
    """Alertmanager's webhook carries startsAt in nanoseconds, its API v2 (reconciliation) cuts it to
    milliseconds; rounding .1239 up would make two episodes of one alert and a false resolve."""
    assert parse_time("2026-09-21T10:00:00.123987654Z", "t") == parse_time("2026-09-21T10:00:00.123Z", "t")
    bot = Bot(config(tmp_path))
    from_webhook = alert(job="llm", rank="1")
    from_webhook["startsAt"] = "2026-09-21T10:00:00.123987654Z"
    bot.receive(webhook(from_webhook), T0)
    bot.receive(webhook({**from_webhook, "startsAt": "2026-09-21T10:00:00.123Z"}), T0 + 1)
    (episode,) = bot.store.db.query("SELECT * FROM episodes")
    assert episode["duplicates"] == 1


HOSTILE = "<at id=all></at> **bold** [click](https://evil.example) `x` <font color='red'>!</font>"


def test_labels_and_annotations_ping_no_one_and_show_as_written(tmp_path: Path, feishu: FeishuServer) -> None:
    hook = feishu.add_bot()
    bot = Bot(config(tmp_path, feishu={"base_url": feishu.url, "group_bots": {"P1": {"webhook": hook}}}))
    hostile = alert("MegatraceSlowRank", severity="P1", job=HOSTILE, rank="3\x07")
    hostile["annotations"] |= {"summary": HOSTILE, "description": f"see {HOSTILE}"}
    storm = [alert("MegatraceNodeDown", severity="P1", instance=f"{HOSTILE}-{i}") for i in range(30)]
    bot.receive(webhook(hostile, *storm), T0)
    bot.drain()
    cards = [post.body["card"] for post in feishu.bot_posts(hook)]
    assert len(cards) >= 2 and [who for card in cards for who in mentions(card)] == []
    markdown = json.dumps(
        [e["text"]["content"] for card in cards for e in card["elements"] if e.get("tag") == "div"],
        ensure_ascii=False,
    )
    assert "<" not in markdown and "**bold**" not in markdown and "[click]" not in markdown
    assert "&#60;at id=all&#62;&#60;/at&#62; &#42;&#42;bold&#42;&#42; &#91;click&#93;" in markdown
    # plain_text: as written, less control characters (the rank label carries a BEL)
    assert cards[0]["header"]["title"]["content"] == f"[P1] FIRING: rank 3 is slow — job {HOSTILE}"
    assert "\x07" not in json.dumps(cards, ensure_ascii=False)


def test_every_storm_member_is_on_the_sheet_and_reachable_from_the_storm_card(
    tmp_path: Path, feishu: FeishuServer
) -> None:
    hook = feishu.add_bot()
    sheet_url = "https://example.feishu.cn/sheets/shtcn_test?sheet=s1"
    app = {"app_id": feishu.app_id, "app_secret": feishu.app_secret}
    cfg = config(
        tmp_path,
        feishu={
            "base_url": feishu.url,
            "group_bots": {"P1": {"webhook": hook}},
            "app": app,
            "sheet": {"spreadsheet_token": "shtcn_test", "sheet_id": "s1"},
        },
        links={"archive_sheet_url": sheet_url},
        dedupe={"storm_hold_s": 0},
    )
    bot = Bot(cfg)
    members = [alert("MegatraceNodeDown", severity="P1", instance=f"gpu-{i}:9450") for i in range(250)]
    bot.receive(webhook(*members), T0)
    bot.drain()
    bot.delivery.flush_archive()
    [storm] = bot.store.db.query("SELECT id FROM storms")
    card = [
        p.body["card"]
        for p in feishu.bot_posts(hook)
        if "STORM" in p.body["card"]["header"]["title"]["content"]
    ]
    buttons = [b for e in card[0]["elements"] if e["tag"] == "action" for b in e["actions"]]
    [listing] = [b for b in buttons if b["url"] == sheet_url]
    assert f"storm s{storm['id']}" in listing["text"]["content"]
    rows = [row for record in feishu.select("sheet") for row in record.body["valueRange"]["values"]]
    in_storm = {row[5] for row in rows if row[3] == f"firing in storm s{storm['id']}"}
    alone = {row[5] for row in rows if row[3] == "firing"}
    assert in_storm | alone == {f"gpu-{i}:9450" for i in range(250)} and len(in_storm) > 200
