"""Alertmanager API v2 client: reconciliation (catch firing alerts and resolves whose webhooks were
missed) and silences."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

import requests

from megatrace.alertbot.config import AlertmanagerConfig
from megatrace.alertbot.kinds import EpisodeStatus
from megatrace.alertbot.payload import Alert, PayloadError, format_time, parse_alert
from megatrace.alertbot.store import Store

log = logging.getLogger(__name__)

# (source, the alert or episode, reason, now): sets one alert aside, see `Pipeline.quarantine`
Quarantine = Callable[[str, Any, str, float], None]


class AlertmanagerError(RuntimeError):
    """Alertmanager could not be reached or refused the request."""


def _call(method: str, url: str, timeout: float, **kwargs: Any) -> Any:
    try:
        response = requests.request(method, url, timeout=timeout, **kwargs)
    except requests.RequestException as exc:
        raise AlertmanagerError(f"Alertmanager unreachable: {type(exc).__name__}") from None
    if not response.ok:
        raise AlertmanagerError(f"Alertmanager answered HTTP {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError:
        raise AlertmanagerError("Alertmanager answered with invalid JSON") from None


def fetch_alerts(cfg: AlertmanagerConfig) -> list[dict[str, Any]]:
    """Every alert Alertmanager holds (active, silenced and inhibited), for our receiver if set."""
    params = {"active": "true", "silenced": "true", "inhibited": "true", "unprocessed": "true"}
    if cfg.receiver:
        params["receiver"] = cfg.receiver
    data = _call("GET", f"{cfg.url.rstrip('/')}/api/v2/alerts", cfg.timeout_s, params=params)
    if not isinstance(data, list):
        raise AlertmanagerError("GET /api/v2/alerts did not return a list")
    return data


def reconcile(
    store: Store, cfg: AlertmanagerConfig, now: float, quarantine: Quarantine | None = None
) -> tuple[int, int]:
    """Queue (as a stored webhook) the firing alerts we never saw and resolves of episodes that
    Alertmanager no longer holds; returns (missed firing, missed resolved). A stored episode that
    cannot be written back as an alert (a start time past year 9999 in UTC, kept by an older version)
    is marked ``quarantined`` and handed to `quarantine` once, instead of failing the others."""
    present: set[tuple[str, float]] = set()
    missed: list[Alert] = []
    for i, raw in enumerate(fetch_alerts(cfg)):
        try:
            alert = parse_alert(raw, f"alert[{i}]")
        except PayloadError as exc:
            log.warning("reconciliation skipped an alert Alertmanager returned: %s", exc)
            continue
        if alert.ends_at is not None and alert.ends_at <= now:
            continue
        present.add((alert.fingerprint, alert.starts_at))
        state = raw.get("status", {}).get("state") if isinstance(raw.get("status"), dict) else None
        if state == "active" and store.episodes.find(alert.fingerprint, alert.starts_at) is None:
            missed.append(alert)
    gone = [
        row
        for row in store.episodes.firing()
        if (row.fingerprint, row.starts_at) not in present and now - row.last_seen >= cfg.resolve_grace_s
    ]
    alerts = [
        _webhook_alert(a.status, a.labels, a.annotations, a.starts_at, None, a.generator_url, a.fingerprint)
        for a in missed
    ]
    resolved = 0
    for row in gone:
        try:
            alerts.append(
                _webhook_alert(
                    EpisodeStatus.RESOLVED,
                    row.labels,
                    row.annotations,
                    row.starts_at,
                    now,
                    row.generator_url,
                    row.fingerprint,
                )
            )
            resolved += 1
        except (ValueError, OverflowError, OSError) as exc:
            store.episodes.update(row.id, status=EpisodeStatus.QUARANTINED)
            if quarantine is not None:
                quarantine(
                    "reconcile", dataclasses.asdict(row), f"episode {row.id} cannot be resolved: {exc}", now
                )
    if alerts:
        body = {
            "version": "4",
            "status": "firing" if missed else "resolved",
            "receiver": "reconciliation",
            "groupKey": "reconciliation",
            "externalURL": cfg.url,
            "alerts": alerts,
        }
        store.inbox.add("reconcile", json.dumps(body), now)
        log.info("reconciliation: %d missed firing, %d missed resolved", len(missed), resolved)
    return len(missed), resolved


def _webhook_alert(
    status: str,
    labels: dict[str, str],
    annotations: dict[str, str],
    starts_at: float,
    ends_at: float | None,
    generator_url: str,
    fingerprint: str,
) -> dict[str, Any]:
    return {
        "status": status,
        "labels": labels,
        "annotations": annotations,
        "startsAt": format_time(starts_at),
        "endsAt": format_time(ends_at),
        "generatorURL": generator_url,
        "fingerprint": fingerprint,
    }


def create_silence(
    cfg: AlertmanagerConfig,
    matchers: dict[str, str],
    starts: float,
    ends: float,
    created_by: str,
    comment: str,
    absent: Sequence[str] = (),
) -> str:
    """Create a silence of exactly these label values, and of the labels `absent` being absent
    (Alertmanager's ``name=""`` matches an alert without that label); returns its id."""
    wanted = {**dict.fromkeys(absent, ""), **matchers}
    body = {
        "matchers": [
            {"name": name, "value": value, "isRegex": False, "isEqual": True}
            for name, value in sorted(wanted.items())
        ],
        "startsAt": format_time(starts),
        "endsAt": format_time(ends),
        "createdBy": created_by,
        "comment": comment,
    }
    data = _call("POST", f"{cfg.url.rstrip('/')}/api/v2/silences", cfg.timeout_s, json=body)
    if not isinstance(data, dict) or not data.get("silenceID"):
        raise AlertmanagerError("Alertmanager did not return a silenceID")
    return str(data["silenceID"])


def exclusive_matchers(cfg: AlertmanagerConfig, labels: dict[str, str]) -> list[str]:
    """Label names to require absent so that a silence of `labels` covers this alert only: those that
    other alerts Alertmanager holds carry beside all of `labels` (they would match otherwise)."""
    extra: set[str] = set()
    for raw in fetch_alerts(cfg):
        other = raw.get("labels") if isinstance(raw, dict) else None
        if isinstance(other, dict) and other != labels and labels.items() <= other.items():
            extra |= set(other) - set(labels)
    return sorted(extra)


def list_silences(cfg: AlertmanagerConfig) -> list[dict[str, Any]]:
    """Every silence Alertmanager holds (``GET /api/v2/silences``), expired ones included."""
    data = _call("GET", f"{cfg.url.rstrip('/')}/api/v2/silences", cfg.timeout_s)
    if not isinstance(data, list):
        raise AlertmanagerError("GET /api/v2/silences did not return a list")
    return [s for s in data if isinstance(s, dict)]


def expire_silence(cfg: AlertmanagerConfig, silence_id: str) -> None:
    """Expire a silence now (``DELETE /api/v2/silence/{id}``)."""
    url = f"{cfg.url.rstrip('/')}/api/v2/silence/{quote(silence_id, safe='')}"
    try:
        response = requests.delete(url, timeout=cfg.timeout_s)
    except requests.RequestException as exc:
        raise AlertmanagerError(f"Alertmanager unreachable: {type(exc).__name__}") from None
    if not response.ok:
        raise AlertmanagerError(f"Alertmanager answered HTTP {response.status_code}: {response.text[:300]}")
