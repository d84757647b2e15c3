"""Grading: an alert's level P0–P3 from its `severity` label, a policy file of label matchers that
can override it, and escalation of alerts that keep coming back."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megatrace.alertbot.config import LEVELS, GradingConfig
from megatrace.config import ConfigError, read_yaml

SEVERITY_WORDS = {"critical": "P0", "page": "P0", "error": "P1", "high": "P1", "warning": "P2", "info": "P3"}


@dataclasses.dataclass(frozen=True)
class PolicyRule:
    """Labels equal to `match` and matching the anchored regexes of `match_re` get `level`."""

    level: str
    match: dict[str, str]
    match_re: dict[str, re.Pattern[str]]

    def applies(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match.items()) and all(
            p.fullmatch(labels.get(k, "")) for k, p in self.match_re.items()
        )


@dataclasses.dataclass(frozen=True)
class Grade:
    level: str
    escalated: bool


def load_policy(path: str | Path) -> list[PolicyRule]:
    """Read the policy file: ``rules: [{match: {...}, match_re: {...}, level: P1}, ...]``."""
    data = read_yaml(path)
    unknown = set(data) - {"rules"}
    if unknown:
        raise ConfigError(f"{path}: key '{sorted(unknown)[0]}': unknown key")
    rules = data.get("rules") or []
    if not isinstance(rules, list):
        raise ConfigError(f"{path}: key 'rules': expected a list")
    policy = []
    for i, rule in enumerate(rules):
        where = f"{path}: key 'rules[{i}]"
        if not isinstance(rule, dict) or set(rule) - {"match", "match_re", "level"}:
            raise ConfigError(f"{where}': expected an object with match, match_re and level")
        if rule.get("level") not in LEVELS:
            raise ConfigError(f"{where}.level': expected one of P0..P3, got {rule.get('level')!r}")
        match = rule.get("match") or {}
        match_re = rule.get("match_re") or {}
        if not isinstance(match, dict) or not isinstance(match_re, dict) or not (match or match_re):
            raise ConfigError(f"{where}': needs at least one matcher in match or match_re")
        try:
            compiled = {str(k): re.compile(str(v)) for k, v in match_re.items()}
        except re.error as exc:
            raise ConfigError(f"{where}.match_re': invalid regular expression: {exc}") from None
        policy.append(PolicyRule(rule["level"], {str(k): str(v) for k, v in match.items()}, compiled))
    return policy


def base_level(labels: dict[str, str], policy: list[PolicyRule], default: str) -> str:
    """Level before escalation: first matching policy rule, else the severity label, else `default`."""
    for rule in policy:
        if rule.applies(labels):
            return rule.level
    severity = labels.get("severity", "").strip()
    if severity.upper() in LEVELS:
        return severity.upper()
    return SEVERITY_WORDS.get(severity.lower(), default)


def grade(labels: dict[str, str], policy: list[PolicyRule], cfg: GradingConfig, recent: int) -> Grade:
    """Final level; `recent` is how many episodes of this alert began within the escalation window
    (this one included). Reaching `escalate_after` raises the level by one (P0 stays P0)."""
    level = base_level(labels, policy, cfg.default_level)
    if cfg.escalate_after > 0 and recent >= cfg.escalate_after and level != "P0":
        return Grade(LEVELS[LEVELS.index(level) - 1], True)
    return Grade(level, False)
