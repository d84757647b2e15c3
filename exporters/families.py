"""Builds a scrape's metric families on the fly: add samples by name, get families in a stable order."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "megatrace_"


class FamilySet:
    """Fresh families for one scrape; each family is created on its first sample, sorted on output."""

    def __init__(self, subsystem: str) -> None:
        self.subsystem = subsystem
        self._families: dict[str, Metric] = {}

    def _family(self, kind: str, name: str, doc: str, labels: Sequence[str]) -> Metric:
        full = f"{PREFIX}{self.subsystem}_{name}"
        family = self._families.get(full)
        if family is None:
            if kind == "counter":
                family = CounterMetricFamily(full, doc, labels=list(labels))
            else:
                family = GaugeMetricFamily(full, doc, labels=list(labels))
            self._families[full] = family
        return family

    def gauge(self, name: str, doc: str, labels: dict[str, str], value: float) -> None:
        """Add one gauge sample to ``megatrace_<subsystem>_<name>``."""
        self._family("gauge", name, doc, list(labels)).add_metric(list(labels.values()), value)

    def counter(self, name: str, doc: str, labels: dict[str, str], value: float) -> None:
        """Add one counter sample; `name` ends in ``_total``, which the exposition keeps."""
        self._family("counter", name, doc, list(labels)).add_metric(list(labels.values()), value)

    def families(self) -> list[Metric]:
        """All families, sorted by name so that the exposition is stable."""
        return [self._families[name] for name in sorted(self._families)]
