"""Benchmark of the alert bot: a burst of 10 000 alerts against a real bot process and a local Feishu.

Prints: ingest throughput and webhook latency (p50/p99), how long until every alert was processed,
what was delivered (individual cards, storm summaries) and that none was lost, that Feishu never had
to refuse a message (rate limits, 20 KB), and the time from webhook to delivery of a single P0.

    .venv/bin/python bench/bench_alertbot.py [--alerts 10000] [--per-webhook 1] [--clients 16]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.feishu_server import FeishuServer
from tests.support.services import free_port, running

TOKEN = "bench-token-0123456789"
KINDS = [
    ("MegatraceJobHang", "P0"),
    ("MegatraceSlowRank", "P1"),
    ("MegatraceInfinibandLinkDown", "P1"),
    ("MegatraceGpuThrottled", "P2"),
    ("MegatraceGpuXidError", "P1"),
]


def alert(i: int, name: str, severity: str, starts: str) -> dict:
    labels = {
        "alertname": name,
        "severity": severity,
        "job": "llm-bench",
        "rank": str(i),
        "instance": f"gpu-{i // 8}:9450",
    }
    return {
        "status": "firing",
        "labels": labels,
        "annotations": {
            "summary": f"{name} rank {i}",
            "description": "benchmark alert",
            "runbook_url": "https://rb",
        },
        "startsAt": starts,
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus:9090/graph",
        "fingerprint": f"{abs(hash((name, i))):016x}"[:16],
    }


def webhook(alerts: list[dict]) -> dict:
    return {
        "version": "4",
        "status": "firing",
        "receiver": "megatrace",
        "groupKey": "bench",
        "externalURL": "http://alertmanager:9093",
        "truncatedAlerts": 0,
        "alerts": alerts,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alerts", type=int, default=10_000)
    parser.add_argument("--per-webhook", type=int, default=1, help="alerts per webhook body")
    parser.add_argument("--clients", type=int, default=16, help="concurrent senders")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-alertbot-"))
    with FeishuServer() as feishu:
        hooks = {level: feishu.add_bot(secret=f"secret-{level}") for level in ("P0", "P1", "P2")}
        port = free_port()
        cfg = {
            "listen": f"127.0.0.1:{port}",
            "auth": {"bearer_token": TOKEN},
            "store": {"path": str(work / "bot.db")},
            "dedupe": {"storm_threshold": 5, "storm_window_s": 120, "storm_hold_s": 2},
            "feishu": {
                "base_url": feishu.url,
                "group_bots": {
                    level: {"webhook": url, "secret": f"secret-{level}"} for level, url in hooks.items()
                },
                "app": {"app_id": feishu.app_id, "app_secret": feishu.app_secret, "chats": {"P0": "oc_p0"}},
            },
        }
        (work / "bot.yaml").write_text(yaml.safe_dump(cfg))
        argv = [
            sys.executable,
            "-m",
            "megatrace.cli",
            "--log-level",
            "warning",
            "alertbot",
            "--config",
            str(work / "bot.yaml"),
        ]
        base = f"http://127.0.0.1:{port}"
        with running(argv, f"{base}/healthz", work / "bot.log"):
            starts = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
            alerts = [alert(i, *KINDS[i % len(KINDS)], starts) for i in range(args.alerts)]
            bodies = [
                json.dumps(webhook(alerts[i : i + args.per_webhook]))
                for i in range(0, len(alerts), args.per_webhook)
            ]
            session_pool = [requests.Session() for _ in range(args.clients)]
            headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}

            def post(index: int) -> tuple[int, float]:
                session = session_pool[index % args.clients]
                began = time.perf_counter()
                answer = session.post(f"{base}/alertmanager", data=bodies[index], headers=headers, timeout=60)
                return answer.status_code, time.perf_counter() - began

            began = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                results = list(pool.map(post, range(len(bodies))))
            ingest_s = time.perf_counter() - began
            latencies = [lat for _, lat in results]
            failed = sum(1 for status, _ in results if status != 200)

            db = sqlite3.connect(work / "bot.db", timeout=30)
            while db.execute("SELECT COUNT(*) FROM inbox WHERE processed_at IS NULL").fetchone()[0]:
                time.sleep(0.2)
            processed_s = time.perf_counter() - began
            while db.execute("SELECT COUNT(*) FROM outbox WHERE state IN ('pending','sending')").fetchone()[
                0
            ]:
                time.sleep(0.5)
            delivered_s = time.perf_counter() - began
            episodes = db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]
            individual = db.execute("SELECT COUNT(*) FROM episodes WHERE storm_id IS NULL").fetchone()[0]
            in_sent_storms = db.execute(
                "SELECT COUNT(*) FROM episodes e JOIN outbox o ON o.storm_id = e.storm_id"
                " AND o.kind = 'storm' AND o.state = 'sent' AND o.channel = 'bot'"
            ).fetchone()[0]
            storms = db.execute("SELECT COUNT(*) FROM storms").fetchone()[0]
            states = dict(db.execute("SELECT state, COUNT(*) FROM outbox GROUP BY state").fetchall())
            posts = feishu.bot_posts() + feishu.messages()
            biggest = max(len(json.dumps(p.body, ensure_ascii=False).encode()) for p in posts)

            single = []
            for n in range(5):
                one = alert(
                    100_000 + n,
                    f"BenchSingleP0{n}",
                    "P0",
                    time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
                )
                before = len(feishu.messages("oc_p0"))
                began_one = time.perf_counter()
                requests.post(
                    f"{base}/alertmanager", data=json.dumps(webhook([one])), headers=headers, timeout=10
                )
                feishu.wait_for(lambda b=before: len(feishu.messages("oc_p0")) > b, timeout=30)
                single.append(time.perf_counter() - began_one)
                time.sleep(0.3)

        p50, p99 = statistics.median(latencies) * 1000, percentile(latencies, 0.99) * 1000
        unexplained = episodes - individual - in_sent_storms
        lines = [
            f"alerts posted:               {args.alerts} in {len(bodies)} webhooks, {args.clients} clients",
            f"webhook answers not 200:     {failed}",
            f"ingest throughput:           {args.alerts / ingest_s:,.0f} alerts/s ({ingest_s:.2f} s)",
            f"webhook latency p50 / p99:   {p50:.1f} ms / {p99:.1f} ms",
            f"all processed into episodes: {processed_s:.2f} s after the burst began ({episodes} episodes)",
            f"outbox drained:              {delivered_s:.2f} s; outbox states {states}",
            f"notified individually:       {individual}; in sent storm summaries: {in_sent_storms}",
            f"storm summaries:             {storms}",
            f"lost:                        {args.alerts - episodes} not stored, {unexplained} never notified",
            f"Feishu messages accepted:    {len(posts)}; refused: {len(feishu.rejections)}",
            f"largest message body:        {biggest} bytes (limit 20480)",
            f"single P0 webhook→delivery:  median {statistics.median(single) * 1000:.0f} ms, "
            f"max {max(single) * 1000:.0f} ms (5 runs)",
        ]
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
