"""PostgreSQL goes down under both bot replicas during a 500-alert burst through the Alertmanager pair:
while it is down each replica answers webhooks 503 (Alertmanager keeps them and retries) and fails
readiness, but stays live (its workers survive the store's exceptions); once it is back, every alert
is delivered exactly once, with no restart."""

from __future__ import annotations

import time

import pytest

from tests.alertbot.conftest import TOKEN, alert, webhook
from tests.cluster.bursts import Burst
from tests.cluster.conftest import AlertPath
from tests.cluster.control import BOT_PORTS
from tests.cluster.faults import postgres_down

pytestmark = pytest.mark.xdist_group("store-outage")
ALERTS = 500


def probe(path: AlertPath) -> dict[str, list[int]]:
    """Each replica's answer to a webhook, its readiness and its liveness, right now."""
    found: dict[str, list[int]] = {"webhook": [], "readyz": [], "healthz": []}
    for port in BOT_PORTS:
        base = f"http://127.0.0.1:{port}"
        body = webhook(alert("MegatraceClusterProbe", severity="P3", probe=str(time.time())))
        answer = path.control.post(
            f"{base}/alertmanager", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        found["webhook"].append(answer.status_code)
        found["readyz"].append(path.control.get(f"{base}/readyz").status_code)
        found["healthz"].append(path.control.get(f"{base}/healthz").status_code)
    return found


def outage(path: AlertPath, tag: str, down_s: float) -> None:
    burst = Burst(path, tag, ALERTS).start()
    burst.wait_posted(ALERTS // 5)  # mid-burst
    with postgres_down(path.control):
        went_down = time.monotonic()
        during = probe(path)
        time.sleep(max(0.0, down_s - (time.monotonic() - went_down)))
        during_late = probe(path)
    back = time.time()
    burst.join()
    done = burst.wait_until(ALERTS, timeout=240)
    time.sleep(3)  # a doubled card would arrive by now
    after = probe(path)
    figures = burst.figures()
    assert all(bot.alive for bot in path.bots), "a replica exited"
    assert during["webhook"] == [503, 503] and during_late["webhook"] == [503, 503], (during, during_late)
    assert all(code != 200 for code in during["readyz"] + during_late["readyz"]), (during, during_late)
    assert during["healthz"] == [200, 200] and during_late["healthz"] == [200, 200], (during, during_late)
    assert after == {"webhook": [200, 200], "readyz": [200, 200], "healthz": [200, 200]}, after
    assert figures == {"delivered": ALERTS, "expected": ALERTS, "duplicates": 0}, figures
    print(f"figure: postgres down {down_s:.0f}s: {figures}, last card {done - back:.1f}s after it came back")


@pytest.mark.slow
def test_postgres_down_15s_during_a_burst(alert_path: AlertPath) -> None:
    outage(alert_path, "pg15", 15)


@pytest.mark.slow
def test_postgres_down_120s_during_a_burst(alert_path: AlertPath) -> None:
    outage(alert_path, "pg120", 120)
