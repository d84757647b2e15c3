"""Validation of Alertmanager webhook bodies (payload version 4) into plain dataclasses.

A body that is not usable raises `PayloadError` whose message says exactly what is wrong, so the
HTTP layer can answer 400 with it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import UTC, datetime
from typing import Any

from megatrace.alertbot.kinds import EpisodeStatus

_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?(Z|z|[+-]\d{2}:\d{2})$"
)
STATUSES = tuple(EpisodeStatus)[:2]  # firing, resolved: what Alertmanager sends


class PayloadError(ValueError):
    """A webhook body that cannot be accepted; the message is the reason given to the sender."""


@dataclasses.dataclass(frozen=True)
class Alert:
    status: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    ends_at: float | None
    generator_url: str
    fingerprint: str

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")


@dataclasses.dataclass(frozen=True)
class Webhook:
    status: str
    receiver: str
    group_key: str
    external_url: str
    truncated_alerts: int
    alerts: list[Alert]
    rejected: list[tuple[int, str, Any]] = dataclasses.field(default_factory=list)


def parse_time(value: Any, where: str) -> float | None:
    """RFC 3339 timestamp → Unix seconds; Go's zero time (``0001-01-01…``) → None."""
    if not isinstance(value, str):
        raise PayloadError(f"{where}: expected an RFC 3339 timestamp string, got {type(value).__name__}")
    match = _RFC3339.match(value)
    if match is None:
        raise PayloadError(f"{where}: not an RFC 3339 timestamp: {value[:40]!r}")
    if value.startswith("0001-01-01"):
        return None
    year, month, day, hour, minute, second, frac, zone = match.groups()
    # milliseconds, cut as Go cuts them: the webhook has nanoseconds, the API v2 (reconciliation) only
    # milliseconds, and both must give the same episode key
    frac = (frac or "0")[:3].ljust(6, "0")
    tz = "+00:00" if zone in ("Z", "z") else zone
    try:
        moment = datetime.fromisoformat(f"{year}-{month}-{day}T{hour}:{minute}:{second}.{frac}{tz}")
        moment.astimezone(UTC)
    except OverflowError:
        raise PayloadError(f"{where}: {value[:40]!r} lies outside years 1 to 9999 in UTC") from None
    except ValueError as exc:
        raise PayloadError(f"{where}: invalid date/time {value[:40]!r}: {exc}") from None
    return round(moment.timestamp(), 3)


def format_time(epoch: float | None) -> str:
    """Unix seconds → RFC 3339 UTC with milliseconds (Go zero time for None)."""
    if epoch is None:
        return "0001-01-01T00:00:00Z"
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _string_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PayloadError(f"{where}: expected an object of strings, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise PayloadError(f"{where}.{key}: expected a string, got {type(item).__name__}")
    return dict(value)


def parse_alert(raw: Any, where: str) -> Alert:
    """One alert object (webhook or API v2 shape) → Alert."""
    if not isinstance(raw, dict):
        raise PayloadError(f"{where}: expected an object, got {type(raw).__name__}")
    status = raw.get("status")
    if isinstance(status, dict):  # API v2: {"state": "active"|"suppressed"|"unprocessed"}
        status = "firing"
    if status not in STATUSES:
        raise PayloadError(f"{where}.status: expected 'firing' or 'resolved', got {status!r}")
    labels = _string_map(raw.get("labels"), f"{where}.labels")
    if not labels.get("alertname"):
        raise PayloadError(f"{where}.labels: 'alertname' is missing")
    fingerprint = raw.get("fingerprint")
    if not isinstance(fingerprint, str) or not re.fullmatch(r"[0-9A-Za-z]{1,64}", fingerprint):
        raise PayloadError(f"{where}.fingerprint: expected a hexadecimal string, got {fingerprint!r}")
    starts_at = parse_time(raw.get("startsAt"), f"{where}.startsAt")
    if starts_at is None:
        raise PayloadError(f"{where}.startsAt: the zero time is not a start time")
    ends_at = parse_time(raw.get("endsAt", "0001-01-01T00:00:00Z"), f"{where}.endsAt")
    if status == EpisodeStatus.RESOLVED and ends_at is None:
        raise PayloadError(f"{where}.endsAt: a resolved alert needs an end time")
    generator = raw.get("generatorURL", "")
    if not isinstance(generator, str):
        raise PayloadError(f"{where}.generatorURL: expected a string")
    return Alert(
        status=status,
        labels=labels,
        annotations=_string_map(raw.get("annotations"), f"{where}.annotations"),
        starts_at=starts_at,
        ends_at=ends_at,
        generator_url=generator,
        fingerprint=fingerprint,
    )


def load_json(body: bytes | str) -> Any:
    """Parse a request body as JSON that can be stored and sent on: PayloadError for anything else
    (not JSON, nested too deeply, numbers past Python's digit limit, lone surrogates like ``\\ud800``)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise PayloadError("body is nested too deeply") from None
    except ValueError as exc:  # an integer longer than sys.get_int_max_str_digits()
        raise PayloadError(f"body is not usable JSON: {str(exc)[:120]}") from None
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise PayloadError("body holds a lone surrogate (e.g. \\ud800): not valid Unicode") from None
    except RecursionError:
        raise PayloadError("body is nested too deeply") from None
    return data


def parse_webhook(body: bytes | str, lenient: bool = False) -> Webhook:
    """Validate an Alertmanager webhook body (version 4). With `lenient`, alerts that fail validation
    are set aside in `Webhook.rejected` (index, reason, the alert as sent) instead of failing the body."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise PayloadError(f"body: expected a JSON object, got {type(data).__name__}")
    if data.get("version") != "4":
        raise PayloadError(f'version: expected "4" (Alertmanager webhook), got {data.get("version")!r}')
    status = data.get("status")
    if status not in STATUSES:
        raise PayloadError(f"status: expected 'firing' or 'resolved', got {status!r}")
    alerts = data.get("alerts")
    if not isinstance(alerts, list) or not alerts:
        raise PayloadError("alerts: expected a non-empty list")
    truncated = data.get("truncatedAlerts", 0)
    if not isinstance(truncated, int) or truncated < 0:
        raise PayloadError("truncatedAlerts: expected a non-negative integer")
    for key in ("receiver", "groupKey", "externalURL"):
        if not isinstance(data.get(key, ""), str):
            raise PayloadError(f"{key}: expected a string")
    parsed: list[Alert] = []
    rejected: list[tuple[int, str, Any]] = []
    for i, item in enumerate(alerts):
        try:
            parsed.append(parse_alert(item, f"alerts[{i}]"))
        except PayloadError as exc:
            if not lenient:
                raise
            rejected.append((i, str(exc), item))
    return Webhook(
        status=status,
        receiver=data.get("receiver", ""),
        group_key=data.get("groupKey", ""),
        external_url=data.get("externalURL", ""),
        truncated_alerts=truncated,
        alerts=parsed,
        rejected=rejected,
    )
