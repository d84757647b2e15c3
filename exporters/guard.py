"""Runs the enabled collectors for one scrape so that a failing one never breaks the others.

Each collector's families are gathered in full before any is served: a collector that raises halfway
contributes nothing, reports ``megatrace_exporter_collector_up{collector}=0`` and counts an error,
and the rest of the scrape is served as usual.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)


class Collector(Protocol):
    """What prometheus_client calls at scrape time."""

    def collect(self) -> Iterable[Metric]: ...


class GuardedCollectors:
    """One prometheus_client collector running named collectors, each timed and isolated."""

    def __init__(self, collectors: Mapping[str, Collector]) -> None:
        self.collectors = dict(collectors)
        self._errors = dict.fromkeys(self.collectors, 0)
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
            try:
                families = list(collector.collect())
                ok = True
            except Exception:
                log.exception("collector %s failed; serving the others", name)
                families = []
                ok = False
            elapsed = time.perf_counter() - start
            with self._lock:
                if not ok:
                    self._errors[name] += 1
                error_count = self._errors[name]
            yield from families
            up.add_metric([name], 1.0 if ok else 0.0)
            duration.add_metric([name], elapsed)
            errors.add_metric([name], error_count)
        yield up
        yield duration
        yield errors

    def close(self) -> None:
        """Stop whatever background work the collectors hold (threads, library handles)."""
        for collector in self.collectors.values():
            close = getattr(collector, "close", None)
            if close is not None:
                close()
