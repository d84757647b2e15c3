"""Drill-down into a hung 8-rank job (rank 5, on node 3, hangs) while part of the cluster fails: an
agent of ranks not at fault killed, Prometheus down, the bot cut off from a node. Each time the card
still names the hung rank on its node, and says which agents it could not reach."""

from __future__ import annotations

import re
import time

import pytest

from tests.alertbot.conftest import TOKEN, alert, webhook
from tests.cluster.cards import wait_for_card
from tests.cluster.conftest import (
    DRILLDOWN_DEADLINE_S,
    HUNG_RANK,
    RANKS_PER_NODE,
    Cluster,
    start_drilldown_bot,
)
from tests.cluster.control import BOT_PORTS
from tests.cluster.faults import agent_killed, partitioned_from_control, program_killed
from tests.cluster.network import Node
from tests.cluster.nodes import Job

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hung-job")]


def culprit_card(cluster: Cluster, job: Job) -> tuple[str, float]:
    """Send the job's hang page to the bot as Alertmanager would; the card with a culprit, and the
    seconds from the page to that card."""
    sent = time.time()
    body = webhook(alert("MegatraceJobHang", job=job.name, culprit_seen="unknown", starts_at=sent))
    cluster.control.post(
        f"http://127.0.0.1:{BOT_PORTS[0]}/alertmanager",
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).raise_for_status()
    return wait_for_card(
        cluster.control.feishu, "oc_p0", lambda t: "Culprit**: rank" in t, sent, DRILLDOWN_DEADLINE_S + 30
    )


def hung_node(cluster: Cluster) -> Node:
    return cluster.node(HUNG_RANK // RANKS_PER_NODE + 1)


def assert_culprit(text: str, node: Node) -> None:
    assert re.search(
        rf"Culprit\*\*: rank \*\*{HUNG_RANK}\*\* on node \*\*{re.escape(node.name)}\*\*", text
    ), text


def no_data_lines(text: str) -> list[str]:
    """The card's "No trace data from" list."""
    marker = "**No trace data** from:"
    lines: list[str] = []
    for line in text.split(marker, 1)[1].splitlines() if marker in text else []:
        if line.startswith("- "):
            lines.append(line[2:])
        elif lines:
            break
    return lines


def names_only(lines: list[str], node: Node, cluster: Cluster) -> None:
    """The card lists `node`'s agent (by node name or address), and no other node's, as unreachable."""
    assert any(node.name in line or node.address in line for line in lines), lines
    others = [n for n in cluster.network.nodes if n is not node]
    assert not any(n.name in line or n.address in line for line in lines for n in others), lines


def test_agent_killed_its_ranks_not_at_fault(cluster: Cluster, hung_job: Job) -> None:
    bot = start_drilldown_bot(cluster, "agent-killed")
    victim = cluster.node(1)  # ranks 0 and 1
    try:
        with agent_killed(cluster.nodes, victim):
            text, seconds = culprit_card(cluster, hung_job)
    finally:
        bot.kill()
    assert_culprit(text, hung_node(cluster))
    names_only(no_data_lines(text), victim, cluster)
    print(f"figure: agent killed: culprit rank {HUNG_RANK} right, card after {seconds:.1f}s")


def test_prometheus_down_during_the_drilldown(cluster: Cluster, hung_job: Job) -> None:
    static = [f"{n.address}:{cluster.nodes.trace_port}" for n in cluster.network.nodes]
    bot = start_drilldown_bot(cluster, "prometheus-down", fallback={"static": static})
    prometheus = next(p for p in cluster.control.programs if p.name == "prometheus")
    try:
        with program_killed(prometheus):
            text, seconds = culprit_card(cluster, hung_job)
    finally:
        bot.kill()
    assert_culprit(text, hung_node(cluster))
    assert no_data_lines(text) == [], text
    print(f"figure: prometheus down: rank {HUNG_RANK} named (static agent list), card after {seconds:.1f}s")


def test_bot_partitioned_from_one_node(cluster: Cluster, hung_job: Job) -> None:
    bot = start_drilldown_bot(cluster, "partition")
    victim = cluster.node(2)  # ranks 2 and 3
    try:
        with partitioned_from_control(cluster.network, victim):
            text, seconds = culprit_card(cluster, hung_job)
    finally:
        bot.kill()
    assert_culprit(text, hung_node(cluster))
    names_only(no_data_lines(text), victim, cluster)
    assert seconds <= DRILLDOWN_DEADLINE_S, (
        f"the drill-down took {seconds:.1f}s, past its {DRILLDOWN_DEADLINE_S}s deadline"
    )
    print(f"figure: partitioned from node 2: culprit rank {HUNG_RANK} right, card after {seconds:.1f}s")
