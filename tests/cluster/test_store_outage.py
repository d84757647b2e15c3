"""PostgreSQL goes down under both bot replicas during a 500-alert burst through the Alertmanager pair:
while it is down each replica answers webhooks 503 (Alertmanager keeps them and retries) and fails
readiness, but stays live (its workers survive the store's exceptions); once it is back, every alert
is delivered exactly once, with no restart."""

from __future__ import annotations

import time

import pytest
import requests

from tests.alertbot.conftest import TOKEN, alert, webhook
from tests.cluster.bursts import Burst
from tests.cluster.conftest import AlertPath
from tests.cluster.control import BOT_PORTS
from tests.cluster.faults import postgres_down
from tests.support.helm_chart import by_component

ALERTS = 500


def probe(path: AlertPath) -> dict[str, list[int | str]]:
    """Each replica's answer to a webhook, and to its readiness and liveness probes as the kubelet
    sends them (the chart's timeoutSeconds; no answer in time is a failed probe, "timeout")."""
    container = by_component(path.control.objects, "Deployment", "alertbot")["spec"]["template"]["spec"]
    probes = container["containers"][0]
    found: dict[str, list[int | str]] = {"webhook": [], "readyz": [], "healthz": []}
    for port in BOT_PORTS:
        base = f"http://127.0.0.1:{port}"
        body = webhook(alert("MegatraceClusterProbe", severity="P3", probe=str(time.time())))
        try:
            answer = path.control.post(
                f"{base}/alertmanager", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
            )
            found["webhook"].append(answer.status_code)
        except requests.Timeout:
            found["webhook"].append("timeout")
        for key, probe_name in (("readyz", "readinessProbe"), ("healthz", "livenessProbe")):
            spec = probes[probe_name]
            try:
                status = path.control.get(f"{base}{spec['httpGet']['path']}", timeout=spec["timeoutSeconds"])
                found[key].append(status.status_code)
            except requests.Timeout:
                found[key].append("timeout")
    return found


def outage(path: AlertPath, tag: str, down_s: float) -> None:
    burst = Burst(path, tag, ALERTS).start()
    burst.wait_posted(ALERTS // 5)  # mid-burst
    with postgres_down(path.control):
        went_down = time.monotonic()
        during = probe(path)
        time.sleep(max(0.0, down_s - (time.monotonic() - went_down)))
        late = probe(path)
    back = time.time()
    burst.join()
    done = burst.wait_until(ALERTS, timeout=240)
    time.sleep(3)  # a doubled card would arrive by now
    after = probe(path)
    figures = burst.figures()
    problems = [
        f"{what}: {found}"
        for what, found, ok in (
            ("replicas alive", [bot.alive for bot in path.bots], all(bot.alive for bot in path.bots)),
            (
                "webhooks while down (503 wanted)",
                [during["webhook"], late["webhook"]],
                during["webhook"] == late["webhook"] == [503, 503],
            ),
            (
                "readiness while down (failing wanted)",
                [during["readyz"], late["readyz"]],
                200 not in during["readyz"] + late["readyz"],
            ),
            (
                "liveness while down (200 wanted)",
                [during["healthz"], late["healthz"]],
                during["healthz"] == late["healthz"] == [200, 200],
            ),
            (
                "after (all 200 wanted)",
                after,
                after == {"webhook": [200, 200], "readyz": [200, 200], "healthz": [200, 200]},
            ),
            (
                "deliveries (each once wanted)",
                figures,
                figures == {"delivered": ALERTS, "expected": ALERTS, "duplicates": 0},
            ),
        )
        if not ok
    ]
    print(f"figure: postgres down {down_s:.0f}s: {figures}, last card {done - back:.1f}s after it came back")
    assert not problems, problems


@pytest.mark.slow
@pytest.mark.xdist_group("store-outage-15s")
def test_postgres_down_15s_during_a_burst(alert_path: AlertPath) -> None:
    outage(alert_path, "pg15", 15)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.xdist_group("store-outage-120s")  # beside the other cluster tests, not after them
def test_postgres_down_120s_during_a_burst(alert_path: AlertPath) -> None:
    outage(alert_path, "pg120", 120)
