"""When a demo step fails, the printed diagnostics say what the alert bot was doing."""

from __future__ import annotations

import json
from pathlib import Path

from megatrace.alertbot.kinds import DrilldownState, NotificationKind, OutboxState
from megatrace.alertbot.store import sqlite_store
from megatrace.alertbot.store.records import NewNotification
from megatrace.demo import bot_diagnostics, card_text


def test_diagnostics_name_stuck_drilldowns_undelivered_messages_and_log_errors(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path / "alertbot.sqlite3")
    hang = store.incidents.add_drilldown("demo-hang", "MegatraceRankHang", 1, now=1000.0)
    store.incidents.update_drilldown(
        hang, state=DrilldownState.DONE, result=json.dumps({"verdict": "hang", "suspects": []})
    )
    store.incidents.add_drilldown("demo-slow", "MegatraceSlowRank", 2, now=1100.0)
    sent = {"channel": "console", "destination": "-", "level": "P1", "created_at": 1.0, "not_before": 1.0}
    first = store.outbox.enqueue(NewNotification(kind=NotificationKind.FIRING, idem_key="a", **sent))
    assert first is not None
    store.outbox.update(first, state=OutboxState.SENT)
    failing = store.outbox.enqueue(NewNotification(kind=NotificationKind.VERDICT, idem_key="b", **sent))
    assert failing is not None
    store.outbox.update(failing, attempts=3, last_error="HTTP 502")
    store.close()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "alertbot.log").write_text(
        "2026-11-22 03:30:00,353 INFO    megatrace.alertbot.service: listening\n"
        "2026-11-22 03:31:00,000 ERROR   megatrace.alertbot.drilldown: drill-down 2 failed\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in run\n'
        "OSError: disk full\n"
    )

    lines = bot_diagnostics(tmp_path, now=1160.0)

    assert lines[0] == "drill-down 1 of job demo-hang (MegatraceRankHang): done, requested 160s ago; hang"
    assert lines[1] == "drill-down 2 of job demo-slow (MegatraceSlowRank): pending, requested 60s ago"
    assert lines[2] == "message 2 (verdict P1): pending after 3 attempt(s); HTTP 502"
    assert lines[3].startswith("alertbot.log: ") and "drill-down 2 failed" in lines[3]
    assert lines[4:6] == [
        "alertbot.log: Traceback (most recent call last):",
        'alertbot.log:   File "x.py", line 1, in run',
    ]
    assert lines[6] == "alertbot.log: OSError: disk full"
    assert len(lines) == 7


def test_diagnostics_without_a_bot_database_say_so(tmp_path: Path) -> None:
    assert bot_diagnostics(tmp_path) == [
        f"alert bot database: {tmp_path / 'alertbot.sqlite3'}: no alert bot database here (store.path)"
    ]


def test_card_text_shows_escaped_markup_as_feishu_renders_it() -> None:
    message = {
        "card": {
            "header": {"title": {"tag": "plain_text", "content": "[P0] FIRING: rank 2 hung"}},
            "elements": [{"tag": "div", "text": {"tag": "lark_md", "content": "communicator &#91;0,1&#93;"}}],
        }
    }
    assert card_text(message) == "[P0] FIRING: rank 2 hung\ncommunicator [0,1]"
