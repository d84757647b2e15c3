"""Drill-down in a cluster's shape: two node agents on loopback addresses, each serving half the ranks
of a real traced job with a hang from its own trace root, Prometheus scraping them, and a bot that
reads neither root: it finds the agents through Prometheus, gathers the windows and names the hung
rank with its node, pod, container and GPU; with one agent down it says which ranks gave no data."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from megatrace.alertbot.drilldown import DrilldownRunner
from megatrace.tracer.ringfile import DEVICE_UUID_BYTES, DEVICE_UUID_OFFSET, W_CUDA_DEVICE
from tests.alertbot.conftest import Bot, alert, config, webhook
from tests.support.gloo_job import run_traced_job
from tests.support.kubelet import kubelet, list_response, pod
from tests.support.services import free_port, prometheus_argv, running

TOKEN = "agent-token-for-tests"
HUNG_RANK = 2


def card_text(bot: Bot, report: dict) -> str:
    """The text of the job's incident card once `report` is its verdict."""
    bot.store.incidents.update(1, verdict=json.dumps(report))
    row = bot.store.outbox.find(kind="firing")[0]
    return bot.delivery.render(row, time.time())["card"]["elements"][0]["text"]["content"]


NODES = {"node-a": ("127.0.0.2", [0, 1]), "node-b": ("127.0.0.3", [2, 3])}


def gpu_uuid(rank: int) -> str:
    return f"GPU-{rank:08x}-7e57-4c3a-9d1b-00000000000{rank}"


def give_gpu(ring: Path, index: int, uuid: str) -> None:
    """Record a GPU in a ring header as a rank on a GPU node does (this CPU-only gloo job has none)."""
    with open(ring, "r+b") as handle:
        handle.seek(W_CUDA_DEVICE * 8)
        handle.write(index.to_bytes(8, "little", signed=True))
        handle.seek(DEVICE_UUID_OFFSET)
        handle.write(uuid.encode().ljust(DEVICE_UUID_BYTES, b"\0"))


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    traces = tmp_path_factory.mktemp("job") / "traces"
    env = {"MEGATRACE_FAULT_HANG_RANK": str(HUNG_RANK), "MEGATRACE_FAULT_HANG_AT_STEP": "3"}
    return run_traced_job(traces, nprocs=4, steps=6, env={**env, "MEGATRACE_TRACE_JOB": "llm-7"})


@contextlib.contextmanager
def agent(
    tmp_path: Path,
    node: str,
    address: str,
    root: Path,
    ports: tuple[int, int],
    ranks: list[int] | None = None,
) -> Iterator[object]:
    """`megatrace exporter` serving `root` on `address`, its kubelet stand-in naming the node's pod."""
    ranks = NODES[node][1] if ranks is None else ranks
    socket = tmp_path / f"{node}.sock"
    pods = list_response(pod("ml-train", f"llm-7-worker-{node[-1]}", "trainer", [gpu_uuid(r) for r in ranks]))
    settings = {
        "listen": f"{address}:{ports[0]}",
        "collectors": ["tracer", "traces"],
        "trace_dir": str(root),
        "trace_listen": f"{address}:{ports[1]}",
        "trace_token_file": str(tmp_path / "token"),
        "node_name": node,
        "podresources_socket": str(socket),
    }
    (tmp_path / f"{node}.yml").write_text(yaml.safe_dump(settings))
    argv = [sys.executable, "-m", "megatrace.cli", "exporter", "--config", str(tmp_path / f"{node}.yml")]
    with (
        kubelet(socket, pods),
        running(argv, f"http://{address}:{ports[0]}/healthz", tmp_path / f"{node}.log") as proc,
    ):
        yield proc


def wait_for_ranks(prometheus: str, count: int, job: str = "llm-7") -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = requests.get(
            f"{prometheus}/api/v1/query",
            params={"query": f'megatrace_tracer_rank_info{{job="{job}"}}'},
            timeout=10,
        ).json()
        if len(answer["data"]["result"]) == count:
            return
        time.sleep(0.5)
    raise TimeoutError("Prometheus never saw every rank of the job")


@pytest.mark.slow
def test_two_agents_serve_the_job_and_the_bot_names_rank_node_pod_and_gpu(
    hung_job: Path, tmp_path: Path
) -> None:
    (tmp_path / "token").write_text(TOKEN)
    roots = {}
    for node, (_, ranks) in NODES.items():
        root = tmp_path / f"root-{node}" / "llm-7"
        root.mkdir(parents=True)
        for rank in ranks:
            for path in hung_job.glob(f"rank-{rank}.*"):
                shutil.copy2(path, root / path.name)
            give_gpu(root / f"rank-{rank}.trace", rank % 2, gpu_uuid(rank))
        roots[node] = root.parent
    metrics_ports = {node: free_port() for node in NODES}
    trace_port = free_port()
    prometheus_port = free_port()
    targets = [f"{address}:{metrics_ports[node]}" for node, (address, _) in NODES.items()]
    scrape = {"job_name": "megatrace-agents", "honor_labels": True, "static_configs": [{"targets": targets}]}
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [scrape]})
    )
    prometheus = f"http://127.0.0.1:{prometheus_port}"
    cfg = config(
        tmp_path,
        drilldown={
            "source": "agents",
            "prometheus_url": prometheus,
            "timeout_s": 120,
            "agents": {
                "port": trace_port,
                "token_file": str(tmp_path / "token"),
                "timeout_s": 5,
                "retries": 1,
            },
        },
    )
    bot = Bot(cfg)
    bot.receive(webhook(alert(job="llm-7")))
    runner = DrilldownRunner(bot.pipeline, cfg.drilldown, bot.metrics)
    prom_argv = prometheus_argv(tmp_path / "prometheus.yml", tmp_path / "prom-data", prometheus_port)
    with (
        running(prom_argv, f"{prometheus}/-/ready", tmp_path / "prometheus.log"),
        agent(tmp_path, "node-a", "127.0.0.2", roots["node-a"], (metrics_ports["node-a"], trace_port)),
        agent(tmp_path, "node-b", "127.0.0.3", roots["node-b"], (metrics_ports["node-b"], trace_port)) as b,
    ):
        wait_for_ranks(prometheus, 4)
        both = runner.investigate("llm-7")
        b.terminate()
        b.wait(timeout=10)
        one_down = runner.investigate("llm-7")
    runner.shutdown()

    assert both["verdict"] == "hang", json.dumps(both)[:3000]
    culprit = both["suspects"][0]
    assert culprit["rank"] == HUNG_RANK
    assert (culprit["node"], culprit["namespace"], culprit["pod"], culprit["container"]) == (
        "node-b",
        "ml-train",
        "llm-7-worker-b",
        "trainer",
    )
    assert (culprit["gpu"], culprit["gpu_uuid"], culprit["local_rank"]) == (0, gpu_uuid(HUNG_RANK), 2)
    assert "no_data" not in both
    assert str(tmp_path / "root-") not in json.dumps(both)  # the analyzer read the bot's copies only
    text = card_text(bot, both)
    assert "**Culprit**: rank **2** on node **node-b**" in text
    assert (
        "**Placement**: node node-b, pod ml-train/llm-7-worker-b container trainer, "
        f"GPU 0 ({gpu_uuid(HUNG_RANK)}), local rank 2" in text
    )

    assert one_down["no_data"] == [
        {"reason": f"agent 127.0.0.3:{trace_port}: connection refused or lost after 2 tries", "ranks": [2, 3]}
    ]
    text = card_text(bot, one_down)
    assert f"- ranks 2-3: agent 127.0.0.3:{trace_port}: connection refused or lost after 2 tries" in text
    # the reachable agent's ranks waited on ranks 2 and 3, whose data could not be collected: that is no
    # evidence against them, so nobody is named (the rules' culprit, if any, keeps the card)
    assert one_down["uncollected_ranks"] == [2, 3]
    assert one_down["verdict"] == "inconclusive" and one_down["suspects"] == []
    assert "**Culprit**: not named: the trace data the drill-down could collect allows no safe call" in text


EIGHT = {"node-a": ("127.0.0.2", [0, 1, 2, 3]), "node-b": ("127.0.0.3", [4, 5, 6, 7])}
HUNG_OF_EIGHT = 5


@pytest.fixture(scope="module")
def eight_rank_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    traces = tmp_path_factory.mktemp("job8") / "traces"
    env = {"MEGATRACE_FAULT_HANG_RANK": str(HUNG_OF_EIGHT), "MEGATRACE_FAULT_HANG_AT_STEP": "3"}
    return run_traced_job(traces, nprocs=8, steps=6, env={**env, "MEGATRACE_TRACE_JOB": "llm-8"})


@pytest.mark.slow
def test_an_unreachable_agents_ranks_are_not_blamed_and_the_hung_rank_comes_first(
    eight_rank_job: Path, tmp_path: Path
) -> None:
    """The issue's case: 8 ranks on two agents, rank 5 on node B hung, node A's agent stopped. Before,
    ranks 0-3 led the verdict as `no_log` (0.7) and the hung rank came fifth."""
    (tmp_path / "token").write_text(TOKEN)
    roots = {}
    for node, (_, ranks) in EIGHT.items():
        root = tmp_path / f"root-{node}" / "llm-8"
        root.mkdir(parents=True)
        for rank in ranks:
            for path in eight_rank_job.glob(f"rank-{rank}.*"):
                shutil.copy2(path, root / path.name)
        roots[node] = root.parent
    metrics_ports = {node: free_port() for node in EIGHT}
    trace_port, prometheus_port = free_port(), free_port()
    targets = [f"{address}:{metrics_ports[node]}" for node, (address, _) in EIGHT.items()]
    scrape = {"job_name": "megatrace", "honor_labels": True, "static_configs": [{"targets": targets}]}
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [scrape]})
    )
    prometheus = f"http://127.0.0.1:{prometheus_port}"
    agents = {"port": trace_port, "token_file": str(tmp_path / "token"), "timeout_s": 5, "retries": 1}
    cfg = config(tmp_path, drilldown={"source": "agents", "prometheus_url": prometheus, "agents": agents})
    bot = Bot(cfg)
    bot.receive(webhook(alert(job="llm-8")))
    runner = DrilldownRunner(bot.pipeline, cfg.drilldown, bot.metrics)
    prom_argv = prometheus_argv(tmp_path / "prometheus.yml", tmp_path / "prom-data", prometheus_port)
    ports = {node: (metrics_ports[node], trace_port) for node in EIGHT}
    with (
        running(prom_argv, f"{prometheus}/-/ready", tmp_path / "prometheus.log"),
        agent(tmp_path, "node-a", "127.0.0.2", roots["node-a"], ports["node-a"], EIGHT["node-a"][1]) as a,
        agent(tmp_path, "node-b", "127.0.0.3", roots["node-b"], ports["node-b"], EIGHT["node-b"][1]),
    ):
        wait_for_ranks(prometheus, 8, "llm-8")
        a.terminate()
        a.wait(timeout=10)
        report = runner.investigate("llm-8")
    runner.shutdown()

    assert report["verdict"] == "hang", json.dumps(report)[:3000]
    first = report["suspects"][0]
    assert (first["rank"], first["cause"], first["node"]) == (HUNG_OF_EIGHT, "rank_missing", "node-b")
    assert not [s for s in report["suspects"] if s["rank"] in EIGHT["node-a"][1]]
    assert report["uncollected_ranks"] == [0, 1, 2, 3]
    reason = f"agent 127.0.0.2:{trace_port}: connection refused or lost after 2 tries"
    assert report["no_data"] == [{"reason": reason, "ranks": [0, 1, 2, 3]}]
    text = card_text(bot, report)
    assert "**Culprit**: rank **5** on node **node-b**" in text
    assert f"- ranks 0-3: {reason}" in text
