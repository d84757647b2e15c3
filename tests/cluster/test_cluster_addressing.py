"""The cluster in a box is a cluster: every rank and agent runs inside its node's network namespace,
node names resolve nowhere, Prometheus scrapes the agents with the chart's own relabelings, and the bot,
reaching agents by the address the chart's scrape labels give it, collects every rank of a hung job
and names the hung rank on its node."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import time

import pytest

from tests.alertbot.conftest import TOKEN, alert, webhook
from tests.cluster.cards import wait_for_card
from tests.cluster.conftest import HUNG_RANK, Cluster, start_drilldown_bot
from tests.cluster.control import BOT_PORTS
from tests.cluster.network import namespace_inode, netns_inode
from tests.cluster.nodes import STORE_PORT, Job

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hung-job")]


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return [int(p) for p in handle.read().split()]


def _address(text: str) -> tuple[str, int]:
    """An address of /proc/net/tcp or tcp6 (32-bit words in host order), IPv4-mapped ones as IPv4."""
    hexaddr, port = text.split(":")
    raw = b"".join(int(hexaddr[i : i + 8], 16).to_bytes(4, "little") for i in range(0, len(hexaddr), 8))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return str(address), int(port, 16)


def tcp_sockets(pid: int) -> set[tuple[str, int, str, int, str]]:
    """(local address, port, remote address, port, state) of the TCP sockets in `pid`'s namespace."""
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as handle:
            for line in handle.readlines()[1:]:
                local, remote, state = line.split()[1:4]
                named = {"0A": "LISTEN", "01": "ESTABLISHED"}.get(state, state)
                found.add((*_address(local), *_address(remote), named))
    return found


def test_ranks_rendezvous_through_the_store_on_node_1(cluster: Cluster, hung_job: Job) -> None:
    first = cluster.node(1)
    _, rank0 = hung_job.ranks[0]
    assert any(port == STORE_PORT and state == "LISTEN" for _, port, _, _, state in tcp_sockets(rank0.pid))
    for rank, (node, wrapper) in hung_job.ranks.items():
        if node is not first:
            to_store = {(r, p) for _, _, r, p, state in tcp_sockets(wrapper.pid) if state == "ESTABLISHED"}
            assert (first.address, STORE_PORT) in to_store, (rank, to_store)


def test_ranks_and_agents_run_in_their_nodes_namespaces(cluster: Cluster, hung_job: Job) -> None:
    mine = netns_inode(os.getpid())
    for rank, (node, wrapper) in hung_job.ranks.items():
        expected = namespace_inode(node.namespace)
        assert expected != mine
        ranks = children(wrapper.pid)  # `megatrace trace` and the rank it started
        assert ranks, f"rank {rank} has no process under megatrace trace"
        assert {netns_inode(pid) for pid in [wrapper.pid, *ranks]} == {expected}, rank
    for index, agent in cluster.nodes.agents.items():
        assert netns_inode(agent.pid) == namespace_inode(cluster.node(index).namespace)
    assert len({namespace_inode(n.namespace) for n in cluster.network.nodes}) == len(cluster.network.nodes)
    for node in cluster.network.nodes:
        with pytest.raises(socket.gaierror):
            socket.getaddrinfo(node.name, None)


def test_scrape_labels_name_the_node_and_carry_the_agents_address(cluster: Cluster, hung_job: Job) -> None:
    up = {s["metric"]["instance"]: s["metric"] for s in cluster.control.query('up{job="megatrace"} == 1')}
    assert set(up) == {n.name for n in cluster.network.nodes}  # `instance` stays the node name
    for node in cluster.network.nodes:
        assert up[node.name]["agent_address"] == f"{node.address}:{cluster.nodes.metrics_port}"
    ranks = cluster.control.query(f'megatrace_tracer_rank_info{{job="{hung_job.name}"}}')
    assert {s["metric"]["agent_address"] for s in ranks} == {
        f"{n.address}:{cluster.nodes.metrics_port}" for n in cluster.network.nodes
    }


def test_bot_collects_every_rank_through_the_charts_scrape_labels(cluster: Cluster, hung_job: Job) -> None:
    bot = start_drilldown_bot(cluster, "addressing")
    try:
        sent = time.time()
        body = webhook(alert("MegatraceJobHang", job=hung_job.name, culprit_seen="unknown"))
        cluster.control.post(
            f"http://127.0.0.1:{BOT_PORTS[0]}/alertmanager",
            json=body,
            headers={"Authorization": f"Bearer {TOKEN}"},
        ).raise_for_status()
        text, seconds = wait_for_card(cluster.control.feishu, "oc_p0", lambda t: "Culprit**: rank" in t, sent)
    finally:
        bot.kill()
    node = cluster.node(HUNG_RANK // 2 + 1)
    assert re.search(
        rf"Culprit\*\*: rank \*\*{HUNG_RANK}\*\* on node \*\*{re.escape(node.name)}\*\*", text
    ), text
    assert "No trace data" not in text, text
    print(f"figure: addressing: culprit rank {HUNG_RANK} on {node.name}, card after {seconds:.1f}s")
