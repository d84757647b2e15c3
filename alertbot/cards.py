"""What each notification says (`CardRenderer` builds the neutral `Notification`), and the Feishu
interactive cards made of it from Jinja2 templates (``card_*.json.j2``).

A template in the configured `templates_dir` replaces the built-in one of the same name. A user
template that fails to render or is not valid JSON is logged and the built-in one is used, so a
template mistake never loses an alert. Cards are shrunk until the message fits Feishu's 20 KB.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit
from zoneinfo import ZoneInfo

import jinja2
import markupsafe

from megatrace.alertbot import escape
from megatrace.alertbot.config import LinksConfig
from megatrace.alertbot.incident import Incident, cause_text, next_step, pending_text
from megatrace.alertbot.incident import headline as incident_headline
from megatrace.alertbot.kinds import EpisodeStatus, NotificationKind
from megatrace.alertbot.notification import CardContext, CardSpec, Link, Notification
from megatrace.alertbot.store.records import Episode, Storm

log = logging.getLogger(__name__)

COLOURS = {"P0": "red", "P1": "orange", "P2": "yellow", "P3": "blue"}
# Not listed among a card's labels: the title and the culprit line say them in words.
HIDDEN_LABELS = frozenset(
    {"alertname", "severity", "culprit_rank", "culprit_node", "culprit_seen", "pause", "pause_rank"}
)
CARD_LIMIT = 19 * 1024  # leaves room for the message envelope and signature within 20 KB
MAX_URL = 1500
WHERE_LABELS = ("job", "rank", "instance", "node", "gpu", "device")


def _environment(loader: jinja2.BaseLoader) -> jinja2.Environment:
    """Templates build lark_md bodies from ``{{ value }}`` expressions and emit each field through
    ``tojson``: every expression is escaped for lark_md, save what ``tojson`` (Markup) already encoded."""
    return jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        finalize=lambda value: value if isinstance(value, markupsafe.Markup) else escape.lark_md(value),
    )


def _clean_plain_text(node: Any) -> Any:
    """`node` (a rendered card) with every plain_text field's content escaped for plain_text."""
    if isinstance(node, list):
        return [_clean_plain_text(item) for item in node]
    if not isinstance(node, dict):
        return node
    cleaned = {key: _clean_plain_text(value) for key, value in node.items()}
    if cleaned.get("tag") == "plain_text" and isinstance(cleaned.get("content"), str):
        cleaned["content"] = escape.plain_text(cleaned["content"])
    return cleaned


def human_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] * bool(days) + [f"{hours}h"] * bool(hours) + [f"{minutes}m"] * bool(minutes)
    return " ".join(parts[:2]) or f"{secs}s"


def silence_url(base: str, labels: dict[str, str]) -> str:
    """Alertmanager UI link that opens a new silence pre-filled with the alert's labels."""
    wanted = {k: v for k, v in labels.items() if k not in ("severity",)}
    matcher = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(wanted.items())) + "}"
    return f"{base.rstrip('/')}/#/silences/new?filter={quote(matcher)}"


def runbook_link(url: str, base: str) -> str:
    """The runbook annotation as a link: an absolute URL as it is, a repository path (as the rules
    carry, ``docs/runbooks/<Alert>.md``) joined with `base`; "" when there is no base to join it with."""
    if not url or urlsplit(url).scheme:
        return url
    return f"{base.rstrip('/')}/{url.lstrip('/')}" if base else ""


def rebase_url(url: str, base: str) -> str:
    """`url` moved onto `base` (scheme, host and path prefix), keeping its last path segment, query and
    fragment: ``http://vm:9090/graph?g0.expr=up`` on ``https://prom.example.com/prom`` becomes
    ``https://prom.example.com/prom/graph?g0.expr=up``. Unchanged when `base` is empty."""
    if not url or not base:
        return url
    parts, target = urlsplit(url), urlsplit(base)
    leaf = parts.path.rsplit("/", 1)[-1]
    path = f"{target.path.rstrip('/')}/{leaf}"
    return urlunsplit((target.scheme, target.netloc, path, parts.query, parts.fragment))


def member_text(member: Episode) -> str:
    """Where a storm member is, from its location labels (its fingerprint when it has none)."""
    labels = member.labels
    keys = [k for k in ("job", "rank", "instance", "node", "gpu", "device", "port") if k in labels]
    return " ".join(f"{k}={labels[k]}" for k in keys) or member.fingerprint


class CardRenderer:
    """Builds the context of each card kind and renders it through the (overridable) templates."""

    def __init__(self, templates_dir: str, links: LinksConfig, timezone: str = "UTC") -> None:
        builtin = jinja2.FileSystemLoader(str(Path(__file__).parent))
        self.builtin = _environment(builtin)
        self.user = _environment(jinja2.FileSystemLoader(templates_dir)) if templates_dir else None
        self.links = links
        self.zone = ZoneInfo(timezone)

    def when(self, epoch: float | None) -> str:
        if epoch is None:
            return ""
        return datetime.fromtimestamp(epoch, self.zone).strftime("%Y-%m-%d %H:%M:%S %Z")

    def render(self, name: str, context: dict[str, Any]) -> dict[str, Any]:
        """Render template `name`, preferring the user's copy; always returns a card object."""
        if self.user is not None:
            try:
                return _clean_plain_text(json.loads(self.user.get_template(name).render(context)))
            except jinja2.TemplateNotFound:
                pass
            except (jinja2.TemplateError, json.JSONDecodeError) as exc:
                log.error("template %s in templates_dir failed (%s); using the built-in one", name, exc)
        return _clean_plain_text(json.loads(self.builtin.get_template(name).render(context)))

    def card(self, spec: CardSpec) -> dict[str, Any]:
        """The Feishu card of a notification."""
        return self.fit(spec.template, spec.context)

    def fit(self, name: str, make_context: CardContext) -> dict[str, Any]:
        """Render with shrinking detail (`make_context(budget)`) until the card fits the size limit."""
        for budget in (4000, 1000, 250, 60):
            card = self.render(name, make_context(budget))
            if len(json.dumps(card, ensure_ascii=False).encode()) <= CARD_LIMIT:
                return card
        return card

    def runbook_text(self, annotations: dict[str, str]) -> str:
        """The runbook path shown as text when it cannot be a button (relative, no base URL set)."""
        url = annotations.get("runbook_url", "")
        return url if url and not runbook_link(url, self.links.runbook_base_url) else ""

    def _links(self, labels: dict[str, str], annotations: dict[str, str], row: Episode) -> list[Link]:
        """Runbook, Grafana, Prometheus and Silence buttons; URLs too long for a card are left out."""
        candidates = [
            (
                "Runbook",
                "primary",
                runbook_link(annotations.get("runbook_url", ""), self.links.runbook_base_url),
            ),
            ("Grafana", "default", self.links.grafana_url),
            ("Prometheus", "default", rebase_url(row.generator_url, self.links.prometheus_url)),
        ]
        am = self.links.alertmanager_url or row.external_url
        if am:
            url = silence_url(am, labels)
            if len(url) > MAX_URL:  # fall back to the labels that say where it is
                url = silence_url(am, {k: v for k, v in labels.items() if k in ("alertname", *WHERE_LABELS)})
            candidates.append(("Silence", "danger", url))
        return [Link(t, u, k) for t, k, u in candidates if u and len(u) <= MAX_URL]

    def _members_link(self, storm: Storm, count: int) -> list[Link]:
        """A button to the archive sheet, where every member of the storm has a row whose event
        reads ``firing in storm s<id>``; none when no sheet URL is configured."""
        url = self.links.archive_sheet_url
        text = f"All {count} on the sheet: storm s{storm.id}"
        return [Link(text, url)] if url and len(url) <= MAX_URL else []

    def alert(
        self,
        row: Episode,
        kind: NotificationKind,
        ref: str,
        flap_hold_s: float,
        now: float,
        oncall: dict[str, Any] | None = None,
        incident: Incident | None = None,
    ) -> Notification:
        """`kind`: firing, repeat, resolved, or verdict (a reply that follows a card up with its
        culprit). `oncall` (app cards of firing alerts when card actions are on): the claim and silence
        status line, the action buttons and the note form's value. `incident`: the card of a job's
        hang or slow incident, naming its culprit, what was seen and what to do first."""
        labels = row.labels
        annotations = row.annotations
        state = {NotificationKind.RESOLVED: "RESOLVED", NotificationKind.VERDICT: "VERDICT"}.get(
            kind, "FIRING"
        )
        where = ", ".join(f"{k} {labels[k]}" for k in WHERE_LABELS if k in labels)
        headline = annotations.get("summary") or row.alertname
        ended = row.ends_at
        if incident is not None:
            headline = incident_headline(incident)
            node = incident.culprit.node if incident.culprit else ""
            where = f"job {incident.job}" + (f", node {node}" if node else "")
            ended = incident.ended if kind == NotificationKind.RESOLVED else None
        links = self._links(labels, annotations, row)
        pause = pause_text(labels)

        def context(budget: int) -> dict[str, object]:
            return {
                "kind": kind,
                "level": row.level,
                "colour": "green" if kind == NotificationKind.RESOLVED else COLOURS[row.level],
                "title": f"[{row.level}] {state}: {headline}"[:budget],
                "alertname": row.alertname,
                "summary": annotations.get("summary", "")[:budget],
                "description": annotations.get("description", "")[:budget],
                "where": where[:budget] or "(no location labels)",
                "since": self.when(row.starts_at),
                "ended": self.when(ended),
                "duration": human_duration((ended or now) - row.starts_at),
                "recurrence": row.recurrence,
                "recent": row.recent,
                "escalated": bool(row.escalated),
                "flapping": bool(row.flapping),
                "flap_hold": human_duration(flap_hold_s),
                "labels": [
                    (k, v[: budget // 4]) for k, v in sorted(labels.items()) if k not in HIDDEN_LABELS
                ][: max(3, budget // 40)],
                "links": buttons(links),
                "runbook": self.runbook_text(annotations),
                "ref": ref,
                "pause": pause,
                "oncall": oncall,
                "incident": incident_context(incident, budget) if incident is not None else None,
            }

        facts = [("Where", where), ("Since", self.when(row.starts_at)), ("Ended", self.when(ended))]
        facts.append(("During a pause", pause))
        facts.append(("Summary", "" if incident is not None else annotations.get("summary", "")))
        culprit = incident_culprit(incident) if incident is not None else ""
        return Notification(
            kind=kind,
            level=row.level,
            title=f"[{row.level}] {state}: {headline}",
            facts=tuple((name, value) for name, value in facts if value),
            culprit=culprit,
            links=tuple(links),
            actions=tuple(str(b["value"]["action"]) for b in (oncall or {}).get("buttons", [])),
            ref=ref,
            card=CardSpec("card_alert.json.j2", context),
        )

    def storm(self, storm: Storm, members: list[Episode], window_s: float, ref: str) -> Notification:
        first = members[0]
        annotations = first.annotations
        links = self._links({"alertname": storm.alertname}, annotations, first) + self._members_link(
            storm, len(members)
        )

        def describe(member: Episode) -> str:
            resolved = member.status == EpisodeStatus.RESOLVED
            return member_text(member) + (" (resolved)" if resolved else "")

        def context(budget: int) -> dict[str, object]:
            shown = members[: max(5, budget // 20)]
            return {
                "title": f"[{storm.level}] STORM: {len(members)} × {storm.alertname}",
                "colour": COLOURS[storm.level],
                "alertname": storm.alertname,
                "count": len(members),
                "window": human_duration(window_s),
                "summary": annotations.get("summary", "")[:budget],
                "members": [describe(m)[: budget // 4] for m in shown],
                "more": len(members) - len(shown),
                "links": buttons(links),
                "runbook": self.runbook_text(annotations),
                "ref": ref,
            }

        title = f"[{storm.level}] STORM: {len(members)} × {storm.alertname}"
        facts = (("Alerts", str(len(members))), ("Within", human_duration(window_s)))
        spec = CardSpec("card_storm.json.j2", context)
        return Notification(
            NotificationKind.STORM, storm.level, title, facts, "", tuple(links), (), ref, spec
        )

    def storm_resolved(self, storm: Storm, members: list[Episode], ref: str, now: float) -> Notification:
        """What of a storm recovered, and what is still firing."""
        recovered = [m for m in members if m.status == EpisodeStatus.RESOLVED]
        firing = [m for m in members if m.status != EpisodeStatus.RESOLVED]
        ended = max((m.ends_at or now for m in recovered), default=now)
        started = min((m.starts_at for m in members), default=storm.opened_at)
        count = f"{len(recovered)} of {len(members)}" if firing else f"{len(members)}"
        state = "RECOVERING" if firing else "RESOLVED"

        def context(budget: int) -> dict[str, object]:
            shown = max(5, budget // 20)
            return {
                "title": f"[{storm.level}] STORM {state}: {count} × {storm.alertname} resolved",
                "colour": "wathet" if firing else "green",
                "alertname": storm.alertname,
                "count": len(members),
                "duration": human_duration(ended - started),
                "since": self.when(started),
                "recovered": [member_text(m)[: budget // 4] for m in recovered[:shown]],
                "recovered_more": max(0, len(recovered) - shown),
                "recovered_count": len(recovered),
                "firing": [member_text(m)[: budget // 4] for m in firing[:shown]],
                "firing_more": max(0, len(firing) - shown),
                "firing_count": len(firing),
                "ref": ref,
            }

        title = f"[{storm.level}] STORM {state}: {count} × {storm.alertname} resolved"
        facts = (("Recovered", str(len(recovered))), ("Still firing", str(len(firing))))
        spec = CardSpec("card_storm_resolved.json.j2", context)
        kind = NotificationKind.STORM_RESOLVED
        return Notification(kind, storm.level, title, facts, "", (), (), ref, spec)

    def report_card(self, summary: dict[str, Any]) -> dict[str, Any]:
        return self.render("card_report.json.j2", summary)


PAUSES = {"checkpoint": "a checkpoint", "eval": "an evaluation pass", "dataloader": "a data-loader wait"}


def pause_text(labels: dict[str, str]) -> str:
    """What a hang alert that fired during a known pause says of it ("" for any other alert): the
    rules let a pause run to its own, longer threshold, so a page then means the pause itself is stuck."""
    kind = labels.get("pause", "")
    if not kind:
        return ""
    what = PAUSES.get(kind, f"a {kind} pause")
    where = f" on rank {labels['pause_rank']}" if labels.get("pause_rank") else ""
    return f"{what}{where} has lasted past its own threshold; it is likely stuck itself"


def buttons(links: list[Link]) -> list[dict[str, str]]:
    """Links as the card templates show them: Feishu buttons."""
    return [{"text": link.text, "type": link.style, "url": link.url} for link in links]


def incident_culprit(incident: Incident) -> str:
    """Who the incident's card names, in one line ("" while nobody is named)."""
    culprit = incident.culprit
    if culprit is None:
        return ""
    ranks = " or ".join(f"rank {r}" for r in culprit.tied) if culprit.tied else f"rank {culprit.rank}"
    return ranks + (f" on node {culprit.node}" if culprit.node else "")


def incident_context(incident: Incident, budget: int) -> dict[str, Any]:
    """The incident part of a card: culprit, what was seen, what to do first, the drill-down's notes."""
    culprit = incident.culprit
    report = incident.verdict
    return {
        "culprit": None
        if culprit is None
        else {
            "rank": culprit.rank,
            "tied": list(culprit.tied),
            "tie_reason": culprit.tie_reason[:budget],
            "node": culprit.node,
            "sentence": culprit.sentence[:budget],
            "confidence": None if culprit.confidence is None else round(culprit.confidence * 100),
            "where": culprit.where[:budget],
        },
        "pending": pending_text(incident)[:budget],
        "next_step": next_step(incident),
        "why": cause_text(incident)[:budget],
        "others": rank_list(incident.others) if incident.others else "",
        "no_data": [
            f"{rank_list(item.get('ranks', []))}: {item.get('reason', '')}"[:budget]
            for item in report.get("no_data", [])
            if isinstance(item, dict)
        ][: max(2, budget // 200)],
        "hints": [str(h)[:budget] for h in report.get("hints", [])][: max(2, budget // 100)],
    }


def placement_text(suspect: dict[str, Any]) -> str:
    """Where a suspect runs, as operators look for it: node, pod and container, GPU, local rank."""
    parts = []
    if suspect.get("node"):
        parts.append(f"node {suspect['node']}")
    if suspect.get("pod"):
        pod = f"{suspect['namespace']}/{suspect['pod']}" if suspect.get("namespace") else suspect["pod"]
        container = f" container {suspect['container']}" if suspect.get("container") else ""
        parts.append(f"pod {pod}{container}")
    if isinstance(suspect.get("gpu"), int) and suspect["gpu"] >= 0:
        uuid = f" ({suspect['gpu_uuid']})" if suspect.get("gpu_uuid") else ""
        parts.append(f"GPU {suspect['gpu']}{uuid}")
    if isinstance(suspect.get("local_rank"), int):
        parts.append(f"local rank {suspect['local_rank']}")
    return ", ".join(str(part) for part in parts)


def rank_list(ranks: list[Any]) -> str:
    """Ranks as "rank 3" or "ranks 0-3, 7" (consecutive runs joined)."""
    numbers = sorted({r for r in ranks if isinstance(r, int)})
    runs: list[list[int]] = []
    for rank in numbers:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"rank {text}" if len(numbers) == 1 else f"ranks {text}"
