"""Runs the enabled collectors for one scrape so that a failing one never breaks the others.

Each collector's families are gathered in full, and checked to be encodable (every value a number a
float can hold, every text UTF-8), before any is served: a collector that raises halfway or gives a
value no exposition can write contributes nothing, reports ``megatrace_exporter_collector_up{collector}=0``
and counts an error, and the rest of the scrape is served as usual. A failure is logged when it starts
(or its reason changes), not at every scrape; its end is logged too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from megatrace.exporters.families import FixedSeriesFamily

log = logging.getLogger(__name__)


class Collector(Protocol):
    """What prometheus_client calls at scrape time."""

    def collect(self) -> Iterable[Metric]: ...


class GuardedCollectors:
    """One prometheus_client collector running named collectors, each timed and isolated."""

    def __init__(self, collectors: Mapping[str, Collector]) -> None:
        self.collectors = dict(collectors)
        self._errors = dict.fromkeys(self.collectors, 0)
        self._failing: dict[str, str | None] = dict.fromkeys(self.collectors)
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "megatrace_exporter_collector_up",
            "1 when the collector's last scrape succeeded, 0 when it failed.",
            labels=["collector"],
        )
        duration = GaugeMetricFamily(
            "megatrace_exporter_collector_duration_seconds",
            "Time the collector took in this scrape.",
            labels=["collector"],
        )
        errors = CounterMetricFamily(
            "megatrace_exporter_collector_errors",
            "Scrapes in which the collector failed, since the agent started.",
            labels=["collector"],
        )
        for name, collector in self.collectors.items():
            start = time.perf_counter()
            failure: Exception | None = None
            try:
                families = list(collector.collect())
                check_encodable(families)
            except Exception as exc:
                families = []
                failure = exc
            elapsed = time.perf_counter() - start
            ok = failure is None
            with self._lock:
                if not ok:
                    self._errors[name] += 1
                error_count = self._errors[name]
                self._report(name, failure)
            yield from families
            up.add_metric([name], 1.0 if ok else 0.0)
            duration.add_metric([name], elapsed)
            errors.add_metric([name], error_count)
        yield up
        yield duration
        yield errors

    def _report(self, name: str, failure: Exception | None) -> None:
        """Log a collector's failure once (again only when its reason changes), and its recovery."""
        reason = None if failure is None else f"{type(failure).__name__}: {failure}"
        previous = self._failing[name]
        self._failing[name] = reason
        if reason == previous:
            if failure is not None:
                log.debug("collector %s still failing: %s", name, reason)
            return
        if failure is None:
            log.info("collector %s recovered", name)
        else:
            log.error(
                "collector %s failed; serving the others, exporting collector_up 0 until it recovers",
                name,
                exc_info=failure,
            )

    def close(self) -> None:
        """Stop whatever background work the collectors hold (threads, library handles)."""
        for collector in self.collectors.values():
            close = getattr(collector, "close", None)
            if close is not None:
                close()


def check_encodable(families: Iterable[Metric | FixedSeriesFamily]) -> None:
    """Raise ValueError when a sample cannot be written: a value no float holds, text that is not UTF-8."""
    for family in families:
        if isinstance(family, FixedSeriesFamily):
            for text, _, value in family.series:
                _check_value(family.name, value)
                text.encode("utf-8")
            continue
        for sample in family.samples:
            _check_value(sample.name, sample.value)
            for label_value in sample.labels.values():
                label_value.encode("utf-8")


def _check_value(name: str, value: float) -> None:
    try:
        float(value)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"{name}: a {type(value).__name__} value that cannot be exported ({exc})") from None
