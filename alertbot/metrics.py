"""The bot's own Prometheus metrics, in a registry of their own (served on ``/metrics``)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class BotMetrics:
    """Counters and gauges describing intake, dedupe, delivery and drill-down."""

    def __init__(self, queue_depth: Callable[[], float] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.webhooks = Counter(
            "megatrace_alertbot_webhooks", "Webhook requests by outcome.", ["outcome"], registry=r
        )
        self.received = Counter(
            "megatrace_alertbot_alerts_received", "Alerts received (webhook and reconciliation).", registry=r
        )
        self.deduplicated = Counter(
            "megatrace_alertbot_alerts_deduplicated", "Alerts that repeated a known episode.", registry=r
        )
        self.episodes = Counter(
            "megatrace_alertbot_episodes", "New alert episodes by level.", ["level"], registry=r
        )
        self.storms = Counter(
            "megatrace_alertbot_storms", "Alert storms collapsed into one summary.", registry=r
        )
        self.sent = Counter(
            "megatrace_alertbot_notifications_sent", "Notifications delivered.", ["channel"], registry=r
        )
        self.failed = Counter(
            "megatrace_alertbot_notifications_failed", "Failed delivery attempts.", ["channel"], registry=r
        )
        self.dead = Counter(
            "megatrace_alertbot_dead_letters",
            "Notifications given up on (kept in the store as dead letters).",
            ["channel"],
            registry=r,
        )
        self.suppressed = Counter(
            "megatrace_alertbot_notifications_suppressed",
            "Held-back notifications dropped because the alert resolved first (flapping).",
            registry=r,
        )
        self.latency = Histogram(
            "megatrace_alertbot_delivery_latency_seconds",
            "Time from an alert entering the outbox to its delivery.",
            ["channel"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
            registry=r,
        )
        self.drilldowns = Counter(
            "megatrace_alertbot_drilldowns", "Drill-downs by outcome.", ["outcome"], registry=r
        )
        self.archived = Counter(
            "megatrace_alertbot_archived_rows", "Rows appended to the Feishu sheet.", registry=r
        )
        self.quarantined = Counter(
            "megatrace_alertbot_alerts_quarantined",
            "Alerts set aside because they could not be processed (kept in the store's quarantine).",
            registry=r,
        )
        self.queue_depth = Gauge(
            "megatrace_alertbot_queue_depth", "Notifications waiting to be delivered.", registry=r
        )
        if queue_depth is not None:
            self.queue_depth.set_function(queue_depth)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
