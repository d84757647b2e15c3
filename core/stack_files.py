"""Configuration files the local stack generates: Prometheus, Alertmanager, the rules it loads.

Everything is derived from one `StackConfig`; nothing here starts a process.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import yaml

from megatrace.stack_config import StackConfig

_DURATION = re.compile(r"(\d+)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_RANGE = re.compile(r"\[(\d+(?:ms|s|m|h|d))(:(\d+(?:ms|s|m|h|d))?)?\]")
# How the rules write a time in seconds inside an expression (the stall threshold's floor, the pause
# thresholds): `vector(N)`, only in recording rules of seconds (tests/test_rules.py holds them to it).
_SECONDS_LITERAL = re.compile(r"\bvector\((\d+(?:\.\d+)?)\)")


def duration_seconds(text: str) -> float:
    """Seconds in a Prometheus duration such as ``1h30m`` or ``90s``."""
    parts = _DURATION.findall(text)
    if not parts or "".join(num + unit for num, unit in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(num) * _UNIT_SECONDS[unit] for num, unit in parts)


def _compressed(text: str, factor: float, floor_seconds: int) -> str:
    return f"{max(floor_seconds, round(duration_seconds(text) / factor))}s"


def compress_expr(expr: str, factor: float, floor_seconds: int) -> str:
    """Divide every range-selector window in a PromQL expression by `factor` (never below the floor)."""

    def shrink(match: re.Match[str]) -> str:
        window = _compressed(match.group(1), factor, floor_seconds)
        if match.group(2) is None:
            return f"[{window}]"
        step = match.group(3)
        return f"[{window}:{_compressed(step, factor, 1) if step else ''}]"

    return _RANGE.sub(shrink, expr)


def compress_seconds_literals(expr: str, factor: float) -> str:
    """Divide every time literal of a rule expression (`vector(N)`, N in seconds) by `factor`."""
    return _SECONDS_LITERAL.sub(lambda match: f"vector({float(match.group(1)) / factor:g})", expr)


def compress_rules(document: dict[str, Any], factor: float, floor_seconds: int) -> dict[str, Any]:
    """A copy of a rule file with `for:` durations, range windows and time literals (`vector(N)`: the
    stall threshold's floor, the pause thresholds) divided by `factor`.

    The local demo uses this to play hours of alerting logic in minutes; the rule logic,
    labels and annotations stay exactly as in `rules/`.
    """
    groups = []
    for group in document.get("groups", []):
        rules = []
        for rule in group.get("rules", []):
            rule = dict(rule)
            rule["expr"] = compress_seconds_literals(
                compress_expr(str(rule["expr"]), factor, floor_seconds), factor
            )
            if "for" in rule:
                rule["for"] = f"{max(1, round(duration_seconds(rule['for']) / factor))}s"
            if "keep_firing_for" in rule:
                del rule["keep_firing_for"]
            rules.append(rule)
        groups.append({**group, "rules": rules})
    return {**document, "groups": groups}


def evaluated_at_least_every(document: dict[str, Any], interval: str) -> dict[str, Any]:
    """A copy of a rule file whose groups with their own `interval:` (the training groups' 5 s) run at
    most `interval` apart: the stack evaluates every other group at its scrape interval, and a faster
    stack (the demo's 1 s) must not evaluate the hang rules more slowly than the rest."""
    limit = duration_seconds(interval)
    groups = [
        {**group, "interval": interval}
        if "interval" in group and duration_seconds(group["interval"]) > limit
        else group
        for group in document.get("groups", [])
    ]
    return {**document, "groups": groups}


def write_rules(config: StackConfig, dest: Path) -> list[Path]:
    """Copy (compressed when configured) every rule file of `config.rules_dir` into `dest`, groups
    evaluated at least as often as the stack's scrape interval."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    sources = sorted(Path(config.rules_dir).glob("*.yml")) + sorted(Path(config.rules_dir).glob("*.yaml"))
    for source in sources:
        document = yaml.safe_load(source.read_text()) or {}
        if config.time_compression != 1:
            floor = max(1, round(duration_seconds(config.scrape_interval) * 2))
            document = compress_rules(document, config.time_compression, floor)
        document = evaluated_at_least_every(document, config.scrape_interval)
        target = dest / source.name
        target.write_text(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))
        written.append(target)
    return written


def prometheus_config(config: StackConfig, rule_files: list[Path]) -> dict[str, Any]:
    """prometheus.yml: scrape the agent (honor_labels), node_exporter and the bot; alert to Alertmanager.
    The node's series carry `node`, its name as operators know it (the chart makes `instance` the
    Kubernetes node name to the same end), so cards name the machine rather than a scrape address."""
    host = config.host
    node = {"node": socket.gethostname()}
    return {
        "global": {
            "scrape_interval": config.scrape_interval,
            "evaluation_interval": config.scrape_interval,
            "external_labels": {"cluster": config.cluster},
        },
        "rule_files": [str(path) for path in rule_files],
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [f"{host}:{config.ports.alertmanager}"]}]}]
        },
        "scrape_configs": [
            {
                "job_name": "megatrace",
                "honor_labels": True,
                "static_configs": [{"targets": [f"{host}:{config.ports.exporter}"], "labels": node}],
            },
            {
                "job_name": "node",
                "static_configs": [{"targets": [f"{host}:{config.ports.node_exporter}"], "labels": node}],
            },
            {
                "job_name": "megatrace-alertbot",
                "static_configs": [{"targets": [f"{host}:{config.ports.alertbot}"]}],
            },
        ],
    }


def alertmanager_config(config: StackConfig, webhook_token: str) -> dict[str, Any]:
    """alertmanager.yml routing every alert to the alert bot's webhook with a bearer token; P0 alerts
    through a sub-route of their own with a shorter first wait (`alert_grouping.p0_group_wait`)."""
    timing = config.alert_grouping
    return {
        "route": {
            "receiver": "megatrace-alertbot",
            "group_by": ["alertname", "job", "instance"],
            "group_wait": timing.group_wait,
            "group_interval": timing.group_interval,
            "repeat_interval": timing.repeat_interval,
            "routes": [{"matchers": ['severity="P0"'], "group_wait": timing.p0_group_wait}],
        },
        "receivers": [
            {
                "name": "megatrace-alertbot",
                "webhook_configs": [
                    {
                        "url": f"http://{config.host}:{config.ports.alertbot}/alertmanager",
                        "send_resolved": True,
                        "http_config": {"authorization": {"type": "Bearer", "credentials": webhook_token}},
                    }
                ],
            }
        ],
    }
