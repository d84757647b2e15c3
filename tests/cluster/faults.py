"""One helper per fault of the cluster in a box, each a context manager: the fault holds inside the
block and is repaired when it ends (what was killed is started again, what was cut is joined), so any
test can combine them. Kill means SIGKILL unless said otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tests.cluster.control import ControlPlane, Program
from tests.cluster.network import ClusterNetwork, Node, inside
from tests.cluster.nodes import Nodes


@contextlib.contextmanager
def agent_killed(nodes: Nodes, node: Node) -> Iterator[None]:
    """The node's agent is killed; its ranks keep running."""
    nodes.stop_agent(node)
    try:
        yield
    finally:
        nodes.start_agent(node)


@contextlib.contextmanager
def node_lost(network: ClusterNetwork, nodes: Nodes, node: Node) -> Iterator[None]:
    """The whole node is gone: its cable pulled, then every process on it (agent, ranks) killed.
    Afterwards the cable is back and its agent restarted (its ranks stay dead)."""
    network.set_link(node, up=False)
    nodes.kill_all(node)
    try:
        yield
    finally:
        network.set_link(node, up=True)
        nodes.start_agent(node)


@contextlib.contextmanager
def partitioned_from_control(network: ClusterNetwork, node: Node) -> Iterator[None]:
    """The node cannot answer the control plane (bot, Prometheus); the nodes still reach each other."""
    network.set_partitioned_from_control(node, True)
    try:
        yield
    finally:
        network.set_partitioned_from_control(node, False)


@contextlib.contextmanager
def program_killed(program: Program) -> Iterator[None]:
    """A control-plane program (Prometheus, an Alertmanager, a bot replica) is killed, then restarted."""
    program.kill()
    try:
        yield
    finally:
        program.start()


@contextlib.contextmanager
def postgres_down(control: ControlPlane) -> Iterator[None]:
    """PostgreSQL goes down (every connection dropped), then starts again on its data and port."""
    assert control.postgres is not None
    control.postgres.halt()
    try:
        yield
    finally:
        with inside(control.namespace):
            control.postgres.resume()
