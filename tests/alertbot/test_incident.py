"""One incident, one card: a job's hang alerts (the rules' `MegatraceJobHang` and per-rank
`MegatraceRankHang`) page once, name the culprit from the rules' labels or the drill-down's verdict,
and are updated — in place on the app channel (Feishu's message update), as one reply through a group
bot — when the verdict comes late and when the incident resolves. The on-call people are phoned once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatrace.alertbot.drilldown import DrilldownRunner
from megatrace.alertbot.report import weekly_report, write_workbook
from tests.alertbot.conftest import Bot, alert, config, wait_until, webhook
from tests.support.feishu_server import FeishuServer

T0 = 1_790_000_000.0
STUB = """
import json, pathlib, sys, time
gate, report = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
while not gate.exists():
    time.sleep(0.05)
print(report.read_text())
"""
VERDICT = {
    "verdict": "hang",
    "suspects": [
        {
            "rank": 5,
            "kind": "hang",
            "confidence": 0.8,
            "evidence": "rank 5 never entered step 7.",
            "host": "gpu-9",
        }
    ],
}


def job_hang(status: str = "firing", **culprit: str) -> dict:
    labels = {"culprit_rank": "unknown", "culprit_node": "unknown", "culprit_seen": "unknown", **culprit}
    return alert("MegatraceJobHang", status, ends_at=T0 + 300, job="llm-7", **labels)


def rank_hangs(status: str = "firing") -> list[dict]:
    return [alert(status=status, ends_at=T0 + 300, severity="P3", job="llm-7", rank=str(r)) for r in range(8)]


def drilldown(tmp_path: Path, wait: float, verdict: dict = VERDICT) -> tuple[dict, Path]:
    root = tmp_path / "traces"
    (root / "llm-7").mkdir(parents=True)
    gate = tmp_path / "gate"
    (tmp_path / "report.json").write_text(json.dumps(verdict))
    (tmp_path / "stub.py").write_text(STUB)
    command = [sys.executable, str(tmp_path / "stub.py"), str(gate), str(tmp_path / "report.json")]
    return {"trace_roots": [str(root)], "analyzer_command": command, "verdict_wait_s": wait}, gate


def verdict_delivered(tmp_path: Path, verdict: dict, **settings: object) -> tuple[Bot, DrilldownRunner]:
    """A bot (with `settings`) that took the job's hang alerts and delivered the card the drill-down's
    `verdict` makes; the runner is the caller's to shut down."""
    drill, gate = drilldown(tmp_path, wait=0.0, verdict=verdict)
    gate.touch()
    bot = Bot(config(tmp_path, drilldown=drill, **settings))
    runner = DrilldownRunner(bot.pipeline, bot.cfg.drilldown, bot.metrics)
    bot.receive(webhook(job_hang(), *rank_hangs()), T0)
    bot.drain()
    (row,) = bot.store.incidents.pending_drilldowns()
    runner.run(row.id)
    bot.drain()
    return bot, runner


def title(card: dict) -> str:
    return card["header"]["title"]["content"]


def text(card: dict) -> str:
    return card["elements"][0]["text"]["content"]


def late_verdict_then_resolve(bot: Bot, gate: Path) -> None:
    """Fire the hang, let its card go out before the verdict, then the verdict, then the resolve."""
    runner = DrilldownRunner(bot.pipeline, bot.cfg.drilldown, bot.metrics)
    bot.receive(webhook(job_hang(), *rank_hangs()), T0)
    runner.submit_pending()
    bot.drain()
    gate.touch()
    wait_until(lambda: bot.store.outbox.queue_depth(), what="the verdict queued")
    bot.drain()
    bot.receive(webhook(job_hang("resolved"), *rank_hangs("resolved")), T0 + 300)
    bot.drain()
    runner.shutdown()


def test_app_channel_pages_once_and_updates_the_card_in_place(tmp_path: Path, feishu: FeishuServer) -> None:
    settings, gate = drilldown(tmp_path, wait=0.3)
    app = {
        "app_id": feishu.app_id,
        "app_secret": feishu.app_secret,
        "chats": {"P0": "oc_p0"},
        "oncall": ["ou_a"],
    }
    bot = Bot(config(tmp_path, feishu={"base_url": feishu.url, "app": app}, drilldown=settings))
    late_verdict_then_resolve(bot, gate)
    (message,) = feishu.messages("oc_p0")  # the per-rank P3 alerts joined no card of their own
    assert title(message.body["content"]) == "[P0] FIRING: job llm-7 hangs — culprit not known yet"
    assert len(feishu.select("urgent_phone")) == 1
    verdict, resolved = (r.body["card"] for r in feishu.select("update", message.message_id))
    assert title(verdict) == "[P0] FIRING: rank 5 hung on gpu-9 — job llm-7"
    assert "**Culprit**: rank **5** on node **gpu-9** (confidence 80%)" in text(verdict)
    assert "**Seen**: rank 5 never entered step 7." in text(verdict)
    assert title(resolved) == "[P0] RESOLVED: rank 5 hung on gpu-9 — job llm-7"
    assert resolved["header"]["template"] == "green" and "**Resolved** after 5m" in text(resolved)
    assert feishu.rejections == []
    assert [r["state"] for r in bot.store.db.query("SELECT state FROM outbox")] == ["sent"] * 4
    # the report-only per-rank alerts have no card to put a verdict on: one drill-down, for the job's
    assert [r["alertname"] for r in bot.store.db.query("SELECT alertname FROM drilldowns")] == [
        "MegatraceJobHang"
    ]


def test_group_bot_gets_one_reply_per_change(tmp_path: Path, feishu: FeishuServer) -> None:
    settings, gate = drilldown(tmp_path, wait=0.3)
    hook = feishu.add_bot(chat_id="oc_group")
    bot = Bot(
        config(
            tmp_path,
            feishu={"base_url": feishu.url, "group_bots": {"P0": {"webhook": hook}}},
            drilldown=settings,
        )
    )
    late_verdict_then_resolve(bot, gate)
    posts = [title(p.body["card"]) for p in feishu.bot_posts(hook)]
    assert posts == [
        "[P0] FIRING: job llm-7 hangs — culprit not known yet",
        "[P0] VERDICT: rank 5 hung on gpu-9 — job llm-7",
        "[P0] RESOLVED: rank 5 hung on gpu-9 — job llm-7",
    ]
    first, *replies = (
        p.body["card"]["elements"][-1]["elements"][0]["content"] for p in feishu.bot_posts(hook)
    )
    card_ref = first.removeprefix("megatrace ref ")
    # each reply has a ref of its own (crash recovery looks for it) and names the card it follows
    assert [reply.endswith(f" (follows {card_ref})") for reply in replies] == [True, True]
    assert len({reply.split()[2] for reply in replies} | {card_ref}) == 3


def test_a_culprit_the_rules_name_goes_out_at_once(tmp_path: Path) -> None:
    settings, _ = drilldown(tmp_path, wait=300)
    bot = Bot(config(tmp_path, drilldown=settings))
    hang = job_hang(culprit_rank="3", culprit_node="gpu-7", culprit_seen="dead")
    bot.receive(webhook(hang, *rank_hangs()), T0)
    assert bot.delivery.deliver_due() == 1  # no wait for the drill-down
    (card,) = bot.console()
    assert title(card["card"]) == "[P0] FIRING: rank 3 hung on gpu-7 — job llm-7"
    body = text(card["card"])
    assert "**Seen**: Rank 3 stopped: its process is gone or no longer reports" in body
    assert "**Do first**: Drain node gpu-7, then restart job llm-7 from its last checkpoint." in body


def test_a_later_alert_naming_the_culprit_updates_the_card(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))  # no drill-down configured: only the rules can name the culprit
    bot.receive(webhook(alert(job="llm-7", rank="0")), T0)
    bot.drain()
    bot.receive(webhook(job_hang(culprit_rank="3", culprit_node="gpu-7", culprit_seen="awaited")), T0 + 5)
    bot.drain()
    first, update = bot.console()
    assert title(first["card"]) == "[P0] FIRING: job llm-7 hangs — culprit not known yet"
    assert (
        update["kind"] == "verdict"
        and title(update["card"]) == "[P0] FIRING: rank 3 hung on gpu-7 — job llm-7"
    )
    assert "**Also alerting**: rank 0" in text(update["card"])


def test_refs_differ_across_runs_of_a_fresh_bot(tmp_path: Path) -> None:
    """A fresh database numbers its alerts and storms from 1 again: the refs (Feishu's `uuid`, which
    Feishu sends once an hour) must not repeat, or the second run's cards would be dropped."""
    refs = []
    for run, start in enumerate((T0, T0 + 600)):
        bot = Bot(config(tmp_path / str(run), dedupe={"storm_threshold": 1, "storm_hold_s": 0}))
        hangs = [alert(job=f"llm-{j}", rank="0", starts_at=start) for j in range(3)]
        bot.receive(webhook(*hangs), start)
        bot.drain()
        refs.append([line["card"]["elements"][-1]["elements"][0]["content"] for line in bot.console()])
    assert [line.split()[0] for line in refs[0]] == ["megatrace"] * 2  # a card, then the storm's
    assert not set(refs[0]) & set(refs[1])


def test_p3_is_never_phoned(tmp_path: Path, feishu: FeishuServer) -> None:
    level = "P3"
    app = {
        "app_id": feishu.app_id,
        "app_secret": feishu.app_secret,
        "chats": {level: "oc_low"},
        "oncall": ["ou_a"],
        "phone_levels": [level],
    }
    cfg = config(tmp_path, feishu={"base_url": feishu.url, "app": app}, delivery={"report_only_levels": []})
    bot = Bot(cfg)
    bot.receive(webhook(alert("DiskFilling", severity=level, instance="gpu-1:9100")), T0)
    bot.drain()
    assert len(feishu.messages("oc_low")) == 1 and feishu.select("urgent_phone") == []


def test_incidents_whose_card_was_a_storm_close_and_a_new_hang_opens_a_new_one(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path, dedupe={"storm_threshold": 1, "storm_hold_s": 0}))
    hangs = [alert(job=f"llm-{j}", rank="0") for j in range(3)]
    bot.receive(webhook(*hangs), T0)
    bot.receive(
        webhook(*({**h, "status": "resolved", "endsAt": "2026-09-21T12:00:00Z"} for h in hangs)), T0 + 60
    )
    assert [row["closed_at"] for row in bot.store.db.query("SELECT * FROM incidents")] == [T0 + 60] * 3
    bot.receive(webhook(alert(job="llm-2", rank="0", starts_at=T0 + 600)), T0 + 600)
    assert len(bot.store.db.query("SELECT * FROM incidents")) == 4


def test_a_node_name_from_the_verdict_replaces_a_scrape_address(tmp_path: Path) -> None:
    settings, gate = drilldown(tmp_path, wait=300)
    gate.touch()
    bot = Bot(config(tmp_path, drilldown=settings))
    runner = DrilldownRunner(bot.pipeline, bot.cfg.drilldown, bot.metrics)
    slow = alert("MegatraceSlowRank", severity="P1", job="llm-7", rank="5", instance="10.0.0.7:9450")
    bot.receive(webhook(slow), T0)
    assert bot.delivery.deliver_due() == 1  # the rank is in the alert: no wait
    runner.submit_pending()
    wait_until(lambda: bot.store.outbox.queue_depth(), what="the verdict queued")
    bot.drain()
    first, update = bot.console()
    assert title(first["card"]) == "[P1] FIRING: rank 5 is slow on 10.0.0.7 — job llm-7"
    assert title(update["card"]) == "[P1] FIRING: rank 5 is slow on gpu-9 — job llm-7"
    runner.shutdown()


def test_a_verdict_after_the_card_was_frozen_comes_as_its_update(
    tmp_path: Path, feishu: FeishuServer
) -> None:
    """The card's first attempt failed (its content is frozen, it waits to be retried) when the
    verdict comes: the verdict is not lost, it updates the card once the card is through."""
    settings, gate = drilldown(tmp_path, wait=0.0)
    gate.touch()
    app = {"app_id": feishu.app_id, "app_secret": feishu.app_secret, "chats": {"P0": "oc_p0"}}
    bot = Bot(config(tmp_path, feishu={"base_url": feishu.url, "app": app}, drilldown=settings))
    runner = DrilldownRunner(bot.pipeline, bot.cfg.drilldown, bot.metrics)
    feishu.fail("message", "server_error")
    bot.receive(webhook(job_hang()), T0)
    assert bot.delivery.deliver_due() == 1
    assert bot.store.db.query("SELECT state FROM outbox")[0]["state"] == "pending"  # to be retried
    (row,) = bot.store.incidents.pending_drilldowns()
    runner.run(row.id)
    bot.drain()
    (message,) = feishu.messages("oc_p0")
    assert title(message.body["content"]) == "[P0] FIRING: job llm-7 hangs — culprit not known yet"
    (update,) = feishu.select("update", message.message_id)
    assert title(update.body["card"]) == "[P0] FIRING: rank 5 hung on gpu-9 — job llm-7"
    runner.shutdown()


TIE = "these Flight Recorder dumps record no pipeline send or receive"
TIED_VERDICT = {
    "verdict": "hang",
    "suspects": [
        {"rank": r, "kind": "hang", "confidence": 0.5, "evidence": f"rank {r} never issued it.", "tied": True}
        for r in (0, 4)
    ],
    "tie": {"ranks": [0, 4], "reason": f"ranks 0, 4 are tied: {TIE}"},
}


def test_a_tied_verdict_names_both_ranks_and_why(tmp_path: Path, feishu: FeishuServer) -> None:
    """The analyzer could not tell the hung rank from its pipeline neighbour: the card says "rank 0 or
    rank 4" and why, with no confidence (it used to name suspects[0], rank 0, at 50 %)."""
    app = {"app_id": feishu.app_id, "app_secret": feishu.app_secret, "chats": {"P0": "oc_p0"}}
    runner = verdict_delivered(tmp_path, TIED_VERDICT, feishu={"base_url": feishu.url, "app": app})[1]
    (message,) = feishu.messages("oc_p0")
    (update,) = feishu.select("update", message.message_id)
    card = update.body["card"]
    assert title(card) == "[P0] FIRING: rank 0 or rank 4 hung — job llm-7"
    assert "**Culprit**: rank **0** or rank **4** (tied: the traces cannot tell them apart)" in text(card)
    assert f"**Why tied**: ranks 0, 4 are tied: {TIE}" in text(card)
    assert "confidence" not in text(card)
    runner.shutdown()


def test_incidents_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    """The same card and workbook from the PostgreSQL store that replicas share."""
    bot = Bot(config(tmp_path, store={"url": pg_url}))
    bot.receive(webhook(alert(job="llm-7", rank="0")), T0)
    bot.drain()
    culprit = {"culprit_rank": "3", "culprit_node": "gpu-7", "culprit_seen": "lagging"}
    bot.receive(webhook(job_hang(**culprit)), T0 + 5)
    bot.drain()
    bot.receive(webhook(alert(job="llm-7", rank="0", status="resolved", ends_at=T0 + 60)), T0 + 60)
    bot.receive(webhook(job_hang("resolved", **culprit)), T0 + 300)
    bot.drain()
    assert [(line["kind"], title(line["card"])) for line in bot.console()] == [
        ("firing", "[P0] FIRING: job llm-7 hangs — culprit not known yet"),
        ("verdict", "[P0] FIRING: rank 3 hung on gpu-7 — job llm-7"),
        ("resolved", "[P0] RESOLVED: rank 3 hung on gpu-7 — job llm-7"),
    ]
    summary = write_workbook(weekly_report(bot.store, T0 - 60, T0 + 3600), tmp_path / "week.xlsx")
    assert summary["total"] == 1


def test_a_lost_node_named_by_the_rules_keeps_the_card_whatever_the_drill_down_could_collect(
    tmp_path: Path,
) -> None:
    """The culprit's whole node is gone: the rules name it (`lost`); the drill-down reached none of its
    ranks, so its verdict names nobody, and the card keeps the rules' culprit."""
    settings, _ = drilldown(tmp_path, wait=300)
    bot = Bot(config(tmp_path, drilldown=settings))
    hang = job_hang(culprit_rank="2", culprit_node="node-b", culprit_seen="lost")
    bot.receive(webhook(hang, *rank_hangs()), T0)
    verdict = {
        "verdict": "inconclusive",
        "suspects": [],
        "uncollected_ranks": [2, 3],
        "no_data": [{"reason": "agent on node-b (10.0.0.3:9452): timed out after 3 tries", "ranks": [2, 3]}],
    }
    (page,) = bot.store.db.query("SELECT id FROM incidents WHERE level = 'P0'")
    bot.store.incidents.update(page["id"], verdict=json.dumps(verdict))
    (row,) = bot.store.outbox.find(kind="firing", level="P0")
    card = bot.delivery.render(row, T0 + 5)["card"]
    assert title(card) == "[P0] FIRING: rank 2 hung on node-b — job llm-7"
    body = text(card)
    assert "**Culprit**: rank **2** on node **node-b**" in body
    assert "**Seen**: Node node-b is lost: its agent stopped answering" in body
    assert "- ranks 2-3: agent on node-b (10.0.0.3:9452): timed out after 3 tries" in body
