"""Grafana dashboards in `grafana/`, checked statically and against a real Prometheus.

The live part runs the real node agent (its collectors and HTTP server) on two simulated nodes: one with
the InfiniBand sysfs fixture, two GPUs behind the pynvml test double and four live ranks writing real
tracer ring files; one with the RoCE fixture. A real node_exporter reports the host. A real Prometheus
scrapes them with the rules of `rules/` loaded; every panel query must be valid PromQL returning data,
and every metric the rules use must exist.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
import requests
import yaml
from prometheus_client.metrics import MetricWrapperBase

from megatrace.alertbot.metrics import BotMetrics
from megatrace.exporters.cli import build_collectors, build_registry
from megatrace.exporters.server import MetricsServer
from megatrace.exporters.settings import ExporterConfig
from megatrace.exporters.settings import load as load_agent_config
from megatrace.tracer.host_signals import HostSampler
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import OP_CODES, RankIdentity, RingWriter, comm_id, ring_path
from tests.support.fake_pynvml import FakeGpu, FakeNvml
from tests.support.services import free_port, prometheus_argv, require_binary, running, serving

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
PROVISIONING = ROOT / "grafana" / "provisioning"
RULE_FILES = sorted((ROOT / "rules").glob("*.yml"))
FIXTURES = ROOT / "tests" / "fixtures" / "sysfs"
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
# The alert bot's panels are checked against the metrics the bot registers (it is not scraped here).
BOT_DASHBOARD = "alertbot-health.json"
# kube-state-metrics cannot run without a Kubernetes API server: its one series is left out of the
# existence check.
NOT_SCRAPED_HERE = {"kube_node_status_condition"}
# Grafana's built-in variables and the values used for them in queries (scrapes are 1 s apart).
GRAFANA_BUILTINS = {"$__rate_interval": "15s", "$__interval": "5s", "$__range": "5m"}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target."""
    return [
        (panel["title"], target["expr"]) for panel in panels(dashboard) for target in panel.get("targets", [])
    ]


def expand(expr: str) -> str:
    """A panel query as Grafana sends it with every template variable set to All (`.*`)."""
    for name, value in GRAFANA_BUILTINS.items():
        expr = expr.replace(name, value)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """Names of the series a PromQL expression selects (not functions, keywords or label names)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("(") or match.group(0) in PROMQL_WORDS:
            continue
        names.add(match.group(0))
    return names


def rules() -> list[dict[str, Any]]:
    return [
        rule
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]


def bot_metric_names() -> set[str]:
    """Series names the alert bot exposes (counters with `_total`, histograms with `_bucket` ...)."""
    families = [
        family
        for metric in vars(BotMetrics()).values()
        if isinstance(metric, MetricWrapperBase)
        for family in metric.describe()
    ]
    names = set()
    for family in families:
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count"))
        else:
            names.add(family.name)
    return names


def test_metric_name_extraction() -> None:
    expr = (
        'sum by (job) (rate(a_total{x="y(z)"}[5m])) / on (job) group_left () b:c:d > 1e3 '
        'and vector(0) or label_replace(up, "a", "b", "", "")'
    )
    assert metric_names(expr) == {"a_total", "b:c:d", "up"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda path: path.name)
def test_dashboard_is_valid_json_with_a_datasource_variable(path: Path) -> None:
    dashboard = load(path)
    assert dashboard["title"].startswith("Megatrace / ")
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE_REF
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE_REF, panel["title"]
        assert panel["targets"], panel["title"]
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE_REF, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_dashboard_uids_are_unique_and_the_five_views_exist() -> None:
    uids = [load(path)["uid"] for path in DASHBOARDS]
    assert len(uids) == len(set(uids))
    assert set(uids) == {
        "megatrace-cluster",
        "megatrace-gpu-node",
        "megatrace-fabric",
        "megatrace-training",
        "megatrace-alertbot",
    }


def test_provisioning_declares_prometheus_and_the_dashboard_folder() -> None:
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "megatrace.yml").read_text())
    assert [source["type"] for source in datasources["datasources"]] == ["prometheus"]
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "megatrace.yml").read_text())
    assert providers["providers"][0]["type"] == "file"
    assert providers["providers"][0]["options"]["path"]


def test_bot_dashboard_uses_only_metrics_the_bot_exposes() -> None:
    exposed = bot_metric_names() | {"up"}
    for title, expr in queries(load(ROOT / "grafana" / "dashboards" / BOT_DASHBOARD)):
        assert metric_names(expr) <= exposed, f"{title}: {metric_names(expr) - exposed}"


@dataclass
class LiveStack:
    prometheus: str

    def query(self, expr: str) -> dict[str, Any]:
        answer = requests.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        return answer["data"]

    def names(self) -> set[str]:
        answer = requests.get(f"{self.prometheus}/api/v1/label/__name__/values", timeout=10).json()
        return set(answer["data"])


def gpus() -> FakeNvml:
    hot = FakeGpu(
        uuid="GPU-7a9d33b0-2c51-4f0e-8e6d-1b2a3c4d5e6f",
        bus_id="00000000:2A:00.0",
        temperature=88,
        clock_event_reasons=0x40,
        nvlinks=[1, 1],
        pcie_replays=3,
        retired_pages_pending=pynvml.NVML_FEATURE_ENABLED,
    )
    return FakeNvml([FakeGpu(uuid="GPU-5d2c7e5a-1f0b-4c3e-9a53-0d1f2e3c4b5a", nvlinks=[1, 1]), hot])


def write_ranks(trace_dir: Path, job: str, world_size: int) -> list[RingWriter]:
    """Ring files of `world_size` live ranks (this process) that completed collectives and steps."""
    writers = []
    group = comm_id(tuple(range(world_size)))
    for rank in range(world_size):
        identity = RankIdentity(job, rank, rank, world_size, "node-a", os.getpid(), time.time_ns())
        ring = ring_path(trace_dir / job, rank)
        writer = RingWriter(ring, identity, capacity=64, comm_table_bytes=4096, stall_threshold_ns=3 * 10**9)
        writer.add_communicator(group, tuple(range(world_size)))
        recorder = Recorder(writer, rank)
        for _ in range(3):
            recorder.end(recorder.begin(group, OP_CODES["all_reduce"], 1 << 20, 1, -1, 0))
            recorder.mark_step()
        recorder.publish()  # the watchdog's tick
        HostSampler(writer, 10**9).sample()  # and its host sample
        writers.append(writer)
    return writers


@contextlib.contextmanager
def node_agent(config: ExporterConfig, nvml: FakeNvml | None = None) -> Iterator[str]:
    """The real node agent (collectors, guard, HTTP server) serving on a free port in this process."""
    guarded = build_collectors(config, nvml=nvml)
    try:
        with serving(MetricsServer(("127.0.0.1", 0), build_registry(guarded))) as address:
            yield address
    finally:
        guarded.close()


def prometheus_config(agents: list[str], node_exporter: str) -> str:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(path) for path in RULE_FILES],
        "scrape_configs": [
            {"job_name": "megatrace", "honor_labels": True, "static_configs": [{"targets": agents}]},
            {"job_name": "node", "static_configs": [{"targets": [node_exporter]}]},
        ],
    }
    return yaml.safe_dump(config)


def wait_for(stack: LiveStack, expr: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not stack.query(expr)["result"]:
        assert time.monotonic() < deadline, f"no data for {expr} after {timeout}s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tmp = tmp_path_factory.mktemp("live")
    writers = write_ranks(tmp / "trace", "pretrain-7", 4)
    gpu_node = load_agent_config(
        None,
        {
            "collectors": ["gpu", "infiniband", "tracer"],
            "sysfs_root": str(FIXTURES / "infiniband"),
            "trace_dir": str(tmp / "trace"),
            "podresources_socket": "",
        },
        environ={},
    )
    roce_node = load_agent_config(
        None,
        {"collectors": ["infiniband"], "sysfs_root": str(FIXTURES / "roce"), "podresources_socket": ""},
        environ={},
    )
    node_port, prom_port = free_port(), free_port()
    node_exporter = [
        require_binary("prometheus-node-exporter"),
        f"--web.listen-address=127.0.0.1:{node_port}",
        "--collector.disable-defaults",
        "--collector.filesystem",
        "--collector.meminfo",
        "--collector.vmstat",
    ]
    with contextlib.ExitStack() as stack:
        agents = [
            stack.enter_context(node_agent(gpu_node, gpus())),
            stack.enter_context(node_agent(roce_node)),
        ]
        stack.enter_context(
            running(node_exporter, f"http://127.0.0.1:{node_port}/metrics", tmp / "node_exporter.log")
        )
        config = tmp / "prometheus.yml"
        config.write_text(prometheus_config(agents, f"127.0.0.1:{node_port}"))
        stack.enter_context(
            running(
                prometheus_argv(config, tmp / "data", prom_port),
                f"http://127.0.0.1:{prom_port}/-/ready",
                tmp / "prometheus.log",
            )
        )
        live_stack = LiveStack(f"http://127.0.0.1:{prom_port}")
        # Rates need two scrapes, and the recording rules one evaluation after that.
        wait_for(live_stack, "megatrace:rank_wait_share:ratio_to_job_median")
        wait_for(live_stack, "megatrace:infiniband_port_transmit_wait_ratio:rate5m")
        wait_for(live_stack, "count(up == 1) == 3")
        # and the RoCE node's own counters two scrapes in (a loaded machine may be a scrape behind)
        wait_for(live_stack, expand("rate(megatrace_infiniband_np_cnp_packets_sent_total[$__rate_interval])"))
        yield live_stack
    for writer in writers:
        writer.close()


@pytest.mark.slow
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda path: path.name)
def test_every_panel_query_returns_data_from_prometheus(live: LiveStack, path: Path) -> None:
    dashboard = load(path)
    empty = []
    for title, expr in queries(dashboard):
        data = live.query(expand(expr))
        if path.name != BOT_DASHBOARD and not data["result"]:
            empty.append(f"{title}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


@pytest.mark.slow
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda path: path.name)
def test_every_template_variable_has_values(live: LiveStack, path: Path) -> None:
    for variable in load(path)["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        selector, label = match.groups()
        result = live.query(f"count by ({label}) ({expand(selector)})")["result"]
        assert [series["metric"][label] for series in result], variable["name"]


@pytest.mark.slow
def test_every_metric_the_rules_use_is_scraped(live: LiveStack) -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    bot = bot_metric_names()
    scraped = live.names()
    missing = set()
    for rule in rules():
        for name in metric_names(rule["expr"]) - recorded - NOT_SCRAPED_HERE:
            if name.startswith("megatrace_alertbot_"):
                if name not in bot:
                    missing.add(name)
            elif name not in scraped:
                missing.add(name)
    assert not missing, f"the rules use series nobody exports: {sorted(missing)}"


@pytest.mark.slow
def test_rules_load_and_evaluate_without_errors(live: LiveStack) -> None:
    groups = requests.get(f"{live.prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert {group["file"] for group in groups} == {str(path) for path in RULE_FILES}
    for group in groups:
        for rule in group["rules"]:
            assert rule["health"] != "err", f"{rule['name']}: {rule.get('lastError')}"
