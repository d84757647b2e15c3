"""The weekly report: an .xlsx workbook (openpyxl) of the alert episodes in a period — a Summary
sheet (episodes by day and level with a chart, top recurring alerts, top nodes, time to resolve) and
a Detail sheet with one row per episode, filterable, its columns sized to their contents — plus the
figures for the summary card. An incident (a job's hang or slow alerts, one card) counts once: as
its first alert, lasting until its last resolved, with its culprit and how many alerts it held."""

from __future__ import annotations

import collections
import dataclasses
import io
import statistics
import zipfile
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from openpyxl import Workbook
from openpyxl.chart import BarChart, Reference
from openpyxl.styles import Font

from megatrace.alertbot.config import LEVELS, OncallConfig
from megatrace.alertbot.incident import cause_text, node_of
from megatrace.alertbot.incident import load as load_incident
from megatrace.alertbot.kinds import EpisodeStatus
from megatrace.alertbot.oncall import rotation
from megatrace.alertbot.store import Store
from megatrace.alertbot.store.records import Action, Episode

DETAIL_COLUMNS = (
    "Episode",
    "Alert",
    "Level",
    "Severity label",
    "Status",
    "Started",
    "Ended",
    "Minutes to resolve",
    "Job",
    "Node",
    "Culprit",
    "Cause",
    "Alerts",
    "Summary",
    "Recurrence",
    "Escalated",
    "Flapping",
    "Duplicates",
    "Fingerprint",
)


MAX_WIDTH = 60


def counted_once(store: Store, since: float, until: float) -> list[tuple[Episode, str, str, int]]:
    """The episodes starting in [since, until) with an incident's other alerts folded into its first:
    (episode, culprit, cause, alerts), where an incident's row ends when the incident did and its
    cause is the drill-down's class and evidence about the culprit ("" when none was named)."""
    incidents = {row.lead_episode_id: row for row in store.incidents.led_between(since, until)}
    found = []
    for row in store.episodes.between(since, until):
        if row.incident_id is None:
            found.append((row, "", "", 1))
            continue
        incident = incidents.get(row.id)
        if incident is None:  # another alert of an incident: counted with its first
            continue
        shown = load_incident(store, incident.id)
        culprit = shown.culprit if shown else None
        named = culprit.named + (f" on {culprit.node}" if culprit.node else "") if culprit else ""
        closed = shown is not None and shown.closed
        episode = dataclasses.replace(
            row,
            status=EpisodeStatus.RESOLVED if closed else EpisodeStatus.FIRING,
            ends_at=shown.ended if shown is not None and closed else None,
        )
        cause = cause_text(shown) if shown else ""
        found.append((episode, named, cause, len(store.incidents.members(incident.id))))
    return found


def size_columns(sheet: Any) -> None:
    """Each column as wide as its longest value (at most MAX_WIDTH characters)."""
    for column in sheet.columns:
        longest = max((len(str(cell.value)) for cell in column if cell.value is not None), default=0)
        sheet.column_dimensions[column[0].column_letter].width = min(MAX_WIDTH, longest + 2)


def text_only(sheet: Any) -> None:
    """Every text cell stays text: openpyxl makes a string starting with ``=`` a formula, and alert
    text (a summary, a label) is data that must never run in the reader's spreadsheet program."""
    for row in sheet.iter_rows():
        for cell in row:
            if isinstance(cell.value, str):
                cell.data_type = "s"


def saved(book: Workbook) -> bytes:
    """The workbook's bytes, each carriage return in a sheet's text written as ``&#13;``: openpyxl
    writes it raw, and an XML reader turns a raw one into a line feed (attributes never hold one)."""
    raw, out = io.BytesIO(), io.BytesIO()
    book.save(raw)
    with zipfile.ZipFile(raw) as source, zipfile.ZipFile(out, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename.startswith("xl/worksheets/"):
                data = data.replace(b"\r", b"&#13;")
            target.writestr(item, data)
    return out.getvalue()


def _minutes(row: Episode) -> float | None:
    return None if row.ends_at is None else round((row.ends_at - row.starts_at) / 60, 1)


def _local(epoch: float | None, zone: ZoneInfo) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, zone).replace(tzinfo=None, microsecond=0)


def _bold_row(sheet: Any, values: list[Any]) -> None:
    sheet.append(values)
    for cell in sheet[sheet.max_row]:
        cell.font = Font(bold=True)


@dataclasses.dataclass(frozen=True)
class WeeklyReport:
    """What the weekly workbook shows, computed from the store before anything is written."""

    since: float
    until: float
    timezone: str
    days: list[date]
    by_day: dict[date, collections.Counter[str]]
    by_level: collections.Counter[str]
    top_alerts: list[tuple[str, int]]
    top_nodes: list[tuple[str, int]]
    resolve_times: list[list[object]]  # per level: resolved, median, 90th percentile, unresolved
    detail: list[list[object]]
    duty: list[list[object]]  # per day: primary, then the rest
    actions: list[Action]
    durations: list[float]


def weekly_report(
    store: Store,
    since: float,
    until: float,
    top_n: int = 10,
    timezone: str = "UTC",
    oncall: OncallConfig | None = None,
) -> WeeklyReport:
    """The report of episodes starting in [since, until), with who was on call each day."""
    zone = ZoneInfo(timezone)
    counted = counted_once(store, since, until)
    rows = [episode for episode, _, _, _ in counted]
    first_day = datetime.fromtimestamp(since, zone).date()
    last_day = datetime.fromtimestamp(max(since, until - 1), zone).date()
    days = [first_day + timedelta(days=i) for i in range((last_day - first_day).days + 1)]
    by_day: dict[date, collections.Counter[str]] = {day: collections.Counter() for day in days}
    for row in rows:
        by_day[datetime.fromtimestamp(row.starts_at, zone).date()][row.level] += 1
    resolve_times: list[list[object]] = []
    for level in LEVELS:
        durations = sorted(m for r in rows if r.level == level and (m := _minutes(r)) is not None)
        unresolved = sum(1 for r in rows if r.level == level and r.ends_at is None)
        median = round(statistics.median(durations), 1) if durations else None
        p90 = durations[min(len(durations) - 1, int(0.9 * len(durations)))] if durations else None
        resolve_times.append([level, len(durations), median, p90, unresolved])
    detail: list[list[object]] = [
        [
            row.id,
            row.alertname,
            row.level,
            row.severity,
            str(row.status),
            _local(row.starts_at, zone),
            _local(row.ends_at, zone),
            _minutes(row),
            row.labels.get("job", ""),
            node_of(row.labels),
            culprit,
            cause,
            alerts,
            row.annotations.get("summary", ""),
            row.recurrence,
            "yes" if row.escalated else "",
            "yes" if row.flapping else "",
            row.duplicates,
            row.fingerprint,
        ]
        for row, culprit, cause, alerts in counted
    ]
    duty: list[list[object]] = []
    for day in days:
        noon = datetime.combine(day, datetime.min.time(), zone).timestamp() + 12 * 3600
        order = [p.name for p in rotation(oncall, noon)] if oncall else []
        duty.append([day.isoformat(), order[0] if order else "", ", ".join(order[1:])])
    return WeeklyReport(
        since=since,
        until=until,
        timezone=timezone,
        days=days,
        by_day=by_day,
        by_level=collections.Counter(r.level for r in rows),
        top_alerts=collections.Counter(r.alertname for r in rows).most_common(top_n),
        top_nodes=collections.Counter(n for n in (node_of(r.labels) for r in rows) if n).most_common(top_n),
        resolve_times=resolve_times,
        detail=detail,
        duty=duty,
        actions=store.coordination.actions_between(since, until),
        durations=[m for r in rows if (m := _minutes(r)) is not None],
    )


def write_workbook(report: WeeklyReport, path: Path) -> dict[str, Any]:
    """Write the report's workbook to `path`; returns its summary (what the report card shows). Its
    "On call" sheet lists who was primary each day and every on-call action (notes included)."""
    zone = ZoneInfo(report.timezone)
    total = sum(report.by_level.values())
    book = Workbook()
    summary = book.active
    summary.title = "Summary"
    summary.append(["Megatrace alert report"])
    summary["A1"].font = Font(bold=True, size=14)
    summary.append(
        [
            "From",
            _local(report.since, zone),
            "Until",
            _local(report.until, zone),
            "Time zone",
            report.timezone,
        ]
    )
    summary.append([])
    _bold_row(summary, ["Day", *LEVELS, "Total"])
    table_top = summary.max_row
    for day in report.days:
        counts = report.by_day[day]
        summary.append([day.isoformat(), *(counts[level] for level in LEVELS), sum(counts.values())])
    _bold_row(summary, ["Total", *(report.by_level[level] for level in LEVELS), total])
    table_bottom = summary.max_row - 1

    summary.append([])
    _bold_row(summary, ["Top recurring alerts", "Episodes"])
    for name, count in report.top_alerts:
        summary.append([name, count])
    summary.append([])
    _bold_row(summary, ["Top nodes", "Episodes"])
    for name, count in report.top_nodes:
        summary.append([name, count])
    summary.append([])
    _bold_row(
        summary, ["Time to resolve", "Resolved", "Median minutes", "90th percentile minutes", "Unresolved"]
    )
    for line in report.resolve_times:
        summary.append(line)

    chart = BarChart()
    chart.type = "col"
    chart.grouping = "stacked"
    chart.overlap = 100
    chart.title = "Alert episodes per day"
    chart.y_axis.title = "episodes"
    data = Reference(summary, min_col=2, max_col=1 + len(LEVELS), min_row=table_top, max_row=table_bottom)
    chart.add_data(data, titles_from_data=True)
    chart.set_categories(Reference(summary, min_col=1, min_row=table_top + 1, max_row=table_bottom))
    summary.add_chart(chart, "H4")
    summary.column_dimensions["A"].width = 28

    detail = book.create_sheet("Detail")
    _bold_row(detail, list(DETAIL_COLUMNS))
    for line in report.detail:
        detail.append(line)
    detail.freeze_panes = "A2"
    detail.auto_filter.ref = detail.dimensions
    size_columns(detail)
    duty = book.create_sheet("On call")
    _bold_row(duty, ["Day", "Primary", "Then"])
    for line in report.duty:
        duty.append(line)
    duty.append([])
    _bold_row(duty, ["Time", "Who", "Action", "Alert", "Detail", "From"])
    for action in report.actions:
        duty.append(
            [
                _local(action.at, zone),
                action.actor_name,
                action.action,
                action.episode_id,
                action.detail,
                action.source,
            ]
        )
    size_columns(duty)
    for sheet in book.worksheets:
        text_only(sheet)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(saved(book))
    first_day, last_day = report.days[0], report.days[-1]
    return {
        "title": f"Megatrace weekly alert report {first_day.isoformat()} – {last_day.isoformat()}",
        "since": first_day.isoformat(),
        "until": last_day.isoformat(),
        "total": total,
        "by_level": [(level, report.by_level[level]) for level in LEVELS],
        "top": report.top_alerts[:5],
        "mttr": f"{statistics.median(report.durations):.1f} min" if report.durations else "",
        "actions": len(report.actions),
        "notes": sum(1 for a in report.actions if a.action == "note"),
        "file_name": path.name,
        "path": str(path),
    }
