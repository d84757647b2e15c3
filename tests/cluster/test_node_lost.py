"""The culprit's whole node is lost (cable pulled, agent and ranks gone) under a running 8-rank job:
the other ranks wait for its ranks forever, its series go stale, and the page that reaches Feishu
through the chart's rules, the Alertmanager pair and the bots names that node, and the drill-down
does not contradict it. The rules run with `for:` and windows divided by `RULES_FACTOR`."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests.cluster.cards import wait_for_card
from tests.cluster.conftest import (
    RANKS_PER_NODE,
    AlertPath,
    Cluster,
    build_cluster,
    drilldown_settings,
    start_alert_path,
    wait_for_series,
)
from tests.cluster.faults import node_lost

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("node-lost")]

RULES_FACTOR = 12  # MegatraceJobHang's `for: 2m` becomes 10s
LOST = 3


@pytest.fixture(scope="module")
def lost_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, AlertPath]]:
    """A cluster whose job runs (no fault injected), with rules, alerting and the HA alert path."""
    with build_cluster(tmp_path_factory.mktemp("node-lost")) as cluster:
        job = cluster.nodes.start_job("llm-lost", RANKS_PER_NODE, steps=1_000_000)
        cluster.control.start_prometheus(cluster.nodes.pods(), rules_factor=RULES_FACTOR, alerting=True)
        path = start_alert_path(cluster.control, drilldown_settings(cluster))
        wait_for_series(
            cluster, f'megatrace_tracer_rank_alive{{job="{job.name}"}} == 1', job.world, timeout=180
        )
        wait_for_series(
            cluster, f'megatrace_tracer_comm_ops_issued_total{{job="{job.name}"}} > 20', job.world
        )
        yield cluster, path


def test_the_culprits_node_is_lost(lost_cluster: tuple[Cluster, AlertPath]) -> None:
    cluster, _ = lost_cluster
    node = cluster.node(LOST)
    ranks = {(LOST - 1) * RANKS_PER_NODE + i for i in range(RANKS_PER_NODE)}
    with node_lost(cluster.network, cluster.nodes, node):
        lost_at = time.time()
        text, seconds = wait_for_card(
            cluster.control.feishu, "oc_p0", lambda t: f"on node **{node.name}**" in t, lost_at, timeout=180
        )
    named = re.findall(r"Culprit\*\*: rank \*\*(\d+)\*\* on node \*\*([^*]+)\*\*", text)
    assert named and all(int(rank) in ranks and where == node.name for rank, where in named), text
    culprits = sorted({int(rank) for rank, _ in named})
    print(f"figure: node lost: P0 names rank {culprits} on {node.name}, card {seconds:.1f}s after the loss")
