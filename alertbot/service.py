"""The running bot: HTTP server, the worker loop (stored webhooks → outbox → delivery), drill-down
workers and the APScheduler jobs (reconciliation, sheet archive, retention, weekly report)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from apscheduler.schedulers.background import BackgroundScheduler

from megatrace.alertbot.actions import Actions
from megatrace.alertbot.alertmanager import AlertmanagerError, reconcile
from megatrace.alertbot.cards import CardRenderer
from megatrace.alertbot.channels import CHANNELS, FALLBACK, card_message
from megatrace.alertbot.config import AlertbotConfig, app_configured, cron_trigger
from megatrace.alertbot.delivery import ConsoleSink, Delivery
from megatrace.alertbot.drilldown import DrilldownRunner
from megatrace.alertbot.feishu import FeishuApp
from megatrace.alertbot.grading import load_policy
from megatrace.alertbot.kinds import NotificationKind
from megatrace.alertbot.metrics import BotMetrics
from megatrace.alertbot.oncall import Escalator
from megatrace.alertbot.pipeline import Pipeline, idempotency_key
from megatrace.alertbot.ratelimit import RateLimiter, SharedRateLimiter
from megatrace.alertbot.report import weekly_report, write_workbook
from megatrace.alertbot.server import make_server
from megatrace.alertbot.store import open_store
from megatrace.alertbot.store.records import NewNotification

log = logging.getLogger(__name__)
QUIET_LOGGERS = ("apscheduler",)  # logs every job run at INFO: once a minute or more, nothing to act on
# The worker wakes at least once a second; a round that has not succeeded for this long is "stuck".
WORKER_STALL_S = 120.0
# While rounds keep failing, the failure is logged with its traceback at most this often.
FAILURE_LOG_EVERY_S = 30.0


def load_callbacks(cfg: AlertbotConfig) -> None:
    """Import the callback code (lark-oapi takes seconds) and set up its cipher at start, never
    inside a request: Feishu gives ``url_verification`` 1 s and a card action 3 s."""
    from megatrace.alertbot import callbacks

    if cfg.feishu.callback.mode == "request_url":
        callbacks.warm_up(cfg.feishu.callback)


class Service:
    """Everything the bot runs, built from one configuration."""

    def __init__(self, cfg: AlertbotConfig, listen: bool = True) -> None:
        """`listen=False` builds everything but the HTTP server (``alertbot report --send`` runs
        beside a bot that holds the port)."""
        self.cfg = cfg
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        # What can fail on bad settings or a busy port comes first: a failed start leaves no database.
        policy = load_policy(cfg.grading.policy_file) if cfg.grading.policy_file else []
        self.renderer = CardRenderer(cfg.templates_dir, cfg.links, cfg.report.timezone)
        if cfg.feishu.callback.mode:
            load_callbacks(cfg)
        self.httpd = make_server(self) if listen else None
        try:
            self.store = open_store(cfg.store.url, cfg.store.path, cfg.store.synchronous)
        except BaseException:
            if self.httpd is not None:
                self.httpd.server_close()
            raise
        self.metrics = BotMetrics(queue_depth=self.store.outbox.queue_depth)
        self.pipeline = Pipeline(self.store, cfg, policy, self.metrics)
        app = cfg.feishu.app
        self.app = (
            FeishuApp(cfg.feishu.base_url, app.app_id, app.app_secret, cfg.feishu.timeout_s)
            if app_configured(cfg)
            else None
        )
        # This process among the replicas sharing the database: owner of its send and job leases.
        self.replica = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.shared = bool(cfg.store.url)
        self.delivery = Delivery(
            self.store,
            cfg,
            self.renderer,
            self.metrics,
            self.app,
            ConsoleSink(cfg.delivery.console_path),
            limiter=SharedRateLimiter(self.store) if self.shared else RateLimiter(),
            owner=self.replica,
            lease_s=cfg.store.lease_s,
        )
        self.actions = Actions(self.store, cfg, self.pipeline, self.wake)
        self.escalator = Escalator(self.store, cfg, self.pipeline)
        self._last_takeover = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.drilldowns = DrilldownRunner(self.pipeline, cfg.drilldown, self.metrics, self.wake)
        self.scheduler = BackgroundScheduler(timezone=cfg.report.timezone)
        self._threads: list[threading.Thread] = []
        self.stall_after_s = WORKER_STALL_S
        self._last_round = time.monotonic()  # when the worker last finished a round without failing
        self._round_error: Exception | None = None  # what the last round failed with, if it failed
        self._last_failure_log = 0.0

    @property
    def port(self) -> int:
        assert self.httpd is not None, "built with listen=False"
        return int(self.httpd.server_address[1])

    def wake(self) -> None:
        self._wake.set()

    def liveness(self) -> tuple[int, dict[str, Any]]:
        """``/healthz``: 503 only when restarting the process would help: a thread died, or the
        worker has not finished a round for `stall_after_s` for a reason other than the store (a
        store outage is readiness's business: a restart cannot bring the database back)."""
        if not all(t.is_alive() for t in self._threads):
            return 503, {"status": "worker stopped"}
        if self._store_failed():  # not asked again: callers queue on a store that is reconnecting
            return 200, {"status": "store unavailable", "error": type(self._round_error).__name__}
        try:
            counts = self._counts()
        except Exception as exc:
            return 200, {"status": "store unavailable", "error": type(exc).__name__}
        stalled_for = time.monotonic() - self._last_round
        if stalled_for > self.stall_after_s and not self._store_failed():
            return 503, {"status": "worker stuck", "seconds_since_last_round": round(stalled_for), **counts}
        return 200, {"status": "ok", **counts}

    def readiness(self) -> tuple[int, dict[str, Any]]:
        """``/readyz``: 200 while alerts move: the store answers and the worker finished a round
        without failing within `stall_after_s`; 503 otherwise, naming the cause."""
        try:
            counts = self._counts()
        except Exception as exc:
            return 503, {"status": "store unavailable", "error": type(exc).__name__}
        if not all(t.is_alive() for t in self._threads):
            return 503, {"status": "worker stopped", **counts}
        stalled_for = time.monotonic() - self._last_round
        if stalled_for > self.stall_after_s:
            cause = {"error": type(self._round_error).__name__} if self._round_error else {}
            return 503, {
                "status": "worker stuck",
                "seconds_since_last_round": round(stalled_for),
                **cause,
                **counts,
            }
        return 200, {"status": "ok", **counts}

    def _counts(self) -> dict[str, int]:
        return {
            "queue": self.store.outbox.queue_depth(),
            "dead": len(self.store.outbox.dead_letters()),
            "quarantined": self.store.inbox.quarantine_count(),
        }

    def _store_failed(self) -> bool:
        return isinstance(self._round_error, self.store.errors)

    # -- the worker -----------------------------------------------------------------------------

    def work_once(self) -> bool:
        """One round of the worker; True when stored webhooks are still waiting. Replicas sharing a
        database take over the sends of a replica whose leases expired (it died mid-send)."""
        now = time.time()
        processed = self.pipeline.process_inbox(now)
        if self.shared and now - self._last_takeover >= self.cfg.store.lease_s / 4:
            self._last_takeover = now
            taken = self.delivery.recover(now, expired_only=True)
            if taken:
                log.warning("took over %d deliveries whose replica stopped mid-send", taken)
        if self.leader(now):
            self.drilldowns.submit_pending()
        self.delivery.deliver_due()
        return processed > 0

    def leader(self, now: float) -> bool:
        """Whether this replica runs the cluster's scheduled work now (holds the scheduler lease)."""
        return self.store.coordination.hold_lease("scheduler", self.replica, now, self.cfg.store.lease_s)

    def once_per_cluster(self, job: Callable[[], Any]) -> Callable[[], None]:
        """`job` run only by the replica holding the scheduler lease."""

        def run() -> None:
            if self.leader(time.time()):
                job()

        return run

    def escalate(self, now: float | None = None) -> int:
        taken = self.escalator.tick(time.time() if now is None else now)
        if taken:
            self.wake()
        return taken

    def card_action(self, callback: dict[str, Any], source: str) -> dict[str, Any]:
        return self.actions.handle(callback, source, time.time())

    def _worker(self) -> None:
        """Rounds until stopped. No exception ends it: a round that fails (the database gone, a bug)
        is logged and retried a second later, and readiness says so until a round succeeds."""
        while not self._stop.is_set():
            try:
                more = self.work_once()
                next_due = None if more else self.store.outbox.next_due()
            except Exception as exc:
                self._round_failed(exc)
                more, next_due = False, None
            else:
                self._round_succeeded()
            if more:
                continue
            timeout = 1.0 if next_due is None else min(1.0, max(0.0, next_due - time.time()))
            self._wake.wait(timeout)
            self._wake.clear()

    def _round_succeeded(self) -> None:
        if self._round_error is not None:
            log.warning("worker rounds succeed again after %s", type(self._round_error).__name__)
        self._round_error = None
        self._last_round = time.monotonic()

    def _round_failed(self, exc: Exception) -> None:
        now = time.monotonic()
        if self._round_error is None or now - self._last_failure_log >= FAILURE_LOG_EVERY_S:
            self._last_failure_log = now
            log.error("worker round failed; retrying every second until it succeeds", exc_info=exc)
        self._round_error = exc

    # -- scheduled jobs -------------------------------------------------------------------------

    def reconcile(self) -> None:
        try:
            missed = reconcile(self.store, self.cfg.alertmanager, time.time(), self.pipeline.quarantine)
        except AlertmanagerError as exc:
            log.warning("reconciliation failed: %s", exc)
            return
        if any(missed):
            self.wake()

    def retention(self) -> None:
        counts = self.store.purge(time.time() - self.cfg.store.retention_days * 86400)
        log.info("retention: deleted %s", counts)

    def weekly_report(self) -> None:
        """The scheduled report, written by one replica of the cluster; a run its replica left
        unfinished (it died) is taken over once its lease expires (`resume_reports`)."""
        zone = ZoneInfo(self.cfg.report.timezone)
        until = datetime.now(zone).replace(hour=0, minute=0, second=0, microsecond=0)
        self.report_once(until - timedelta(days=7), until)

    def report_once(self, since: datetime, until: datetime) -> bool:
        slot = f"{since.timestamp():.0f}-{until.timestamp():.0f}"
        now = time.time()
        if not self.store.coordination.claim_run("report", slot, self.replica, now, self.cfg.store.lease_s):
            return False
        self.queue_report(since, until)
        self.store.coordination.finish_run("report", slot, time.time())
        return True

    def resume_reports(self) -> None:
        zone = ZoneInfo(self.cfg.report.timezone)
        for run in self.store.coordination.unfinished_runs("report", time.time()):
            since, until = (datetime.fromtimestamp(float(t), zone) for t in run.slot.split("-"))
            self.report_once(since, until)

    def queue_report(self, since: datetime, until: datetime, on_demand: bool = False) -> dict[str, Any]:
        """Write the workbook for [since, until) and queue it (file + summary card) for delivery;
        the summary's ``outbox`` lists the queued notification ids. The scheduled report of a period
        is sent once however often the job fires; an on-demand one is sent every time."""
        name = f"megatrace-alerts-{since:%Y%m%d}-{until:%Y%m%d}.xlsx"
        path = Path(self.cfg.report.directory) / name
        r = self.cfg.report
        report = weekly_report(
            self.store, since.timestamp(), until.timestamp(), r.top_n, r.timezone, self.cfg.oncall
        )
        summary = write_workbook(report, path)
        card = self.renderer.report_card(summary)
        now = time.time()
        ref = f"{since.timestamp():.0f}-{until.timestamp():.0f}" + (f"@{now}" if on_demand else "")
        chat = self.cfg.report.chat
        takers = [name for name, channel in CHANNELS.items() if channel.receives_reports]
        file_message: dict[str, object] = {"msg_type": "file", "path": str(path)}
        messages: list[tuple[NotificationKind, str, str, dict[str, object]]] = (
            [(NotificationKind.REPORT_FILE, name, chat, file_message) for name in takers]
            + [(NotificationKind.REPORT, name, chat, card_message(card)) for name in takers]
            if chat
            else [(NotificationKind.REPORT, FALLBACK, "report", card_message(card) | {"path": str(path)})]
        )
        summary["outbox"] = []
        for kind, channel, destination, payload in messages:
            new = NewNotification(
                kind=kind,
                channel=channel,
                destination=destination,
                level="P3",
                idem_key=idempotency_key(kind, ref, channel, destination),
                created_at=now,
                not_before=now,
                payload=json.dumps(payload, ensure_ascii=False),
            )
            queued = self.store.outbox.enqueue(new)
            if queued is not None:
                summary["outbox"].append(queued)
        self.wake()
        log.info("weekly report %s written (%d episodes)", path, summary["total"])
        return summary

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self.httpd is None:
            raise RuntimeError("a Service built with listen=False cannot be started")
        recovered = self.delivery.recover(expired_only=self.shared)
        if recovered:
            log.warning("recovered %d deliveries left in flight by the previous run", recovered)
        self._last_round = time.monotonic()
        for name, target in (("http", self.httpd.serve_forever), ("worker", self._worker)):
            thread = threading.Thread(target=target, name=f"alertbot-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        cfg = self.cfg
        if cfg.feishu.callback.mode == "long_connection":
            self.start_long_connection()
        if cfg.oncall.escalation:
            self.scheduler.add_job(
                self.once_per_cluster(self.escalate), "interval", seconds=cfg.oncall.tick_s, max_instances=1
            )
        self.scheduler.add_job(
            self.once_per_cluster(self.resume_reports),
            "interval",
            seconds=cfg.store.lease_s,
            max_instances=1,
        )
        if cfg.alertmanager.url:
            self.scheduler.add_job(
                self.once_per_cluster(self.reconcile),
                "interval",
                seconds=cfg.alertmanager.reconcile_interval_s,
                max_instances=1,
                next_run_time=datetime.now(ZoneInfo(cfg.report.timezone)),
            )
        else:
            log.warning(
                "reconciliation is off (alertmanager.url unset): alerts of a webhook the bot cannot "
                "take (a refused body, an outage longer than Alertmanager's retries) are lost"
            )
        if cfg.feishu.sheet.spreadsheet_token:
            self.scheduler.add_job(
                self.once_per_cluster(self.delivery.flush_archive),
                "interval",
                seconds=cfg.feishu.sheet.flush_interval_s,
                max_instances=1,
            )
        self.scheduler.add_job(self.once_per_cluster(self.retention), "interval", hours=6, max_instances=1)
        self.scheduler.add_job(
            self.weekly_report,
            cron_trigger(cfg.report.cron, cfg.report.timezone),
            max_instances=1,
        )
        self.scheduler.start()
        log.info("alert bot listening on %s:%d", *self.httpd.server_address[:2])

    def start_long_connection(self) -> None:
        """Receive card actions over lark-oapi's websocket to Feishu (no public address needed)."""
        from megatrace.alertbot.callbacks import long_connection, start_long_connection

        app = self.cfg.feishu.app
        domain = self.cfg.feishu.callback.long_connection_url or self.cfg.feishu.base_url
        client = long_connection(app.app_id, app.app_secret, domain, self.card_action)
        self._threads.append(start_long_connection(client))

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        for thread in self._threads:
            if thread.name != "alertbot-feishu-ws":  # the SDK's client has no stop; it is a daemon
                thread.join(timeout=10)
        self.drilldowns.shutdown()
        if self.cfg.feishu.sheet.spreadsheet_token:
            self.delivery.flush_archive()
        with contextlib.suppress(*self.store.errors):  # another replica takes the scheduler at once
            self.store.coordination.release_lease("scheduler", self.replica)
        self.store.close()

    def run_forever(self) -> None:
        """Start, then block until SIGTERM or SIGINT; stops cleanly."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        self.start()
        stop.wait()
        log.info("stopping")
        self.stop()
