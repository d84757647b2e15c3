"""Helpers for exporter tests: render a collector's exposition, parse it, check it with promtool."""

from __future__ import annotations

import subprocess

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.services import require_binary


def render(*collectors: object) -> str:
    """The text exposition of `collectors` in a registry of their own."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(text: str, metric: str, /, **labels: str) -> float:
    """The value of the one sample `metric` whose labels include `labels`; fails when not exactly one."""
    found = [v for (n, ls), v in samples(text).items() if n == metric and set(labels.items()) <= set(ls)]
    assert len(found) == 1, f"{metric}{labels}: {len(found)} samples"
    return found[0]


def names(text: str) -> set[str]:
    """Sample names in an exposition."""
    return {name for name, _ in samples(text)}


def promtool_check(text: str | bytes) -> subprocess.CompletedProcess:
    """Run `promtool check metrics` on an exposition."""
    data = text.encode() if isinstance(text, str) else text
    return subprocess.run(
        [require_binary("promtool"), "check", "metrics"], input=data, capture_output=True, timeout=60
    )
