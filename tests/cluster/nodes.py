"""The nodes of the cluster in a box: each node's agent (`megatrace exporter`, configured as the chart's
DaemonSet configures it) and the ranks of a real gloo training job under `megatrace trace`, all
started inside the node's network namespace; the ranks rendezvous through the c10d store rank 0
opens on node 1's address (``MASTER_ADDR``), as a multi-node job does."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from megatrace.tracer.dumpfile import read_dump
from tests.cluster.network import ClusterNetwork, Node, inside, processes_in
from tests.support.helm_chart import by_component
from tests.support.services import wait_http

AGENT_TOKEN = "cluster-agent-token-for-tests"
STORE_PORT = 29500


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return by_component(objects, "DaemonSet", "exporter")["spec"]["template"]["spec"]["containers"][0]


def container_port(objects: list[dict[str, Any]], name: str) -> int:
    """A named port of the chart's exporter container (metrics, traces)."""
    return next(p["containerPort"] for p in _container(objects)["ports"] if p["name"] == name)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclasses.dataclass
class Job:
    """A running job: its name, world size, and rank -> (node, the `megatrace trace` process)."""

    name: str
    world: int
    ranks: dict[int, tuple[Node, subprocess.Popen]]
    hang_rank: int | None


class Nodes:
    """Start and stop agents and job ranks on the cluster's nodes; `close()` stops what is left."""

    def __init__(self, network: ClusterNetwork, objects: list[dict[str, Any]], root: Path) -> None:
        self.network = network
        self.objects = objects
        self.root = root
        self.metrics_port = container_port(objects, "metrics")
        self.trace_port = container_port(objects, "traces")
        self.token_file = root / "agent-token"
        self.token_file.write_text(AGENT_TOKEN)
        self.agents: dict[int, subprocess.Popen] = {}
        self.jobs: list[Job] = []

    def trace_dir(self, node: Node) -> Path:
        """The node's host directory the ranks write to and its agent reads (the chart's traceDir)."""
        path = self.root / f"node-{node.index}" / "run-megatrace"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def pod_name(self, node: Node) -> str:
        """The agent pod's name, as the DaemonSet controller names it (base name and a suffix)."""
        base = by_component(self.objects, "DaemonSet", "exporter")["metadata"]["name"]
        return f"{base}-{hashlib.sha1(node.name.encode()).hexdigest()[:5]}"

    def pods(self) -> list[tuple[str, str, str]]:
        """(pod name, pod IP, node name) of every agent pod, running or not (discovery still lists it)."""
        return [(self.pod_name(n), n.address, n.name) for n in self.network.nodes]

    def start(self, node: Node, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start `argv` as a process of `node` (in its namespace, its own process group)."""
        with inside(node.namespace), open(log, "ab") as out:
            return subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    # -- agents --------------------------------------------------------------------------------------

    def start_agent(self, node: Node) -> subprocess.Popen:
        """The node's agent as the chart runs it: /metrics and the trace endpoint on all addresses of
        the pod, its node name from the downward API, no kubelet socket."""
        args = {arg.split("=", 1)[0]: arg.split("=", 1)[1] for arg in _container(self.objects)["args"][1:]}
        settings = {
            "listen": args["--listen"],
            "collectors": args["--collectors"].split(","),
            "trace_dir": str(self.trace_dir(node)),
            "sysfs_root": "/sys",
            "tracer_grace_seconds": float(args["--tracer-grace"]),
            "trace_listen": f"0.0.0.0:{self.trace_port}",
            "trace_token_file": str(self.token_file),
            "node_name": node.name,
            "podresources_socket": "",
        }
        config = self.root / f"agent-{node.index}.yml"
        config.write_text(yaml.safe_dump(settings))
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRACE_")}
        argv = [sys.executable, "-m", "megatrace.cli", "exporter", "--config", str(config)]
        proc = self.start(node, argv, env, self.root / f"agent-{node.index}.log")
        self.agents[node.index] = proc
        with inside(node.namespace):
            wait_http(f"http://{node.address}:{self.metrics_port}/healthz", timeout=60, proc=proc)
        return proc

    def stop_agent(self, node: Node, sig: int = signal.SIGKILL) -> None:
        proc = self.agents.pop(node.index, None)
        if proc is not None:
            _stop(proc, sig)

    # -- the training job ----------------------------------------------------------------------------

    def start_job(
        self, name: str, ranks_per_node: int, steps: int, hang_rank: int | None = None, tp: int = 2
    ) -> Job:
        """A gloo job of `ranks_per_node` ranks on every node (rank 0 on node 1, which holds the store)."""
        nodes = self.network.nodes
        world = ranks_per_node * len(nodes)
        master = nodes[0].address
        base = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE_", "NCCL_MEGATRACE_"))}
        base.update(
            OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0", MASTER_ADDR=master, MASTER_PORT=str(STORE_PORT)
        )
        if hang_rank is not None:
            base.update(MEGATRACE_FAULT_HANG_RANK=str(hang_rank), MEGATRACE_FAULT_HANG_AT_STEP="3")
        ranks: dict[int, tuple[Node, subprocess.Popen]] = {}
        for rank in range(world):
            node = nodes[rank // ranks_per_node]
            env = dict(
                base,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank % ranks_per_node),
                LOCAL_WORLD_SIZE=str(ranks_per_node),
            )
            argv = [
                sys.executable, "-m", "megatrace.cli", "trace", "--trace-dir", str(self.trace_dir(node)),
                "--job", name, "--stall-ms", "1500", "--capacity", "4096", "--",
                sys.executable, "-m", "megatrace.tracer.example_train", "--worker", f"--nprocs={world}",
                f"--steps={steps}", f"--tp={tp}", "--timeout=900",
            ]  # fmt: skip
            ranks[rank] = (node, self.start(node, argv, env, self.root / f"{name}-rank-{rank}.log"))
        job = Job(name, world, ranks, hang_rank)
        self.jobs.append(job)
        return job

    def stalled_ranks(self, job: Job) -> set[int]:
        """Ranks of `job` that wrote a stall dump on their node."""
        found = set()
        for node in self.network.nodes:
            for path in (self.trace_dir(node) / job.name).glob("rank-*.dump"):
                with contextlib.suppress(OSError, ValueError):
                    snapshot = read_dump(path)
                    if snapshot.reason == "stall":
                        found.add(snapshot.header.rank)
        return found

    def wait_stalled(self, job: Job, timeout: float = 240.0) -> None:
        """Wait until every rank of the hung `job` has dumped its stall."""
        deadline = time.monotonic() + timeout
        while len(self.stalled_ranks(job)) < job.world:
            failed = {r: p.returncode for r, (_, p) in job.ranks.items() if p.poll() is not None}
            if failed or time.monotonic() > deadline:
                tail = (self.root / f"{job.name}-rank-0.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"job {job.name}: stalled {sorted(self.stalled_ranks(job))}, exited {failed}:\n{tail}"
                )
            time.sleep(0.5)

    # -- a node as a whole ---------------------------------------------------------------------------

    def processes(self, node: Node) -> list[int]:
        """Every process of the node (in its network namespace)."""
        return processes_in(node.namespace)

    def kill_all(self, node: Node) -> None:
        """SIGKILL every process of the node (its agent and its ranks), and reap the ones we started."""
        for pid in self.processes(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent = self.agents.pop(node.index, None)
        if agent is not None:
            agent.wait(timeout=30)
        for job in self.jobs:
            for owner, proc in job.ranks.values():
                if owner is node:
                    proc.wait(timeout=30)

    def close(self) -> None:
        for index in list(self.agents):
            self.stop_agent(self.network.node(index), signal.SIGTERM)
        for job in self.jobs:
            for _, proc in job.ranks.values():
                _stop(proc, signal.SIGKILL)
        for node in self.network.nodes:
            for pid in self.processes(node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
