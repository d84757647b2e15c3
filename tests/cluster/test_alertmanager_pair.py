"""kill -9 of one Alertmanager of the HA pair during a 1,000-alert burst: the survivor (which has the
alerts too, as Prometheus sends every alert to both) notifies for them, and the bots' shared store
turns the two Alertmanagers' notifications into one card per alert."""

from __future__ import annotations

import time

import pytest

from tests.cluster.bursts import Burst
from tests.cluster.conftest import AlertPath
from tests.cluster.faults import program_killed

pytestmark = pytest.mark.xdist_group("alertmanager-pair")
ALERTS = 1000


@pytest.mark.slow
def test_kill_9_of_one_alertmanager_during_a_burst(alert_path: AlertPath) -> None:
    burst = Burst(alert_path, "am-kill", ALERTS, batch=100).start()
    burst.wait_posted(ALERTS * 3 // 10)
    with program_killed(alert_path.alertmanagers[0]):
        killed = time.time()
        burst.join()
        done = burst.wait_until(ALERTS, timeout=240)
        time.sleep(3)  # a doubled card would arrive by now
    figures = burst.figures()
    assert burst.refused > 0  # the burst went on while one Alertmanager was dead
    assert figures == {"delivered": ALERTS, "expected": ALERTS, "duplicates": 0}, figures
    print(f"figure: alertmanager kill -9: {figures}, last card {done - killed:.1f}s after the kill")
