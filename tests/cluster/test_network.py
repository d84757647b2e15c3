"""The cluster's network leaves nothing behind: what a run killed with SIGKILL left (namespaces and the
processes in them) is removed by the next run, and `close` removes a cluster's own namespaces."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.cluster.conftest import require_root
from tests.cluster.network import ClusterNetwork, inside, ip


def gone_pid() -> int:
    """A process id no process has now."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def test_a_killed_runs_namespaces_and_processes_are_removed() -> None:
    require_root()
    stale = f"mt{gone_pid():x}x1-ctl"
    ip("netns", "add", stale)
    with inside(stale):
        orphan = subprocess.Popen(["sleep", "300"], start_new_session=True)
    network = ClusterNetwork(1)
    names = [network.control, network.node(1).namespace]
    try:
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert not os.path.exists(f"/run/netns/{stale}")
        assert all(os.path.exists(f"/run/netns/{name}") for name in names)
    finally:
        network.close()
    assert not any(os.path.exists(f"/run/netns/{name}") for name in names)
