"""Fixtures of the cluster in a box. Each test module starts only what its faults need: `cluster` is
the nodes with their agents and an empty control plane, shared by the modules of xdist group
"hung-job"; `hung_job` adds a real job with a hung rank
and Prometheus scraping the agents as the chart says; `alert_path` adds PostgreSQL, two bot replicas
and the Alertmanager pair. Needs root (network namespaces), as the tests and CI run."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.control import ControlPlane, Program
from tests.cluster.network import ClusterNetwork, Node
from tests.cluster.nodes import Job, Nodes
from tests.support.helm_chart import render

NODES = 4
RANKS_PER_NODE = 2
HUNG_RANK = 5  # on node 3
GATHER_DEADLINE_S = 20  # the bot's drilldown.agents.deadline_s: the gathering's deadline
ANALYZER_TIMEOUT_S = 60  # drilldown.timeout_s: the analyzer's run after it
DRILLDOWN_DEADLINE_S = GATHER_DEADLINE_S + ANALYZER_TIMEOUT_S  # the longest a drill-down may take
# The chart as installed, scraping both endpoints every second so that the tests need not wait 15 s
# (or the tracer's 5 s) per sample.
CHART_VALUES = {
    "exporter": {
        "serviceMonitor": {
            "interval": "1s",
            "scrapeTimeout": "1s",
            "tracerInterval": "1s",
            "tracerScrapeTimeout": "1s",
        }
    }
}


@dataclasses.dataclass
class Cluster:
    network: ClusterNetwork
    nodes: Nodes
    control: ControlPlane
    objects: list[dict[str, Any]]

    def node(self, index: int) -> Node:
        return self.network.node(index)


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the cluster harness makes network namespaces: run the tests as root (CI does)")


@contextlib.contextmanager
def build_cluster(root: Path, values: dict[str, Any] | None = None) -> Iterator[Cluster]:
    """Nodes with their agents running, and the control plane (Feishu stand-in only, so far)."""
    require_root()
    objects = render(values or CHART_VALUES)
    network = ClusterNetwork(NODES)
    nodes = Nodes(network, objects, root)
    control: ControlPlane | None = None
    try:
        for node in network.nodes:
            nodes.start_agent(node)
        control = ControlPlane(network.control, objects, root)
        yield Cluster(network, nodes, control, objects)
    finally:
        if control is not None:
            control.close()
        nodes.close()
        network.close()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with build_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


def wait_for_series(cluster: Cluster, promql: str, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Wait until `promql` gives `count` series."""
    deadline = time.monotonic() + timeout
    while True:
        result = cluster.control.query(promql)
        if len(result) >= count:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{promql}: {len(result)} series, wanted {count}")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def hung_job(cluster: Cluster) -> Job:
    """A job of 8 ranks (2 per node) whose rank 5 (node 3) hangs at step 3; every rank has dumped its
    stall, and Prometheus (the chart's scrape job) has seen every rank."""
    job = cluster.nodes.start_job("llm-cluster", RANKS_PER_NODE, steps=1000, hang_rank=HUNG_RANK)
    cluster.nodes.wait_stalled(job)
    cluster.control.start_prometheus(cluster.nodes.pods())
    wait_for_series(cluster, f'megatrace_tracer_rank_info{{job="{job.name}"}}', job.world)
    return job


def drilldown_settings(cluster: Cluster, **agents: Any) -> dict[str, Any]:
    """The bot's drill-down as the chart configures it: from the agents, through Prometheus."""
    return {
        "source": "agents",
        "prometheus_url": cluster.control.url(9090),
        "verdict_wait_s": DRILLDOWN_DEADLINE_S + 10,
        "timeout_s": ANALYZER_TIMEOUT_S,
        "agents": {
            "port": cluster.nodes.trace_port,
            "token_file": str(cluster.nodes.token_file),
            "timeout_s": 3,
            "connect_timeout_s": 2,
            "deadline_s": GATHER_DEADLINE_S,
            "retries": 1,
            **agents,
        },
    }


def start_drilldown_bot(cluster: Cluster, name: str, **agents: Any) -> Program:
    """One bot replica (SQLite) that drills down into the cluster's job."""
    store = {"path": str(cluster.nodes.root / f"{name}.db")}
    config = cluster.control.bot_config(0, store, drilldown_settings(cluster, **agents))
    return cluster.control.bot_program(0, config)


@dataclasses.dataclass
class AlertPath:
    """The HA alert path: two Alertmanagers gossiping, two bot replicas on one PostgreSQL."""

    control: ControlPlane
    alertmanagers: list[Program]
    bots: list[Program]


def start_alert_path(control: ControlPlane, drilldown: dict[str, Any] | None = None) -> AlertPath:
    """PostgreSQL, then both bot replicas on it, then the Alertmanager pair routing to both."""
    database = control.start_postgres()
    bots = [
        control.bot_program(i, control.bot_config(i, {"url": database, "lease_s": 7}, drilldown))
        for i in range(2)
    ]
    alertmanagers = [control.alertmanager_program(i) for i in range(2)]
    return AlertPath(control, alertmanagers, bots)


@pytest.fixture(scope="module")
def alert_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertPath]:
    """The alert path alone, in a control namespace with no nodes (its faults need none)."""
    root = tmp_path_factory.mktemp("alert-path")
    require_root()
    network = ClusterNetwork(0)
    control: ControlPlane | None = None
    try:
        control = ControlPlane(network.control, render(CHART_VALUES), root)
        yield start_alert_path(control)
    finally:
        if control is not None:
            control.close()
        network.close()
