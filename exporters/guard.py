"""Runs the enabled collectors for one scrape so that a failing one never breaks the others.

Each collector's families are gathered in full before any is served: a collector that raises halfway
contributes nothing, reports ``megatrace_exporter_collector_up{collector}=0`` and counts an error, and
the rest of the scrape is served as usual. Each value is then checked on its own: a sample no
exposition can write (a number no float holds, text that is not UTF-8) or a counter below zero is
left out, and only it. A failure is logged when it starts (or its reason changes), not at every
scrape, in one line when the collector says what is missing (`CollectorDown`); its end is logged too.
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


class CollectorDown(Exception):
    """A collector cannot run for a reason its message says in full (no NVML on a CPU node): logged
    as one line, without a traceback; `announced` when the collector has logged it already."""

    def __init__(self, reason: str, announced: bool = False) -> None:
        super().__init__(reason)
        self.announced = announced


class Collector(Protocol):
    """What prometheus_client calls at scrape time."""

    def collect(self) -> Iterable[Metric]: ...


class GuardedCollectors:
    """One prometheus_client collector running named collectors, each timed and isolated."""

    def __init__(self, collectors: Mapping[str, Collector]) -> None:
        self.collectors = dict(collectors)
        self._errors = dict.fromkeys(self.collectors, 0)
        self._failing: dict[str, str | None] = dict.fromkeys(self.collectors)
        self._dropped: dict[tuple[str, str], str] = {}
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
            except Exception as exc:
                families = []
                failure = exc
            dropped = drop_unwritable(families)
            elapsed = time.perf_counter() - start
            ok = failure is None
            with self._lock:
                if not ok:
                    self._errors[name] += 1
                error_count = self._errors[name]
                self._report(name, failure)
                self._report_dropped(name, dropped)
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
        elif isinstance(failure, CollectorDown):
            if not failure.announced:
                log.warning("collector %s down: %s; exporting collector_up 0", name, failure)
        else:
            log.error(
                "collector %s failed; serving the others, exporting collector_up 0 until it recovers",
                name,
                exc_info=failure,
            )

    def _report_dropped(self, name: str, dropped: dict[str, str]) -> None:
        """Log each series left out of a scrape when it is first left out (or for a new reason)."""
        for series, reason in dropped.items():
            key = (name, series)
            if self._dropped.get(key) != reason:
                log.warning("collector %s: %s left out of the scrape: %s", name, series, reason)
        self._dropped = {k: v for k, v in self._dropped.items() if k[0] != name}
        self._dropped.update({(name, series): reason for series, reason in dropped.items()})

    def close(self) -> None:
        """Stop whatever background work the collectors hold (threads, library handles)."""
        for collector in self.collectors.values():
            close = getattr(collector, "close", None)
            if close is not None:
                close()


def drop_unwritable(families: Iterable[Metric | FixedSeriesFamily]) -> dict[str, str]:
    """Remove, in place, each sample no exposition can write (a value no float holds, text that is not
    UTF-8) and each counter below zero; returns why, by series (name and labels)."""
    dropped: dict[str, str] = {}
    for family in families:
        counter = family.type == "counter"
        if isinstance(family, FixedSeriesFamily):
            kept = []
            for text, labels, value in family.series:
                reason = _unwritable(value, labels, counter) or _not_utf8(text)
                if reason:
                    dropped[_series(family.sample_name, labels)] = reason
                else:
                    kept.append((text, labels, value))
            family.series = kept
            continue
        samples = []
        for sample in family.samples:
            reason = _unwritable(sample.value, sample.labels, counter and sample.name.endswith("_total"))
            if reason:
                dropped[_series(sample.name, sample.labels)] = reason
            else:
                samples.append(sample)
        family.samples = samples
    return dropped


def _unwritable(value: float, labels: dict[str, str], counter: bool) -> str:
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError) as exc:
        return f"a {type(value).__name__} value that cannot be exported ({str(exc)[:80]})"
    if counter and number < 0:
        return "a counter below zero"
    return next(filter(None, (_not_utf8(text) for text in labels.values())), "")


def _not_utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "text that is not UTF-8"
    return ""


def _series(name: str, labels: dict[str, str]) -> str:
    shown = ",".join(f"{key}={value!r}" for key, value in sorted(labels.items()))
    return f"{name}{{{shown}}}".encode("utf-8", "backslashreplace").decode()
