"""Fast Prometheus text exposition for the gauge and counter families the collectors build.

Produces exactly what prometheus_client's `generate_latest` produces for such families, at a fraction
of the cost per sample; anything else (histograms, ``_created`` samples) goes to `generate_latest`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.utils import floatToGoString

from megatrace.exporters.families import FixedSeriesFamily, escape_label_value

_SIMPLE_TYPES = frozenset({"gauge", "counter"})


def render_text(registry: CollectorRegistry) -> bytes:
    """The text exposition (format 0.0.4) of everything `registry` collects now."""
    metrics = list(registry.collect())
    lines: list[str] = []
    for metric in metrics:
        if isinstance(metric, FixedSeriesFamily):
            name = metric.sample_name
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            lines.append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
            lines.extend(f"{text}{floatToGoString(value)}\n" for text, _, value in metric.series)
            continue
        if metric.type not in _SIMPLE_TYPES:
            return generate_latest(_Frozen(metrics))
        name = metric.name + "_total" if metric.type == "counter" else metric.name
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        lines.append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
        for sample in metric.samples:
            if sample.name != name or sample.timestamp is not None:
                return generate_latest(_Frozen(metrics))
            if sample.labels:
                labels = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in sorted(sample.labels.items()))
                lines.append(f"{name}{{{labels}}} {floatToGoString(sample.value)}\n")
            else:
                lines.append(f"{name} {floatToGoString(sample.value)}\n")
    return "".join(lines).encode()


class _Frozen:
    """Already-collected families, served again to `generate_latest` (so collectors run once)."""

    def __init__(self, metrics: list) -> None:
        self.metrics = metrics

    def collect(self) -> list:
        return self.metrics
