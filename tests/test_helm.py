"""The Helm chart (helm/megatrace): lint, offline rendering with Helm's own library, schema rejection.

Rendering goes through `helm_python` (the helm-python-sdk package, Helm v4's Go SDK behind a C ABI),
so templates, `.Files.Glob` over the linked rules/ and grafana/ folders and values.schema.json
behave exactly as `helm lint`, `helm template` and `helm install` do.
"""

from __future__ import annotations

import http.server
import json
import re
import sqlite3
import subprocess
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import requests
import yaml

from megatrace.alertbot.service import Service
from megatrace.cli import build_parser
from megatrace.exporters import cli as exporter_cli
from megatrace.exporters.collectors import COLLECTORS, default_collectors
from megatrace.exporters.settings import load as load_agent_config
from tests.alertbot.conftest import config
from tests.cluster.operator_scrape import exporter_scrape_jobs, exporter_targets
from tests.support.helm_chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    REPO,
    bot_configuration,
    by_component,
    lint_problems,
    load_schema,
    objects_of,
    of_kind,
    only,
    render,
    schema_paths,
)
from tests.support.services import free_port, prometheus_argv, require_binary, running

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

# Every optional feature switched on and most defaults changed.
CUSTOM_VALUES: dict[str, Any] = {
    "fullnameOverride": "gpu-watch",
    "commonLabels": {"team": "infra"},
    "image": {"repository": "registry.example/megatrace", "tag": "9.9.9", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "prometheusOperator": {"selectorLabels": {"release": "prom", "monitoring": "gpu"}},
    "exporter": {
        "port": 9555,
        "collectors": ["gpu", "tracer"],
        "traceDir": "/data/megatrace/traces",
        "sysfsPath": "/host-sys",
        "extraArgs": ["--log-level=debug"],
        "extraEnv": [{"name": "EXTRA", "value": "1"}],
        "gpuAccess": {"runtimeClassName": "nvidia", "visibleDevices": "all"},
        "hostPID": True,
        "tracerGraceSeconds": 60,
        "nodeSelector": {"nvidia.com/gpu.present": None, "node-role/gpu": "yes"},
        "tolerations": [],
        "priorityClassName": "system-node-critical",
        "resources": {"requests": {"cpu": "100m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}},
        "podAnnotations": {"a": "b"},
        "service": {"port": 19555, "annotations": {"x": "y"}},
        "serviceMonitor": {
            "interval": "30s",
            "scrapeTimeout": "20s",
            "tracerInterval": "2s",
            "tracerScrapeTimeout": "1s",
            "labels": {"extra": "sm"},
        },
    },
    "rules": {"labels": {"role": "alert-rules"}},
    "dashboards": {"labels": {"grafana_dashboard": "megatrace"}, "namespace": "grafana", "folder": ""},
    "alertbot": {
        "port": 9600,
        "config": {
            "alertmanager": {"url": "http://alertmanager-operated.monitoring:9093"},
            "feishu": {"app": {"app_id": "cli_a1b2c3", "chats": {"P0": "oc_p0", "P1": "oc_p1"}}},
            "links": {"grafana_url": "https://grafana.example"},
        },
        "existingSecret": "megatrace-feishu",
        "webhookTokenKey": "token",
        "secretEnv": [
            {"name": "MEGATRACE_ALERTBOT_FEISHU__APP__APP_SECRET", "key": "app-secret"},
            {"name": "MEGATRACE_ALERTBOT_FEISHU__GROUP_BOTS__P0__WEBHOOK", "key": "p0-webhook"},
            {
                "name": "MEGATRACE_ALERTBOT_FEISHU__GROUP_BOTS__P0__SECRET",
                "key": "p0-secret",
                "optional": True,
            },
        ],
        "extraEnv": [{"name": "TZ", "value": "Asia/Shanghai"}],
        "persistence": {"existingClaim": "bot-state", "mountPath": "/state"},
        "traces": {"volume": {"nfs": {"server": "nfs.example", "path": "/traces"}}, "mountPath": "/mnt/t"},
        "service": {"port": 8080},
    },
    "alertmanagerConfig": {
        "labels": {"alertmanager": "main"},
        "groupBy": ["alertname", "instance"],
        "repeatInterval": "2h",
    },
}


def source_of(obj: dict[str, Any]) -> str:
    """The repository file an object was built from."""
    return obj["metadata"]["annotations"]["megatrace.io/source"]


def rule_files() -> list[Path]:
    """The rule files in rules/ (promtool test files, which have no `groups`, excluded)."""
    files = sorted([*(REPO / "rules").glob("*.yml"), *(REPO / "rules").glob("*.yaml")])
    return [path for path in files if "groups" in (yaml.safe_load(path.read_text()) or {})]


def dashboard_files() -> list[Path]:
    return sorted((REPO / "grafana" / "dashboards").glob("*.json"))


@pytest.fixture(scope="module")
def defaults() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def custom() -> list[dict[str, Any]]:
    return render(CUSTOM_VALUES)


@pytest.fixture(params=["defaults", "custom"])
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["defaults", "custom"])
def test_helm_lint_strict_passes(values: dict[str, Any] | None) -> None:
    assert lint_problems(values) == []


def test_every_object_is_a_named_namespaced_kubernetes_object(objects: list[dict[str, Any]]) -> None:
    assert objects
    seen = set()
    for obj in objects:
        assert re.match(r"^([a-z0-9.-]+/)?v\d+((alpha|beta)\d+)?$", obj["apiVersion"]), obj["apiVersion"]
        assert obj["kind"][:1].isupper()
        meta = obj["metadata"]
        assert DNS_LABEL.match(meta["name"]) and len(meta["name"]) <= 63, meta["name"]
        assert meta["namespace"] in (NAMESPACE, "grafana")
        for key, value in meta["labels"].items():
            assert LABEL_VALUE.match(str(value)) and len(str(value)) <= 63, (key, value)
        assert (obj["kind"], meta["name"]) not in seen, f"duplicate {obj['kind']} {meta['name']}"
        seen.add((obj["kind"], meta["name"]))


@pytest.mark.parametrize("kube_version", ["1.25.0", "1.37.0"])
def test_core_objects_match_the_kubernetes_api_schemas(
    objects: list[dict[str, Any]], kube_version: str
) -> None:
    """Strict validation against the Kubernetes OpenAPI schemas of the oldest supported and a recent
    version: unknown fields, wrong types and missing required fields all fail."""
    core = [obj for obj in objects if not obj["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {obj["kind"] for obj in core} >= {"DaemonSet", "Deployment", "Service", "ConfigMap"}
    for obj in core:
        kubernetes_validate.validate(obj, kube_version, strict=True)


def test_schema_validation_catches_a_misspelt_field(defaults: list[dict[str, Any]]) -> None:
    daemonset = json.loads(json.dumps(only(defaults, "DaemonSet")))
    daemonset["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["readonly"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="readonly"):
        kubernetes_validate.validate(daemonset, "1.37.0", strict=True)


def test_no_secret_is_created_and_credentials_are_read_by_reference(objects: list[dict[str, Any]]) -> None:
    assert of_kind(objects, "Secret") == []
    for kind in ("DaemonSet", "Deployment"):
        for container in only(objects, kind)["spec"]["template"]["spec"]["containers"]:
            for item in container.get("env", []):
                # a *_FILE setting names a file on a mounted Secret (checked where it is mounted)
                if re.search(r"SECRET|TOKEN|PASSWORD", item["name"]) and not item["name"].endswith("_FILE"):
                    assert "value" not in item and "secretKeyRef" in item["valueFrom"], item


def test_default_install_has_every_component(defaults: list[dict[str, Any]]) -> None:
    kinds = sorted({obj["kind"] for obj in defaults})
    for kind in (
        "DaemonSet",
        "Service",
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
        "Deployment",
        "PersistentVolumeClaim",
        "AlertmanagerConfig",
        "ServiceAccount",
    ):
        assert kind in kinds


def exporter_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return only(objects, "DaemonSet")["spec"]["template"]["spec"]


def test_exporter_host_paths_are_mounted_read_only(objects: list[dict[str, Any]]) -> None:
    pod = exporter_pod(objects)
    host_volumes = {vol["name"]: vol["hostPath"]["path"] for vol in pod["volumes"] if "hostPath" in vol}
    assert len(host_volumes) == 3
    mounts = [m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] in host_volumes]
    assert {m["name"] for m in mounts} == set(host_volumes)
    assert all(m.get("readOnly") is True for m in mounts), mounts


# Collectors the chart turns on with a value of their own, not through exporter.collectors.
CHART_SWITCHES = {"traces": ("traceEndpoint", "enabled")}


def test_the_chart_offers_every_collector_of_the_table() -> None:
    """A collector added to the collectors table must be offered by the chart's schema too."""
    exporter = load_schema()["properties"]["exporter"]["properties"]
    offered = exporter["collectors"]["items"]["enum"]
    assert sorted([*offered, *CHART_SWITCHES]) == sorted(COLLECTORS)
    for section, key in CHART_SWITCHES.values():
        assert key in exporter[section]["properties"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["exporter"]["collectors"] == default_collectors()


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (None, {}),
        (
            {"exporter": {"extraArgs": ["--xid-wait-ms=50", "--trace-max-concurrent=2"]}},
            {"xid_wait_ms": 50, "trace_max_concurrent": 2},
        ),
        (
            {
                "exporter": {
                    "collectors": ["infiniband"],
                    "tracerGraceSeconds": 60,
                    "podResources": {"enabled": False},
                }
            },
            {"tracer_grace_seconds": 60, "podresources_socket": ""},
        ),
    ],
    ids=["defaults", "collector-flags", "infiniband-only"],
)
def test_the_agent_loads_what_the_chart_gives_it(
    values: dict[str, Any] | None, expected: dict[str, Any]
) -> None:
    """The DaemonSet's arguments and environment are a configuration `megatrace exporter` accepts:
    every flag the chart writes is one the collectors' settings declare."""
    container = exporter_pod(render(values))["containers"][0]
    environ = {var["name"]: var.get("value", "node-a") for var in container["env"]}
    args = build_parser(container["args"]).parse_args(container["args"])
    config = load_agent_config(args.config, exporter_cli.overrides(args), environ=environ)
    chosen = (values or {}).get("exporter", {}).get("collectors", default_collectors())
    assert (config.listen, config.collectors, config.node_name) == (
        "0.0.0.0:9450",
        [*chosen, "traces"],
        "node-a",
    )
    loaded = {
        "sysfs_root": config.settings("infiniband").sysfs_root,
        "tracer_grace_seconds": config.settings("tracer").tracer_grace_seconds,
        "xid_wait_ms": config.settings("gpu").xid_wait_ms,
        "podresources_socket": config.settings("traces").podresources_socket,
        "trace_token_file": config.settings("traces").trace_token_file,
        "trace_max_concurrent": config.settings("traces").trace_max_concurrent,
    }
    assert loaded == {
        "sysfs_root": "/host/sys",
        "tracer_grace_seconds": 300,
        "xid_wait_ms": 500,
        "podresources_socket": "/var/lib/kubelet/pod-resources/kubelet.sock",
        "trace_token_file": "/etc/megatrace/trace-token/token",
        "trace_max_concurrent": 4,
        **expected,
    }


def test_exporter_defaults_follow_the_contract(defaults: list[dict[str, Any]]) -> None:
    pod = exporter_pod(defaults)
    container = pod["containers"][0]
    assert container["args"] == [
        "exporter",
        "--listen=0.0.0.0:9450",
        "--sysfs-root=/host/sys",
        "--trace-dir=/run/megatrace",
        "--collectors=gpu,infiniband,tracer,traces",
        "--tracer-grace=300",
        "--podresources-socket=/var/lib/kubelet/pod-resources/kubelet.sock",
    ]
    assert container["ports"] == [
        {"name": "metrics", "containerPort": 9450, "protocol": "TCP"},
        {"name": "traces", "containerPort": 9452, "protocol": "TCP"},
    ]
    volumes = {vol["name"]: vol["hostPath"]["path"] for vol in pod["volumes"] if "hostPath" in vol}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert (volumes["sysfs"], mounts["sysfs"]) == ("/sys", "/host/sys")
    assert volumes["traces"] == mounts["traces"] == "/run/megatrace"
    assert volumes["pod-resources"] == mounts["pod-resources"] == "/var/lib/kubelet/pod-resources"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert container["resources"] == {
        "requests": {"cpu": "50m", "memory": "64Mi"},
        "limits": {"cpu": "200m", "memory": "192Mi"},
    }
    assert pod["hostPID"] is False  # liveness comes from the ring file lock, not process ids
    assert "runtimeClassName" not in pod


def test_exporter_sees_gpus_without_privilege_or_taking_any(objects: list[dict[str, Any]]) -> None:
    container = exporter_pod(objects)["containers"][0]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    security = container["securityContext"]
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    for section in container["resources"].values():
        assert not any(name.startswith("nvidia.com/") for name in section)


def test_exporter_follows_non_default_values(custom: list[dict[str, Any]]) -> None:
    daemonset = only(custom, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert daemonset["metadata"]["name"] == "gpu-watch-exporter"
    assert container["image"] == "registry.example/megatrace:9.9.9"
    assert container["imagePullPolicy"] == "Always"
    assert container["args"] == [
        "exporter",
        "--listen=0.0.0.0:9555",
        "--sysfs-root=/host/sys",
        "--trace-dir=/data/megatrace/traces",
        "--collectors=gpu,tracer,traces",
        "--tracer-grace=60",
        "--podresources-socket=/var/lib/kubelet/pod-resources/kubelet.sock",
        "--log-level=debug",
    ]
    volumes = {vol["name"]: vol["hostPath"]["path"] for vol in pod["volumes"] if "hostPath" in vol}
    assert volumes["sysfs"] == "/host-sys"
    assert volumes["traces"] == "/data/megatrace/traces"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["hostPID"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] == {"node-role/gpu": "yes"}
    assert "tolerations" not in pod
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"name": "EXTRA", "value": "1"} in container["env"]
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "96Mi"},
        "limits": {"cpu": "200m", "memory": "256Mi"},
    }
    assert daemonset["spec"]["template"]["metadata"]["annotations"] == {"a": "b"}
    assert daemonset["metadata"]["labels"]["team"] == "infra"


def test_pod_resources_mount_can_be_switched_off() -> None:
    pod = exporter_pod(render({"exporter": {"podResources": {"enabled": False}}}))
    assert [vol["name"] for vol in pod["volumes"]] == ["sysfs", "traces", "trace-token"]
    assert "--podresources-socket=" in pod["containers"][0]["args"]


@pytest.mark.parametrize(("component", "port_name"), [("exporter", "metrics"), ("alertbot", "http")])
def test_services_select_their_pods_and_named_ports(
    objects: list[dict[str, Any]], component: str, port_name: str
) -> None:
    workload_kind = "DaemonSet" if component == "exporter" else "Deployment"
    workload = by_component(objects, workload_kind, component)
    service = by_component(objects, "Service", component)
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert workload["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    containers = workload["spec"]["template"]["spec"]["containers"]
    container_ports = {port["name"] for container in containers for port in container["ports"]}
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [port_name]
    assert port_name in container_ports
    monitor = by_component(objects, "ServiceMonitor", component)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {port_name}


def test_exporter_service_monitor_keeps_the_training_job_label(objects: list[dict[str, Any]]) -> None:
    monitor = by_component(objects, "ServiceMonitor", "exporter")
    endpoints = monitor["spec"]["endpoints"]
    assert [endpoint["path"] for endpoint in endpoints] == ["/metrics", "/metrics/tracer"]
    for endpoint in endpoints:
        assert endpoint["honorLabels"] is True
        assert {
            "sourceLabels": ["__meta_kubernetes_pod_node_name"],
            "targetLabel": "instance",
            "action": "replace",
        } in endpoint["relabelings"]


TRACER_SERIES = {"sourceLabels": ["__name__"], "regex": "megatrace_tracer_.*"}


@pytest.mark.parametrize(
    ("values", "hardware", "tracer"),
    [({}, ("15s", "10s"), ("5s", "4s")), (CUSTOM_VALUES, ("30s", "20s"), ("2s", "1s"))],
    ids=["defaults", "custom"],
)
def test_exporter_tracer_series_are_scraped_once_on_their_own_interval(
    values: dict[str, Any], hardware: tuple[str, str], tracer: tuple[str, str]
) -> None:
    """/metrics/tracer at the short interval of the hang budget keeps only the tracer's series; /metrics,
    at the hardware interval, drops them (the agent serves them there too); the tracer endpoint's
    `endpoint` label tells its `up` from that of /metrics."""
    metrics, tracer_path = by_component(render(values), "ServiceMonitor", "exporter")["spec"]["endpoints"]
    assert (metrics["path"], metrics["interval"], metrics["scrapeTimeout"]) == ("/metrics", *hardware)
    assert (tracer_path["path"], tracer_path["interval"], tracer_path["scrapeTimeout"]) == (
        "/metrics/tracer",
        *tracer,
    )
    assert metrics["metricRelabelings"] == [{**TRACER_SERIES, "action": "drop"}]
    assert tracer_path["metricRelabelings"] == [{**TRACER_SERIES, "action": "keep"}]
    assert {"targetLabel": "endpoint", "replacement": "tracer", "action": "replace"} in tracer_path[
        "relabelings"
    ]
    assert not [item for item in metrics["relabelings"] if item.get("targetLabel") == "endpoint"]


class _TwoPathAgent(http.server.BaseHTTPRequestHandler):
    """An agent as the contract of /metrics/tracer has it: /metrics serves every collector's series, the
    tracer's among them, and /metrics/tracer the tracer's alone."""

    TRACER = b'megatrace_tracer_rank_alive{job="llama",rank="0",local_rank="0"} 1\n'
    HARDWARE = b'megatrace_gpu_temperature_celsius{gpu="0"} 50\n'

    def do_GET(self) -> None:
        bodies = {"/metrics": self.HARDWARE + self.TRACER, "/metrics/tracer": self.TRACER}
        body = bodies.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_operator_scrape_jobs_of_the_chart_scrape_each_series_once(tmp_path: Path) -> None:
    """A real Prometheus running the scrape jobs the operator makes of the two endpoints (the cluster
    harness's generator), against an agent serving both paths: the tracer's series arrive once, from
    /metrics/tracer, with the training job's `job`; the hardware series from /metrics; two `up`s."""
    agent = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TwoPathAgent)
    threading.Thread(target=agent.serve_forever, daemon=True).start()
    port = agent.server_address[1]
    sm = {"interval": "1s", "scrapeTimeout": "1s", "tracerInterval": "1s", "tracerScrapeTimeout": "1s"}
    objects = render({"exporter": {"port": port, "serviceMonitor": sm}})
    sd_file = tmp_path / "targets.json"
    sd_file.write_text(json.dumps(exporter_targets(objects, [("exporter-a", "127.0.0.1", "gpu-node-1")])))
    config_file = tmp_path / "prometheus.yml"
    jobs = exporter_scrape_jobs(objects, sd_file)
    config_file.write_text(yaml.safe_dump({"global": {"evaluation_interval": "1s"}, "scrape_configs": jobs}))
    check = subprocess.run(
        [require_binary("promtool"), "check", "config", str(config_file)], capture_output=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    prom_port = free_port()
    api = f"http://127.0.0.1:{prom_port}/api/v1/query"
    argv = prometheus_argv(config_file, tmp_path / "data", prom_port)
    try:
        with running(argv, f"http://127.0.0.1:{prom_port}/-/ready", tmp_path / "prometheus.log"):

            def query(promql: str) -> list[dict[str, Any]]:
                return requests.get(api, params={"query": promql}, timeout=10).json()["data"]["result"]

            deadline = time.monotonic() + 60
            while len(query('up{job="megatrace"} == 1')) < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            up = {s["metric"]["endpoint"]: s["metric"] for s in query('up{job="megatrace"} == 1')}
            tracer = query("megatrace_tracer_rank_alive")
            hardware = query("megatrace_gpu_temperature_celsius")
    finally:
        agent.shutdown()
    assert set(up) == {"metrics", "tracer"}
    assert {labels["instance"] for labels in up.values()} == {"gpu-node-1"}
    ((series,),) = [tracer]
    assert series["metric"]["endpoint"] == "tracer"
    assert series["metric"]["job"] == "llama"
    assert series["metric"]["agent_address"] == f"127.0.0.1:{port}"
    ((gpu,),) = [hardware]
    assert gpu["metric"]["endpoint"] == "metrics"


def test_exporter_metric_relabelings_from_values_follow_the_charts_own() -> None:
    extra = [{"action": "labeldrop", "regex": "pci_bus_id"}]
    values = {"exporter": {"serviceMonitor": {"metricRelabelings": extra}}}
    for endpoint in by_component(render(values), "ServiceMonitor", "exporter")["spec"]["endpoints"]:
        assert endpoint["metricRelabelings"][1:] == extra
        assert endpoint["metricRelabelings"][0]["regex"] == "megatrace_tracer_.*"


@pytest.mark.parametrize("relabelings", [None, [], [{"targetLabel": "cluster", "replacement": "a"}]])
def test_exporter_targets_carry_the_address_the_bot_dials(relabelings: list[dict[str, str]] | None) -> None:
    values = {} if relabelings is None else {"exporter": {"serviceMonitor": {"relabelings": relabelings}}}
    metrics, tracer = by_component(render(values), "ServiceMonitor", "exporter")["spec"]["endpoints"]
    node_name = {
        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
        "targetLabel": "instance",
        "action": "replace",
    }
    expected = [node_name] if relabelings is None else relabelings
    for endpoint, chart_own in ((metrics, 1), (tracer, 2)):
        # the pod's discovered IP:port, set before the user's relabelings (which may not drop it)
        assert endpoint["relabelings"][0] == {
            "sourceLabels": ["__address__"],
            "targetLabel": "agent_address",
            "action": "replace",
        }
        assert endpoint["relabelings"][chart_own:] == expected


def scrape_jobs(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Component → the `job` label its ServiceMonitor gives the scrape (from the Service label it names)."""
    jobs = {}
    for component in ("exporter", "alertbot"):
        monitor = by_component(objects, "ServiceMonitor", component)
        service = by_component(objects, "Service", component)
        jobs[component] = service["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    return jobs


def test_scrape_jobs_are_the_ones_the_rules_watch(defaults: list[dict[str, Any]]) -> None:
    watched = set()
    for path in rule_files():
        watched |= set(re.findall(r'\bup\{job="([^"]+)"\}', path.read_text()))
    assert watched
    assert watched <= set(scrape_jobs(defaults).values())


def test_operator_selector_labels_reach_every_operator_object(custom: list[dict[str, Any]]) -> None:
    for kind in ("ServiceMonitor", "PrometheusRule", "AlertmanagerConfig"):
        for obj in of_kind(custom, kind):
            labels = obj["metadata"]["labels"]
            assert labels["release"] == "prom" and labels["monitoring"] == "gpu", (kind, labels)
    assert by_component(custom, "ServiceMonitor", "exporter")["metadata"]["labels"]["extra"] == "sm"
    assert {obj["metadata"]["labels"]["role"] for obj in of_kind(custom, "PrometheusRule")} == {"alert-rules"}
    assert only(custom, "AlertmanagerConfig")["metadata"]["labels"]["alertmanager"] == "main"


def test_rule_files_exist_to_be_read() -> None:
    assert rule_files(), "rules/ holds no rule file for the chart to read"


def test_prometheus_rules_equal_the_rules_folder(objects: list[dict[str, Any]]) -> None:
    rules = {source_of(obj): obj for obj in of_kind(objects, "PrometheusRule")}
    expected = {f"rules/{path.name}": yaml.safe_load(path.read_text())["groups"] for path in rule_files()}
    assert sorted(rules) == sorted(expected)
    for source, groups in expected.items():
        assert rules[source]["spec"] == {"groups": groups}, source


def test_every_alert_in_the_rendered_rules_is_graded(defaults: list[dict[str, Any]]) -> None:
    alerts = [
        rule
        for obj in of_kind(defaults, "PrometheusRule")
        for group in obj["spec"]["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]
    assert alerts
    for alert in alerts:
        assert alert["labels"]["severity"] in ("P0", "P1", "P2", "P3"), alert["alert"]


def test_rule_files_can_be_excluded() -> None:
    first = rule_files()[0].name
    sources = [source_of(obj) for obj in of_kind(render({"rules": {"exclude": [first]}}), "PrometheusRule")]
    assert f"rules/{first}" not in sources
    assert len(sources) == len(rule_files()) - 1


def test_dashboard_files_exist_to_be_read() -> None:
    assert dashboard_files(), "grafana/dashboards holds no dashboard for the chart to read"


def test_dashboards_equal_the_grafana_folder(defaults: list[dict[str, Any]]) -> None:
    maps = [obj for obj in of_kind(defaults, "ConfigMap") if "grafana_dashboard" in obj["metadata"]["labels"]]
    assert len(maps) == len(dashboard_files())
    by_file = {next(iter(obj["data"])): obj for obj in maps}
    for path in dashboard_files():
        config_map = by_file[path.name]
        assert json.loads(config_map["data"][path.name]) == json.loads(path.read_text())
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["annotations"]["grafana_folder"] == "Megatrace"
        assert config_map["metadata"]["namespace"] == NAMESPACE


def test_dashboards_follow_sidecar_values(custom: list[dict[str, Any]]) -> None:
    maps = [obj for obj in of_kind(custom, "ConfigMap") if obj["metadata"]["labels"].get("grafana_dashboard")]
    assert len(maps) == len(dashboard_files())
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "megatrace"
        assert config_map["metadata"]["namespace"] == "grafana"
        assert "grafana_folder" not in config_map["metadata"]["annotations"]


def test_alertbot_runs_once_with_state_on_a_claim(defaults: list[dict[str, Any]]) -> None:
    deployment = only(defaults, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    claim = only(defaults, "PersistentVolumeClaim")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    volumes = {vol["name"]: vol for vol in pod["volumes"]}
    assert volumes["state"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    container = pod["containers"][0]
    assert container["args"] == ["alertbot", "--config=/etc/megatrace/alertbot.yaml"]
    assert {"name": "state", "mountPath": "/var/lib/megatrace"} in container["volumeMounts"]
    bot_config = by_component(defaults, "ConfigMap", "alertbot")
    assert volumes["config"]["configMap"]["name"] == bot_config["metadata"]["name"]


def secret_refs(objects: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    container = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return [
        (item["name"], item["valueFrom"]["secretKeyRef"]["name"], item["valueFrom"]["secretKeyRef"]["key"])
        for item in container["env"]
        if "valueFrom" in item
    ]


def test_alertbot_secrets_come_only_from_the_existing_secret(
    defaults: list[dict[str, Any]], custom: list[dict[str, Any]]
) -> None:
    assert secret_refs(defaults) == [
        ("MEGATRACE_ALERTBOT_AUTH__BEARER_TOKEN", "megatrace-alertbot", "webhook-token"),
        ("MEGATRACE_ALERTBOT_FEISHU__APP__APP_SECRET", "megatrace-alertbot", "feishu-app-secret"),
    ]
    assert secret_refs(custom) == [
        ("MEGATRACE_ALERTBOT_AUTH__BEARER_TOKEN", "megatrace-feishu", "token"),
        ("MEGATRACE_ALERTBOT_FEISHU__APP__APP_SECRET", "megatrace-feishu", "app-secret"),
        ("MEGATRACE_ALERTBOT_FEISHU__GROUP_BOTS__P0__WEBHOOK", "megatrace-feishu", "p0-webhook"),
        ("MEGATRACE_ALERTBOT_FEISHU__GROUP_BOTS__P0__SECRET", "megatrace-feishu", "p0-secret"),
    ]


def test_alertbot_accepts_the_rendered_configuration(
    defaults: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = bot_configuration(defaults, {"webhook-token": "tok-1"}, tmp_path, monkeypatch)
    assert config.listen == "0.0.0.0:9451"
    assert config.store.path == "/var/lib/megatrace/alertbot.db"
    assert config.report.directory == "/var/lib/megatrace/reports"
    assert config.auth.bearer_token == "tok-1"
    assert config.drilldown.trace_roots == []
    assert config.alertmanager.url == "http://kube-prometheus-stack-alertmanager.monitoring.svc:9093"


def test_alertbot_accepts_configuration_from_values(
    custom: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = {"token": "tok-2", "app-secret": "s3cr3t", "p0-webhook": "https://feishu.example/hook/abc"}
    config = bot_configuration(custom, secret, tmp_path, monkeypatch)
    assert config.listen == "0.0.0.0:9600"
    assert config.store.path == "/state/alertbot.db"
    assert config.drilldown.trace_roots == ["/mnt/t"]
    assert config.feishu.app.app_id == "cli_a1b2c3"
    assert config.feishu.app.app_secret == "s3cr3t"
    assert config.feishu.app.chats == {"P0": "oc_p0", "P1": "oc_p1"}
    assert config.feishu.group_bots["P0"].webhook == "https://feishu.example/hook/abc"
    assert config.feishu.group_bots["P0"].secret == ""  # its optional key is absent from the Secret
    assert config.alertmanager.url == "http://alertmanager-operated.monitoring:9093"


def test_alertbot_config_file_can_come_from_a_secret() -> None:
    objects = render({"alertbot": {"existingConfigSecret": {"name": "bot-config"}}})
    assert not [obj for obj in of_kind(objects, "ConfigMap") if "alertbot.yaml" in obj.get("data", {})]
    volumes = {vol["name"]: vol for vol in only(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["secret"] == {
        "secretName": "bot-config",
        "items": [{"key": "alertbot.yaml", "path": "alertbot.yaml"}],
    }


def test_alertbot_uses_an_existing_claim_and_the_trace_volume(custom: list[dict[str, Any]]) -> None:
    assert of_kind(custom, "PersistentVolumeClaim") == []
    pod = only(custom, "Deployment")["spec"]["template"]["spec"]
    volumes = {vol["name"]: vol for vol in pod["volumes"]}
    assert volumes["state"]["persistentVolumeClaim"]["claimName"] == "bot-state"
    assert volumes["traces"]["nfs"] == {"server": "nfs.example", "path": "/traces"}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["traces"] == {"name": "traces", "mountPath": "/mnt/t", "readOnly": True}
    assert mounts["state"]["mountPath"] == "/state"


def test_alertbot_without_persistence_keeps_state_in_an_empty_dir() -> None:
    objects = render({"alertbot": {"persistence": {"enabled": False}}})
    assert of_kind(objects, "PersistentVolumeClaim") == []
    volumes = {vol["name"]: vol for vol in only(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"] == {"name": "state", "emptyDir": {}}


def test_alertmanager_config_routes_graded_alerts_to_the_bot(objects: list[dict[str, Any]]) -> None:
    config = only(objects, "AlertmanagerConfig")
    assert config["apiVersion"] == "monitoring.coreos.com/v1alpha1"
    service = by_component(objects, "Service", "alertbot")
    (receiver,) = config["spec"]["receivers"]
    assert config["spec"]["route"]["receiver"] == receiver["name"]
    assert config["spec"]["route"]["matchers"] == [{"name": "severity", "matchType": "=~", "value": "P[0-3]"}]
    assert config["spec"]["route"]["groupWait"] == "10s"
    # pages leave after a short first wait, inheriting the rest (docs/alerts.md, the time-to-page budget)
    (pages,) = config["spec"]["route"]["routes"]
    assert pages == {"matchers": [{"name": "severity", "matchType": "=", "value": "P0"}], "groupWait": "1s"}
    (webhook,) = receiver["webhookConfigs"]
    port = service["spec"]["ports"][0]["port"]
    assert webhook["url"] == f"http://{service['metadata']['name']}.{NAMESPACE}.svc:{port}/alertmanager"
    assert webhook["sendResolved"] is True


def test_alertmanager_config_sends_the_bots_token(
    defaults: list[dict[str, Any]], custom: list[dict[str, Any]]
) -> None:
    assert only(defaults, "AlertmanagerConfig")["spec"]["route"]["groupBy"] == ["alertname", "job", "rank"]
    webhook = only(defaults, "AlertmanagerConfig")["spec"]["receivers"][0]["webhookConfigs"][0]
    assert webhook["httpConfig"]["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "megatrace-alertbot", "key": "webhook-token"},
    }
    config = only(custom, "AlertmanagerConfig")
    webhook = config["spec"]["receivers"][0]["webhookConfigs"][0]
    assert webhook["url"].endswith(":8080/alertmanager")
    assert webhook["httpConfig"]["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "megatrace-feishu", "key": "token"},
    }
    assert config["spec"]["route"]["groupBy"] == ["alertname", "instance"]
    assert config["spec"]["route"]["repeatInterval"] == "2h"


def test_components_can_be_switched_off() -> None:
    objects = render(
        {
            "exporter": {"enabled": False},
            "alertbot": {"enabled": False},
            "rules": {"enabled": False},
            "dashboards": {"enabled": False},
        }
    )
    assert objects == []


def test_operator_objects_can_be_left_out_when_the_crds_are_absent() -> None:
    objects = render(
        {
            "exporter": {"serviceMonitor": {"enabled": False}},
            "alertbot": {"serviceMonitor": {"enabled": False}},
            "rules": {"enabled": False},
            "alertmanagerConfig": {"enabled": False},
        }
    )
    assert not [obj for obj in objects if obj["apiVersion"].startswith("monitoring.coreos.com/")]
    assert only(objects, "DaemonSet") and only(objects, "Deployment")


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"exporter": {"port": "9450"}}, "/exporter/port"),
        ({"exporter": {"port": 70000}}, "/exporter/port"),
        ({"exporter": {"collectors": ["nvml"]}}, "/exporter/collectors/0"),
        ({"exporter": {"collectors": []}}, "/exporter/collectors"),
        ({"exporter": {"traceDir": "run/megatrace"}}, "/exporter/traceDir"),
        ({"exporter": {"hostPID": "yes"}}, "/exporter/hostPID"),
        ({"exporter": {"serviceMonitor": {"interval": "often"}}}, "/exporter/serviceMonitor/interval"),
        ({"exporter": {"resources": {"limits": {"memory": "lots"}}}}, "/exporter/resources/limits/memory"),
        ({"exporter": {"nodeSelector": {"gpu": True}}}, "/exporter/nodeSelector/gpu"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"image": {"repository": ""}}, "/image/repository"),
        ({"alertbot": {"secretEnv": [{"name": "FEISHU_SECRET", "key": "s"}]}}, "/alertbot/secretEnv/0/name"),
        ({"alertbot": {"secretEnv": [{"name": "MEGATRACE_ALERTBOT_X"}]}}, "/alertbot/secretEnv/0"),
        ({"alertbot": {"persistence": {"accessModes": ["ReadWriteSometimes"]}}}, "/alertbot/persistence"),
        ({"alertbot": {"service": {"type": "Ingress"}}}, "/alertbot/service/type"),
        ({"alertbot": {"feishuSecret": "hunter2"}}, "/alertbot"),
        ({"alertmanagerConfig": {"groupWait": 10}}, "/alertmanagerConfig/groupWait"),
        ({"alertmanagerConfig": {"p0GroupWait": "soon"}}, "/alertmanagerConfig/p0GroupWait"),
        ({"exporter": {"serviceMonitor": {"tracerInterval": 5}}}, "/exporter/serviceMonitor/tracerInterval"),
        ({"alertbot": {"existingSecret": ""}}, "/alertbot/existingSecret"),
        ({"exporter": {"tracerGraceSeconds": -1}}, "/exporter/tracerGraceSeconds"),
        ({"exporters": {"enabled": True}}, "exporters"),
    ],
)
def test_schema_rejects_wrong_values(values: dict[str, Any], where: str) -> None:
    with helm_python.Chart.load(CHART) as chart, pytest.raises(helm_python.HelmValuesError) as caught:
        chart.validate_schema(values)
    assert where in str(caught.value)
    assert any(where in problem for problem in lint_problems(values))


def test_values_yaml_is_documented_line_by_line() -> None:
    """Every key the chart defines (shared definitions' inner keys aside) has a comment right above it."""
    schema = load_schema()
    described = {".".join(path) for path in schema_paths(schema, schema["definitions"], follow_refs=False)}
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    checked, undocumented = 0, []
    for number, line in enumerate(lines):
        found = re.match(r"^( *)([A-Za-z][A-Za-z0-9_]*):", line)
        if not found:
            continue
        indent = len(found.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, found.group(2)))
        path = ".".join(key for _, key in stack)
        if path in described:
            checked += 1
            if not lines[number - 1].strip().startswith("#"):
                undocumented.append(f"values.yaml line {number + 1}: {path}")
    assert checked == len(described) - 1  # all but `global`, which values.yaml leaves to the parent chart
    assert undocumented == []


def test_packaged_chart_carries_the_linked_rules_and_dashboards(tmp_path: Path) -> None:
    archive = Path(helm_python.package(CHART, destination=tmp_path))
    assert archive.name == "megatrace-0.1.0.tgz"
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        for path in rule_files():
            member = f"megatrace/files/rules/{path.name}"
            assert member in names
            assert tar.extractfile(member).read() == path.read_bytes()  # type: ignore[union-attr]
        for path in dashboard_files():
            assert f"megatrace/files/grafana/dashboards/{path.name}" in names
    with helm_python.Chart.load(archive) as chart:
        manifests = chart.render(name=RELEASE, namespace=NAMESPACE)
    assert len(of_kind(objects_of(manifests), "PrometheusRule")) == len(rule_files())


def test_drilldown_in_the_cluster_needs_no_shared_volume(
    defaults: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bot fetches from the agents' trace endpoints: token from one Secret mounted in both, the
    agents' port in both, and a NetworkPolicy opening that port to the bot's pods only."""
    assert of_kind(defaults, "PersistentVolumeClaim") and not any(
        "ReadWriteMany" in claim["spec"]["accessModes"]
        for claim in of_kind(defaults, "PersistentVolumeClaim")
    )
    exporter = exporter_pod(defaults)
    bot = only(defaults, "Deployment")["spec"]["template"]["spec"]
    for pod in (exporter, bot):
        token = next(vol for vol in pod["volumes"] if vol["name"] == "trace-token")
        assert token["secret"] == {
            "secretName": "megatrace-trace-token",
            "items": [{"key": "token", "path": "token"}],
        }
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "trace-token")
        assert mount == {"name": "trace-token", "mountPath": "/etc/megatrace/trace-token", "readOnly": True}
    env = {item["name"]: item.get("value") for item in exporter["containers"][0]["env"]}
    assert env["MEGATRACE_EXPORTER_TRACE_LISTEN"] == "0.0.0.0:9452"
    assert env["MEGATRACE_EXPORTER_TRACE_TOKEN_FILE"] == "/etc/megatrace/trace-token/token"
    config = bot_configuration(defaults, {"webhook-token": "tok-1"}, tmp_path, monkeypatch)
    assert config.drilldown.source == "agents"
    assert config.drilldown.agents.port == 9452
    assert config.drilldown.agents.token_file == "/etc/megatrace/trace-token/token"
    assert config.drilldown.prometheus_url == "http://kube-prometheus-stack-prometheus.monitoring.svc:9090"
    (policy,) = of_kind(defaults, "NetworkPolicy")
    exporter_labels = only(defaults, "DaemonSet")["spec"]["selector"]["matchLabels"]
    bot_labels = only(defaults, "Deployment")["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["podSelector"] == {"matchLabels": exporter_labels}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {"ports": [{"port": "metrics", "protocol": "TCP"}]},
        {
            "from": [{"podSelector": {"matchLabels": bot_labels}}],
            "ports": [{"port": "traces", "protocol": "TCP"}],
        },
    ]


def test_the_bot_finds_the_agents_through_a_headless_service_when_prometheus_is_down(
    defaults: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exporter's headless Service resolves to every agent pod (ready or not) on the trace port; no
    ServiceMonitor selects it; the bot's DNS fallback names it."""
    service = by_component(defaults, "Service", "exporter-dns")
    assert service["metadata"]["name"] == f"{RELEASE}-megatrace-exporter-headless"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod_labels = only(defaults, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "traces", "port": 9452, "targetPort": "traces", "protocol": "TCP"}
    ]
    for monitor in of_kind(defaults, "ServiceMonitor"):
        assert not monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    config = bot_configuration(defaults, {"webhook-token": "tok-1"}, tmp_path, monkeypatch)
    name = f"{RELEASE}-megatrace-exporter-headless.{NAMESPACE}.svc"
    assert config.drilldown.agents.fallback.dns_name == name

    off = render({"exporter": {"traceEndpoint": {"headlessService": False}}})
    assert [
        s["metadata"]["name"] for s in of_kind(off, "Service") if "headless" in s["metadata"]["name"]
    ] == []
    (tmp_path / "off").mkdir()
    config = bot_configuration(off, {"webhook-token": "tok-1"}, tmp_path / "off", monkeypatch)
    assert config.drilldown.agents.fallback.dns_name == ""
    kept = render({"alertbot": {"drilldown": {"dnsFallback": False}}})
    (tmp_path / "kept").mkdir()
    config = bot_configuration(kept, {"webhook-token": "tok-1"}, tmp_path / "kept", monkeypatch)
    assert config.drilldown.agents.fallback.dns_name == ""
    assert by_component(kept, "Service", "exporter-dns")


def test_drilldown_from_agents_needs_the_trace_endpoint_and_prometheus() -> None:
    for values in (
        {"exporter": {"traceEndpoint": {"enabled": False}}},
        {"alertbot": {"drilldown": {"prometheusUrl": ""}}},
    ):
        with pytest.raises(Exception, match=r"traceEndpoint|prometheusUrl|minLength|const"):
            render(values)
    objects = render(
        {
            "exporter": {"traceEndpoint": {"enabled": False}},
            "alertbot": {
                "drilldown": {"source": "directory"},
                "traces": {"volume": {"nfs": {"server": "n", "path": "/t"}}},
            },
        }
    )
    assert of_kind(objects, "NetworkPolicy") == []
    assert "--collectors=gpu,infiniband,tracer" in exporter_pod(objects)["containers"][0]["args"]


def test_alertbot_runs_replicas_on_a_configured_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render({"alertbot": {"replicas": 2, "database": {"urlKey": "database-url"}}})
    deployment = only(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate"}
    assert ("MEGATRACE_ALERTBOT_STORE__URL", "megatrace-alertbot", "database-url") in secret_refs(objects)
    url = "postgresql://bot:pw@db.example:5432/megatrace"
    config = bot_configuration(objects, {"webhook-token": "t", "database-url": url}, tmp_path, monkeypatch)
    assert config.store.url == url
    with pytest.raises(Exception, match=r"needs alertbot\.database\.urlKey"):
        render({"alertbot": {"replicas": 2}})


def test_alertbot_probes_restart_only_what_a_restart_mends(
    defaults: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Liveness and readiness are separate endpoints of the bot: a store outage fails readiness only
    (a restart cannot bring the database back), so the kubelet takes the pod out of the Service
    without restarting it."""
    container = only(defaults, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    live, ready = container["livenessProbe"]["httpGet"], container["readinessProbe"]["httpGet"]
    assert live["port"] == ready["port"] == "http" and live["path"] != ready["path"]
    bot = Service(config(tmp_path))
    bot.start()
    try:
        base = f"http://127.0.0.1:{bot.port}"
        assert requests.get(base + live["path"], timeout=20).status_code == 200
        assert requests.get(base + ready["path"], timeout=20).status_code == 200

        def gone() -> int:
            raise sqlite3.OperationalError("unable to open database file")

        monkeypatch.setattr(bot.store.outbox, "queue_depth", gone)
        assert requests.get(base + live["path"], timeout=20).status_code == 200
        assert requests.get(base + ready["path"], timeout=20).json() == {
            "status": "store unavailable",
            "error": "OperationalError",
        }
    finally:
        bot.stop()
