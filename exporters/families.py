"""Builds a scrape's metric families: on the fly by name (`FamilySet`), or from series known in advance
(`FixedSeriesFamily`, whose exposition text is prepared once)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.samples import Sample

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

    def summary(
        self,
        name: str,
        doc: str,
        labels: dict[str, str],
        count: float,
        total: float,
        quantiles: dict[str, float],
    ) -> None:
        """Add one summary to ``megatrace_<subsystem>_<name>``: its ``_count``, ``_sum`` and a sample per
        quantile (label ``quantile``)."""
        full = f"{PREFIX}{self.subsystem}_{name}"
        family = self._families.get(full)
        if family is None:
            family = self._families[full] = SummaryMetricFamily(full, doc, labels=list(labels))
        for quantile, value in quantiles.items():
            family.samples.append(Sample(full, {**labels, "quantile": quantile}, value))
        family.add_metric(list(labels.values()), count, total)

    def families(self) -> list[Metric]:
        """All families, sorted by name so that the exposition is stable."""
        return [self._families[name] for name in sorted(self._families)]


class FixedSeriesFamily:
    """A gauge or counter family for series whose names and labels stay put between scrapes.

    Each series is added as (its exposition text up to the value, its labels, the value): the text is
    built once by `series_text` when the collector learns the series, so `render_text` writes a scrape
    with one number formatted per series. `samples` gives prometheus_client's view of the same series
    (for `generate_latest` and the OpenMetrics encoder), built only when asked for.
    """

    def __init__(self, name: str, documentation: str, typ: str) -> None:
        self.name = name.removesuffix("_total") if typ == "counter" else name
        self.documentation = documentation
        self.type = typ
        self.unit = ""
        self.sample_name = self.name + "_total" if typ == "counter" else self.name
        self.series: list[tuple[str, dict[str, str], float]] = []

    @property
    def samples(self) -> list[Sample]:
        return [Sample(self.sample_name, labels, value, None, None) for _, labels, value in self.series]


def series_text(sample_name: str, labels: dict[str, str]) -> str:
    """The exposition text of a series before its value: ``name{label="value",...} `` (sorted labels)."""
    if not labels:
        return f"{sample_name} "
    rendered = ",".join(f'{key}="{escape_label_value(value)}"' for key, value in sorted(labels.items()))
    return f"{sample_name}{{{rendered}}} "


def escape_label_value(value: str) -> str:
    """A label value as the text exposition writes it (backslash, newline and quote escaped)."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value
