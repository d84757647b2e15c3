"""The weekly report: an .xlsx workbook (openpyxl) of the alert episodes in a period — a Summary
sheet (episodes by day and level with a chart, top recurring alerts, top nodes, time to resolve) and
a Detail sheet with one row per episode, filterable, its columns sized to their contents — plus the
figures for the summary card. An incident (a job's hang or slow alerts, one card) counts once: as
its first alert, lasting until its last resolved, with its culprit and how many alerts it held."""

from __future__ import annotations

import collections
import io
import json
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
from megatrace.alertbot.incident import load as load_incident
from megatrace.alertbot.incident import node_of
from megatrace.alertbot.oncall import rotation
from megatrace.alertbot.store import Store

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
    "Alerts",
    "Summary",
    "Recurrence",
    "Escalated",
    "Flapping",
    "Duplicates",
    "Fingerprint",
)


MAX_WIDTH = 60


def counted_once(store: Store, since: float, until: float) -> list[tuple[dict[str, Any], str, int]]:
    """The episodes starting in [since, until) with an incident's other alerts folded into its first:
    (episode, culprit, alerts), where an incident's row ends when the incident did."""
    incidents = {row["lead_episode_id"]: row for row in store.incidents_led_between(since, until)}
    found = []
    for row in store.episodes_between(since, until):
        if row["incident_id"] is None:
            found.append((dict(row), "", 1))
            continue
        incident = incidents.get(row["id"])
        if incident is None:  # another alert of an incident: counted with its first
            continue
        shown = load_incident(store, incident["id"])
        culprit = shown.culprit if shown else None
        named = culprit.named + (f" on {culprit.node}" if culprit.node else "") if culprit else ""
        closed = shown is not None and shown.closed
        episode = dict(row) | {
            "status": "resolved" if closed else "firing",
            "ends_at": shown.ended if closed else None,
        }
        found.append((episode, named, len(store.incident_members(incident["id"]))))
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


def _minutes(row: Any) -> float | None:
    return None if row["ends_at"] is None else round((row["ends_at"] - row["starts_at"]) / 60, 1)


def _local(epoch: float | None, zone: ZoneInfo) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, zone).replace(tzinfo=None, microsecond=0)


def _bold_row(sheet: Any, values: list[Any]) -> None:
    sheet.append(values)
    for cell in sheet[sheet.max_row]:
        cell.font = Font(bold=True)


def build_report(
    store: Store,
    since: float,
    until: float,
    path: Path,
    top_n: int = 10,
    timezone: str = "UTC",
    oncall: OncallConfig | None = None,
) -> dict[str, Any]:
    """Write the workbook for episodes starting in [since, until) to `path`; returns its summary.
    Its "On call" sheet lists who was primary each day and every on-call action (notes included)."""
    zone = ZoneInfo(timezone)
    counted = counted_once(store, since, until)
    rows = [episode for episode, _, _ in counted]
    labels = [json.loads(r["labels"]) for r in rows]
    first_day = datetime.fromtimestamp(since, zone).date()
    last_day = datetime.fromtimestamp(max(since, until - 1), zone).date()
    days = [first_day + timedelta(days=i) for i in range((last_day - first_day).days + 1)]
    by_day: dict[date, collections.Counter[str]] = {day: collections.Counter() for day in days}
    for row in rows:
        by_day[datetime.fromtimestamp(row["starts_at"], zone).date()][row["level"]] += 1
    by_level = collections.Counter(r["level"] for r in rows)
    top_alerts = collections.Counter(r["alertname"] for r in rows).most_common(top_n)
    top_nodes = collections.Counter(n for n in map(node_of, labels) if n).most_common(top_n)

    book = Workbook()
    summary = book.active
    summary.title = "Summary"
    summary.append(["Megatrace alert report"])
    summary["A1"].font = Font(bold=True, size=14)
    summary.append(["From", _local(since, zone), "Until", _local(until, zone), "Time zone", timezone])
    summary.append([])
    _bold_row(summary, ["Day", *LEVELS, "Total"])
    table_top = summary.max_row
    for day in days:
        counts = by_day[day]
        summary.append([day.isoformat(), *(counts[level] for level in LEVELS), sum(counts.values())])
    _bold_row(summary, ["Total", *(by_level[level] for level in LEVELS), len(rows)])
    table_bottom = summary.max_row - 1

    summary.append([])
    _bold_row(summary, ["Top recurring alerts", "Episodes"])
    for name, count in top_alerts:
        summary.append([name, count])
    summary.append([])
    _bold_row(summary, ["Top nodes", "Episodes"])
    for name, count in top_nodes:
        summary.append([name, count])
    summary.append([])
    _bold_row(
        summary, ["Time to resolve", "Resolved", "Median minutes", "90th percentile minutes", "Unresolved"]
    )
    medians = {}
    for level in LEVELS:
        durations = sorted(m for r in rows if r["level"] == level and (m := _minutes(r)) is not None)
        unresolved = sum(1 for r in rows if r["level"] == level and r["ends_at"] is None)
        median = round(statistics.median(durations), 1) if durations else None
        p90 = durations[min(len(durations) - 1, int(0.9 * len(durations)))] if durations else None
        medians[level] = median
        summary.append([level, len(durations), median, p90, unresolved])

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
    for (row, culprit, alerts), lab in zip(counted, labels, strict=True):
        annotations = json.loads(row["annotations"])
        detail.append(
            [
                row["id"],
                row["alertname"],
                row["level"],
                row["severity"],
                row["status"],
                _local(row["starts_at"], zone),
                _local(row["ends_at"], zone),
                _minutes(row),
                lab.get("job", ""),
                node_of(lab),
                culprit,
                alerts,
                annotations.get("summary", ""),
                row["recurrence"],
                "yes" if row["escalated"] else "",
                "yes" if row["flapping"] else "",
                row["duplicates"],
                row["fingerprint"],
            ]
        )
    detail.freeze_panes = "A2"
    detail.auto_filter.ref = detail.dimensions
    size_columns(detail)
    actions = store.actions_between(since, until)
    duty = book.create_sheet("On call")
    _bold_row(duty, ["Day", "Primary", "Then"])
    for day in days:
        noon = datetime.combine(day, datetime.min.time(), zone).timestamp() + 12 * 3600
        order = [p.name for p in rotation(oncall, noon)] if oncall else []
        duty.append([day.isoformat(), order[0] if order else "", ", ".join(order[1:])])
    duty.append([])
    _bold_row(duty, ["Time", "Who", "Action", "Alert", "Detail", "From"])
    for action in actions:
        duty.append(
            [
                _local(action["at"], zone),
                action["actor_name"],
                action["action"],
                action["episode_id"],
                action["detail"],
                action["source"],
            ]
        )
    size_columns(duty)
    for sheet in book.worksheets:
        text_only(sheet)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(saved(book))
    all_durations = [m for r in rows if (m := _minutes(r)) is not None]
    return {
        "title": f"Megatrace weekly alert report {first_day.isoformat()} – {last_day.isoformat()}",
        "since": first_day.isoformat(),
        "until": last_day.isoformat(),
        "total": len(rows),
        "by_level": [(level, by_level[level]) for level in LEVELS],
        "top": top_alerts[:5],
        "mttr": f"{statistics.median(all_durations):.1f} min" if all_durations else "",
        "actions": len(actions),
        "notes": sum(1 for a in actions if a["action"] == "note"),
        "file_name": path.name,
        "path": str(path),
    }
