"""The cluster's network, built from Linux network namespaces: one control-plane namespace holding a
bridge (Prometheus, Alertmanager, the bots, PostgreSQL and the Feishu stand-in live there) and one
namespace per node, joined to the bridge by a veth pair. Every address is in 198.18.0.0/24 (the
benchmarking range, RFC 2544) and exists only inside these namespaces; names carry the test process's
id so parallel workers never collide, and `ClusterNetwork.close` removes all of it.

`inside(namespace)` moves the calling thread into a namespace for the duration of a block: sockets
made and processes started there belong to it (a child inherits the namespace of the thread that
forked it), which is how the tests start programs on a node and talk to the control plane.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import os
import re
import signal
import subprocess
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
SUBNET = "198.18.0"
CONTROL_ADDRESS = f"{SUBNET}.254"
_libc = ctypes.CDLL(None, use_errno=True)
_counter = itertools.count(1)
_OURS = re.compile(r"mt([0-9a-f]+)x\d+-(ctl|n\d+)")


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def inside(namespace: str) -> Iterator[None]:
    """Run the block's sockets and child processes in network namespace `namespace` (this thread only)."""
    with open(f"/run/netns/{namespace}") as target, open("/proc/thread-self/ns/net") as home:
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())


def ip(*args: str) -> None:
    """Run `ip ARGS…`; CalledProcessError with its message when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["ip", *args], done.stdout, done.stderr)


def netns_inode(pid: int) -> int:
    """The network namespace a process is in (the inode of /proc/<pid>/ns/net)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def namespace_inode(namespace: str) -> int:
    return os.stat(f"/run/netns/{namespace}").st_ino


@dataclasses.dataclass
class Node:
    """One node: its namespace, its address on the bridge, and a node name that resolves nowhere."""

    index: int
    namespace: str
    address: str
    name: str
    port: str  # the bridge port (veth end) in the control namespace


def processes_in(namespace: str) -> list[int]:
    """Every process whose network namespace is `namespace`."""
    inode = namespace_inode(namespace)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if netns_inode(int(entry)) == inode:
                    found.append(int(entry))
    return found


def remove_stale() -> None:
    """Delete the namespaces (and kill the processes in them) of test runs whose process is gone, as
    a run killed with SIGKILL leaves them."""
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    for name in names:
        match = _OURS.fullmatch(name)
        if match is None or os.path.exists(f"/proc/{int(match.group(1), 16)}"):
            continue
        with contextlib.suppress(OSError):
            for pid in processes_in(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("netns", "del", name)


class ClusterNetwork:
    """The namespaces, bridge and veth pairs of one cluster; `close()` deletes them."""

    def __init__(self, nodes: int) -> None:
        remove_stale()
        tag = f"mt{os.getpid():x}x{next(_counter)}"
        self.tag = tag
        self.control = f"{tag}-ctl"
        self.nodes: list[Node] = []
        self._made: list[str] = []
        try:
            self._add_namespace(self.control)
            ip("-n", self.control, "link", "add", "br0", "type", "bridge")
            ip("-n", self.control, "addr", "add", f"{CONTROL_ADDRESS}/24", "dev", "br0")
            ip("-n", self.control, "link", "set", "br0", "up")
            for index in range(1, nodes + 1):
                self.nodes.append(self._add_node(index))
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _add_node(self, index: int) -> Node:
        namespace = f"{self.tag}-n{index}"
        self._add_namespace(namespace)
        port = f"n{index}"
        ip(
            "-n",
            self.control,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            namespace,
        )
        ip("-n", self.control, "link", "set", port, "master", "br0")
        ip("-n", self.control, "link", "set", port, "up")
        address = f"{SUBNET}.{index}"
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        # a node name as Kubernetes gives it, under a top-level domain that never resolves (RFC 2606)
        return Node(index, namespace, address, f"gpu-node-{index}.{self.tag}.invalid", port)

    def node(self, index: int) -> Node:
        return self.nodes[index - 1]

    # -- network faults ---------------------------------------------------------------------------

    def set_link(self, node: Node, up: bool) -> None:
        """Unplug (or plug back) the node's cable: its bridge port down cuts it off from everyone."""
        ip("-n", self.control, "link", "set", node.port, "up" if up else "down")

    def set_partitioned_from_control(self, node: Node, partitioned: bool) -> None:
        """The node can no longer answer the control plane (a blackhole route to its address): the
        bot's and Prometheus's connections to it time out, while the nodes still reach each other."""
        action = "add" if partitioned else "del"
        ip("-n", node.namespace, "route", action, "blackhole", f"{CONTROL_ADDRESS}/32")

    def close(self) -> None:
        for name in reversed(self._made):
            with contextlib.suppress(subprocess.CalledProcessError):
                ip("netns", "del", name)
        self._made.clear()
