"""The SQLite store (WAL, migrations, retention, in-doubt sends) and configuration checks."""

from __future__ import annotations

import io
import json
import logging
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest

from megatrace.alertbot.config import cron_trigger, load
from megatrace.alertbot.feishu import FeishuApp
from megatrace.alertbot.kinds import EpisodeStatus
from megatrace.alertbot.store import MIGRATIONS, StoreError, sqlite_store
from megatrace.config import ConfigError
from megatrace.logsetup import setup_logging
from tests.alertbot.conftest import Bot, alert, config, webhook
from tests.support.feishu_server import FeishuServer

T0 = 1_790_000_000.0


def test_store_is_wal_and_migrated_once(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path / "db" / "bot.db")
    assert store.db.journal_mode() == "wal"
    assert store.db.schema_version() == len(MIGRATIONS)
    store.inbox.add("webhook", "{}", T0)
    store.close()
    again = sqlite_store(tmp_path / "db" / "bot.db")
    assert again.db.schema_version() == len(MIGRATIONS)
    assert len(again.db.query("SELECT * FROM inbox")) == 1
    assert [r[0] for r in again.db.query("SELECT version FROM schema_version")] == list(
        range(1, len(MIGRATIONS) + 1)
    )


def test_store_refuses_a_newer_schema(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path / "bot.db")
    store.db.run("INSERT INTO schema_version (version) VALUES (?)", (len(MIGRATIONS) + 1,))
    store.close()
    with pytest.raises(RuntimeError, match="newer than this bot"):
        sqlite_store(tmp_path / "bot.db")


def test_failed_transaction_leaves_nothing(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path / "bot.db")
    with pytest.raises(ZeroDivisionError), store.transaction():
        store.inbox.add("webhook", "{}", T0)
        _ = 1 / 0
    assert store.db.query("SELECT COUNT(*) FROM inbox")[0][0] == 0


def test_retention_deletes_finished_history_only(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    bot.receive(webhook(alert(job="old", starts_at=T0)), T0)
    bot.receive(webhook(alert(job="old", status="resolved", starts_at=T0, ends_at=T0 + 60)), T0 + 60)
    bot.drain()
    bot.receive(webhook(alert(job="open", starts_at=T0)), T0)  # still firing: kept
    bot.store.db.run("UPDATE outbox SET not_before = 1e12 WHERE state = 'pending'")  # undelivered: kept
    counts = bot.store.purge(T0 + 86400)
    assert counts["episodes"] == 1 and counts["outbox"] == 2 and counts["inbox"] == 3
    left = bot.store.db.query("SELECT labels FROM episodes")
    assert [json.loads(r["labels"])["job"] for r in left] == ["open"]
    assert bot.store.outbox.queue_depth() == 1


def test_retention_deletes_quarantined_episodes_like_resolved_ones(tmp_path: Path) -> None:
    """An episode reconciliation could not resolve is set aside as quarantined; it is finished
    history too, and was once kept for ever (the purge knew only 'resolved')."""
    bot = Bot(config(tmp_path, delivery={"report_only_levels": ["P0", "P1", "P2", "P3"]}))
    bot.receive(webhook(alert(job="lost", starts_at=T0)), T0)
    bot.receive(webhook(alert(job="open", starts_at=T0)), T0)
    [lost, _] = bot.store.episodes.firing()
    bot.store.episodes.update(lost.id, status=EpisodeStatus.QUARANTINED)
    assert bot.store.purge(T0 + 86400)["episodes"] == 1
    assert [e.job for e in bot.store.episodes.between(T0 - 1, T0 + 1)] == ["open"]


def test_in_doubt_group_bot_post_is_checked_in_chat_history(tmp_path: Path, feishu: FeishuServer) -> None:
    hook = feishu.add_bot(chat_id="oc_group")
    cfg = config(
        tmp_path,
        feishu={
            "base_url": feishu.url,
            "group_bots": {
                "P0": {"webhook": hook, "chat_id": "oc_group"},
                "P1": {"webhook": feishu.add_bot()},
            },
            "app": {"app_id": feishu.app_id, "app_secret": feishu.app_secret},
        },
    )
    bot = Bot(cfg)
    bot.receive(webhook(alert(job="a"), alert("MegatraceSlowRank", severity="P1", job="b")))
    rows = bot.store.outbox.due(1e12)
    for row in rows:  # the process "dies" after starting both sends; only the P0 one reached Feishu
        message = bot.delivery.render(row, T0)
        bot.store.outbox.begin_attempt(row.id, T0, message)
        if row.level == "P0":
            assert bot.delivery.send(row, message).ok
    assert bot.delivery.recover() == 2
    states = {r["level"]: r["state"] for r in bot.store.db.query("SELECT * FROM outbox")}
    assert states == {"P0": "sent", "P1": "pending"}  # P1's bot has no chat_id: re-sent (at least once)
    bot.drain()
    assert len(feishu.bot_posts(hook)) == 1 and len(feishu.bot_posts()) == 2


def test_in_doubt_post_is_found_past_the_first_page_of_chat_history(
    tmp_path: Path, feishu: FeishuServer
) -> None:
    hook = feishu.add_bot(chat_id="oc_busy")
    app = {"app_id": feishu.app_id, "app_secret": feishu.app_secret}
    cfg = config(
        tmp_path,
        feishu={
            "base_url": feishu.url,
            "group_bots": {"P0": {"webhook": hook, "chat_id": "oc_busy"}},
            "app": app,
        },
    )
    bot = Bot(cfg)
    chatter = FeishuApp(feishu.url, feishu.app_id, feishu.app_secret)
    for i in range(60):  # a busy chat: the card lands on the second page of its history
        assert chatter.send_message("oc_busy", "text", {"text": f"chatter {i}"}, f"chatter-{i}").ok
    bot.receive(webhook(alert(job="a")))
    [row] = bot.store.outbox.due(1e12)
    message = bot.delivery.render(row, T0)
    bot.store.outbox.begin_attempt(row.id, T0, message)
    assert bot.delivery.send(row, message).ok  # reached Feishu, then the process was killed
    for i in range(60, 63):
        assert chatter.send_message("oc_busy", "text", {"text": f"chatter {i}"}, f"chatter-{i}").ok
    assert bot.delivery.recover() == 1
    assert [r["state"] for r in bot.store.db.query("SELECT state FROM outbox")] == ["sent"]
    bot.drain()
    assert len(feishu.bot_posts(hook)) == 1


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bot.yaml"
    path.write_text("listen: 127.0.0.1:9451\n")
    with pytest.raises(ConfigError, match="key 'auth'"):
        load(path)
    path.write_text("auth: {bearer_token: tok-1234}\nfeishu: {group_bots: {P9: {webhook: http://x}}}\n")
    with pytest.raises(ConfigError, match=r"key 'feishu.group_bots.P9': not a level"):
        load(path)
    path.write_text("auth: {bearer_token: tok-1234}\ndedupe: {storm_threshold: many}\n")
    with pytest.raises(ConfigError, match=r"key 'dedupe.storm_threshold'"):
        load(path)
    path.write_text("auth: {bearer_token: tok-1234}\ndrilldown: {trace_roots: [relative/dir]}\n")
    with pytest.raises(ConfigError, match="not an absolute path"):
        load(path)
    path.write_text("auth: {bearer_token: tok-1234}\nfeishu: {app: {oncall: [ou_x]}}\n")
    with pytest.raises(ConfigError, match="phoning needs"):
        load(path)
    path.write_text("auth: {bearer_token: tok-1234}\nlisten: nowhere\n")
    with pytest.raises(ConfigError, match="key 'listen'"):
        load(path)


def test_environment_overrides_and_secrets_never_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "bot.yaml"
    path.write_text(
        "auth: {bearer_token: from-file-token}\nfeishu: {group_bots: {P0: {webhook: 'http://h/hook/abc123def'}}}\n"
    )
    monkeypatch.setenv("MEGATRACE_ALERTBOT_AUTH__BEARER_TOKEN", "env-token-5678")
    monkeypatch.setenv("MEGATRACE_ALERTBOT_FEISHU__GROUP_BOTS__P0__SECRET", "sign-secret-9")
    cfg = load(path)
    assert cfg.auth.bearer_token == "env-token-5678" and cfg.feishu.group_bots["P0"].secret == "sign-secret-9"
    stream = io.StringIO()
    setup_logging("info", "text", stream)
    logging.getLogger("megatrace.alertbot.test").info(
        "token env-token-5678 secret sign-secret-9 hook abc123def"
    )
    assert stream.getvalue().count("***") == 3
    assert "env-token-5678" not in stream.getvalue() and "abc123def" not in stream.getvalue()


def test_report_cron_reads_weekdays_as_cron_does(tmp_path: Path) -> None:
    sunday = datetime(2026, 11, 22, tzinfo=UTC)
    assert cron_trigger("0 9 * * 1", "UTC").get_next_fire_time(None, sunday) == datetime(
        2026, 11, 23, 9, tzinfo=UTC
    )
    assert cron_trigger("30 8 * * 0", "UTC").get_next_fire_time(None, sunday) == datetime(
        2026, 11, 22, 8, 30, tzinfo=UTC
    )
    friday = cron_trigger("0 18 * * 1-5/2", "UTC").get_next_fire_time(
        None, datetime(2026, 11, 26, 19, tzinfo=UTC)
    )
    assert friday == datetime(2026, 11, 27, 18, tzinfo=UTC)  # mon, wed, fri
    path = tmp_path / "bot.yaml"
    for bad in (
        "report: {cron: '0 9 * *'}",
        "report: {cron: '0 99 * * 1'}",
        "report: {timezone: Mars/Olympus}",
    ):
        path.write_text("auth: {bearer_token: tok-1234}\n" + bad + "\n")
        with pytest.raises(ConfigError, match="key 'report'"):
            load(path)


def test_read_only_store_reads_and_refuses_to_write(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    bot.receive(webhook(alert(job="llm")), T0)
    reader = sqlite_store(bot.cfg.store.path, read_only=True)
    try:
        assert [r.status for r in reader.episodes.between(T0 - 60, T0 + 60)] == ["firing"]
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.db.run("DELETE FROM episodes")
    finally:
        reader.close()
    assert len(bot.store.db.query("SELECT * FROM episodes")) == 1
    with pytest.raises(StoreError, match="no alert bot database"):
        sqlite_store(tmp_path / "missing.db", read_only=True)
    (tmp_path / "other.db").write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="not an alert bot database"):
        sqlite_store(tmp_path / "other.db", read_only=True)
    assert not (tmp_path / "missing.db").exists()


def test_a_row_is_claimed_by_one_sender_only(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    bot.receive(webhook(alert(job="llm")), T0)
    other = sqlite_store(bot.cfg.store.path)  # a second process sharing the database
    (row,) = bot.store.outbox.due(1e12)
    message = bot.delivery.render(row, T0)
    assert other.outbox.begin_attempt(row.id, T0, message) is not None
    assert bot.store.outbox.begin_attempt(row.id, T0, message) is None
    assert bot.delivery.deliver_due(T0 + 1) == 0 and bot.console() == []
    assert len(bot.store.outbox.attempts_of(row.id)) == 1
    other.close()
