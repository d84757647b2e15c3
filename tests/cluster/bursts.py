"""Alert bursts through the Alertmanager pair, as Prometheus sends them (every alert to every
Alertmanager), and the count of what reached Feishu: each alert's card once, none lost, none doubled."""

from __future__ import annotations

import collections
import re
import threading
import time

import requests

from megatrace.alertbot.payload import format_time
from megatrace.demo import card_text
from tests.cluster.conftest import AlertPath
from tests.cluster.control import ALERTMANAGER_PORTS

CHAT = "oc_p2"


class Burst:
    """`total` P2 alerts named by `tag`, posted in batches to both Alertmanagers from a thread."""

    def __init__(self, path: AlertPath, tag: str, total: int, batch: int = 50, pause_s: float = 1.0) -> None:
        self.path, self.tag, self.total, self.batch, self.pause_s = path, tag, total, batch, pause_s
        self.started = time.time()
        self.refused = 0  # posts an Alertmanager did not take (it was down)
        self.posted = 0
        self._thread = threading.Thread(target=self._post_all, name=f"burst-{tag}", daemon=True)
        self._counts: collections.Counter[int] = collections.Counter()
        self._read = 0  # messages of the chat already counted
        self._pattern = re.compile(rf"\b{re.escape(tag)} alert (\d+)\b")

    def alerts(self, first: int, count: int) -> list[dict]:
        """Alerts as Prometheus posts them: one `startsAt` (when the rule fired) for every Alertmanager,
        `endsAt` four minutes ahead (Prometheus resends before that)."""
        now = time.time()
        return [
            {
                "labels": {
                    "alertname": "MegatraceClusterBurst",
                    "severity": "P2",
                    "burst": self.tag,
                    "rank": str(r),
                },
                "annotations": {"summary": f"{self.tag} alert {r}"},
                "startsAt": format_time(self.started),
                "endsAt": format_time(now + 240),
            }
            for r in range(first, min(first + count, self.total))
        ]

    def _post_all(self) -> None:
        for first in range(0, self.total, self.batch):
            batch = self.alerts(first, self.batch)
            for port in ALERTMANAGER_PORTS:
                try:
                    self.path.control.post(
                        f"http://127.0.0.1:{port}/api/v2/alerts", json=batch
                    ).raise_for_status()
                except requests.RequestException:
                    self.refused += 1
            self.posted = first + len(batch)
            time.sleep(self.pause_s)

    def start(self) -> Burst:
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join()

    def delivered(self) -> collections.Counter[int]:
        """How many cards each alert of the burst got at Feishu (first sends, not updates); reads only
        the messages that arrived since the last call."""
        records = self.path.control.feishu.messages(CHAT)
        for record in records[self._read :]:
            match = self._pattern.search(card_text({"card": record.body["content"]}))
            if match:
                self._counts[int(match.group(1))] += 1
        self._read = len(records)
        return collections.Counter(self._counts)

    def wait_posted(self, count: int, timeout: float = 60.0) -> None:
        """Wait until the first `count` alerts were posted (the burst goes on)."""
        deadline = time.monotonic() + timeout
        while self.posted < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.tag}: only {self.posted} of {count} alerts posted in {timeout}s")
            time.sleep(0.05)

    def wait_until(self, count: int, timeout: float) -> float:
        """Wait until `count` distinct alerts were delivered; the time.time() when that was seen."""
        deadline = time.monotonic() + timeout
        while len(self.delivered()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.tag}: {len(self.delivered())} of {count} alerts delivered in {timeout}s"
                )
            time.sleep(0.25)
        return time.time()

    def figures(self) -> dict[str, int]:
        counts = self.delivered()
        return {
            "delivered": len(counts),
            "expected": self.total,
            "duplicates": sum(n - 1 for n in counts.values()),
        }
