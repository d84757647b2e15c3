"""The `megatrace alertbot` subcommand: run the service, or write (and optionally send) a report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from zoneinfo import ZoneInfo

from megatrace.alertbot import config as bot_config
from megatrace.alertbot.kinds import OPEN_STATES, OutboxState


def _date(value: str) -> str:
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a date like 2026-11-16 or 2026-11-16T09:00, got {value!r}"
        ) from None
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "alertbot",
        help="run the alert bot (Alertmanager webhook → Feishu), or write its weekly report",
        description="Receive Alertmanager webhooks, dedupe and grade them, deliver to Feishu (or the "
        "console), drill down into hangs, and write weekly reports.",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML configuration (see docs/alertbot.md)")
    parser.add_argument("--listen", metavar="HOST:PORT", help="override `listen` (default 127.0.0.1:9451)")
    parser.set_defaults(func=run_service)
    sub = parser.add_subparsers(dest="alertbot_command", metavar="ACTION")
    report = sub.add_parser(
        "report",
        help="write the alert report workbook for a period",
        description="Write the .xlsx report of the alert episodes that started in [--since, --until).",
    )
    report.add_argument("--config", dest="report_config", metavar="FILE", help="YAML configuration")
    report.add_argument("--since", required=True, type=_date, help="start (ISO date/time, report time zone)")
    report.add_argument("--until", required=True, type=_date, help="end, exclusive (ISO date/time)")
    report.add_argument("--output", metavar="FILE", help="workbook path (default: report.directory/…)")
    report.add_argument(
        "--send", action="store_true", help="also deliver it (Feishu file + card, or console)"
    )
    report.set_defaults(func=run_report)


def _load(args: argparse.Namespace, path: str | None, serving: bool = True) -> bot_config.AlertbotConfig:
    overrides = {"listen": args.listen} if getattr(args, "listen", None) else None
    return bot_config.load(path, overrides, serving)


def run_service(args: argparse.Namespace) -> int:
    from megatrace.alertbot.service import Service
    from megatrace.alertbot.store import StoreError

    cfg = _load(args, args.config)
    try:
        service = Service(cfg)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"megatrace alertbot: cannot start: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except StoreError as exc:
        print(f"megatrace alertbot: cannot start: {exc}", file=sys.stderr)
        return 1
    service.run_forever()
    return 0


def run_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatrace.alertbot.report import weekly_report, write_workbook
    from megatrace.alertbot.service import Service

    cfg = _load(args, args.report_config or args.config, serving=False)
    zone = ZoneInfo(cfg.report.timezone)
    since = datetime.fromisoformat(args.since).replace(tzinfo=zone)
    until = datetime.fromisoformat(args.until).replace(tzinfo=zone)
    if until <= since:
        print("megatrace alertbot report: --until must be after --since", file=sys.stderr)
        return 2
    if not args.send:  # read only: safe beside a running bot that writes the same database
        from megatrace.alertbot.store import StoreError, sqlite_store

        try:
            store = sqlite_store(cfg.store.path, read_only=True)
        except StoreError as exc:
            print(f"megatrace alertbot report: {exc}", file=sys.stderr)
            return 1
        name = f"megatrace-alerts-{since:%Y%m%d}-{until:%Y%m%d}.xlsx"
        path = Path(args.output) if args.output else Path(cfg.report.directory) / name
        try:
            r = cfg.report
            report = weekly_report(store, since.timestamp(), until.timestamp(), r.top_n, r.timezone)
            summary = write_workbook(report, path)
        finally:
            store.close()
        print(json.dumps({"path": str(path), "episodes": summary["total"]}))
        return 0
    if args.output:
        cfg.report.directory = str(Path(args.output).parent)
    service = Service(cfg, listen=False)  # a running bot may hold the port, and may deliver these too
    summary = service.queue_report(since, until, on_demand=True)
    deadline = time.monotonic() + 120

    def undelivered() -> int:
        rows = [service.store.outbox.get(i) for i in summary["outbox"]]
        return sum(1 for row in rows if row is not None and row.state in OPEN_STATES)

    while undelivered() and time.monotonic() < deadline:
        service.delivery.deliver_due(only=summary["outbox"])
        time.sleep(0.2)
    left = undelivered()
    dead = [
        i for i in summary["outbox"] if (row := service.store.outbox.get(i)) and row.state == OutboxState.DEAD
    ]
    service.store.close()
    print(
        json.dumps({"path": summary["path"], "episodes": summary["total"], "undelivered": left + len(dead)})
    )
    return 1 if left or dead else 0
