"""Prometheus's scrape configuration for the chart's exporter, built the way the Prometheus Operator
builds it from the chart's ServiceMonitor, with the targets its endpoints role would discover.

The operator turns each ServiceMonitor endpoint into one scrape job (``serviceMonitor/<ns>/<name>/<i>``)
whose relabelings are its own (keep the selected Service and port, name ``namespace``, ``service``,
``pod``, ``container``, ``job`` and ``endpoint``) followed by the monitor's ``relabelings``, then its
hashmod sharding (one shard here). Kubernetes discovery is replaced by ``file_sd``: one target per
exporter pod, carrying the ``__meta_kubernetes_*`` labels the endpoints role gives a pod-backed
endpoint, so the chart's relabelings run on what they would see in a cluster.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.support.helm_chart import NAMESPACE, by_component

_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def label_name(name: str) -> str:
    """A Kubernetes label name as Prometheus discovery spells it (the operator's sanitizing)."""
    return _INVALID.sub("_", name)


def relabel(config: dict[str, Any]) -> dict[str, Any]:
    """An operator RelabelConfig (camelCase) as a Prometheus relabel_config."""
    keys = {
        "sourceLabels": "source_labels",
        "targetLabel": "target_label",
        "separator": "separator",
        "regex": "regex",
        "replacement": "replacement",
        "modulus": "modulus",
        "action": "action",
    }
    out = {keys[key]: value for key, value in config.items()}
    if "action" in out:
        out["action"] = str(out["action"]).lower()
    return out


def _keep_label(name: str, value: str) -> dict[str, Any]:
    sane = label_name(name)
    return {
        "action": "keep",
        "source_labels": [
            f"__meta_kubernetes_service_label_{sane}",
            f"__meta_kubernetes_service_labelpresent_{sane}",
        ],
        "regex": f"({value});true",
    }


def _from_target(kind: str, label: str) -> dict[str, Any]:
    return {
        "source_labels": [
            "__meta_kubernetes_endpoint_address_target_kind",
            "__meta_kubernetes_endpoint_address_target_name",
        ],
        "separator": ";",
        "regex": f"{kind};(.*)",
        "replacement": "${1}",
        "target_label": label,
    }


def scrape_job(
    monitor: dict[str, Any], index: int, endpoint: dict[str, Any], sd_file: Path
) -> dict[str, Any]:
    """The operator's scrape job for endpoint `index` of ServiceMonitor `monitor`, targets from `sd_file`."""
    spec = monitor["spec"]
    relabelings: list[dict[str, Any]] = [
        {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}
    ]
    relabelings += [_keep_label(k, v) for k, v in sorted(spec["selector"].get("matchLabels", {}).items())]
    relabelings.append(
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_endpoint_port_name"],
            "regex": endpoint["port"],
        }
    )
    relabelings += [_from_target("Node", "node"), _from_target("Pod", "pod")]
    for source, target in (
        ("namespace", "namespace"),
        ("service_name", "service"),
        ("pod_name", "pod"),
        ("pod_container_name", "container"),
    ):
        relabelings.append({"source_labels": [f"__meta_kubernetes_{source}"], "target_label": target})
    relabelings.append(
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}
    )
    relabelings.append(
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"}
    )
    if spec.get("jobLabel"):
        relabelings.append(
            {
                "source_labels": [f"__meta_kubernetes_service_label_{label_name(spec['jobLabel'])}"],
                "target_label": "job",
                "regex": "(.+)",
                "replacement": "${1}",
            }
        )
    relabelings.append({"target_label": "endpoint", "replacement": endpoint["port"]})
    relabelings += [relabel(item) for item in endpoint.get("relabelings", [])]
    relabelings += [
        {"source_labels": ["__address__"], "target_label": "__tmp_hash", "modulus": 1, "action": "hashmod"},
        {"source_labels": ["__tmp_hash"], "regex": "0", "action": "keep"},
    ]
    meta = monitor["metadata"]
    job: dict[str, Any] = {
        "job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{index}",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "metrics_path": endpoint.get("path", "/metrics"),
        "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}],
        "relabel_configs": relabelings,
    }
    if "interval" in endpoint:
        job["scrape_interval"] = endpoint["interval"]
    if "scrapeTimeout" in endpoint:
        job["scrape_timeout"] = endpoint["scrapeTimeout"]
    if endpoint.get("metricRelabelings"):
        job["metric_relabel_configs"] = [relabel(item) for item in endpoint["metricRelabelings"]]
    return job


def exporter_scrape_jobs(objects: list[dict[str, Any]], sd_file: Path) -> list[dict[str, Any]]:
    """The scrape jobs the operator makes of the chart's exporter ServiceMonitor."""
    monitor = by_component(objects, "ServiceMonitor", "exporter")
    return [scrape_job(monitor, i, ep, sd_file) for i, ep in enumerate(monitor["spec"]["endpoints"])]


def _labels_of(prefix: str, labels: dict[str, str]) -> dict[str, str]:
    out = {}
    for key, value in labels.items():
        out[f"__meta_kubernetes_{prefix}_label_{label_name(key)}"] = value
        out[f"__meta_kubernetes_{prefix}_labelpresent_{label_name(key)}"] = "true"
    return out


def exporter_targets(objects: list[dict[str, Any]], pods: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """file_sd entries for the exporter Service's endpoints: one per (pod name, pod IP, node name),
    labelled as Prometheus's Kubernetes endpoints role labels a pod-backed endpoint address."""
    service = by_component(objects, "Service", "exporter")
    daemonset = by_component(objects, "DaemonSet", "exporter")
    template = daemonset["spec"]["template"]
    container = template["spec"]["containers"][0]
    entries = []
    for service_port in service["spec"]["ports"]:
        container_port = next(p for p in container["ports"] if p["name"] == service_port["targetPort"])
        for pod_name, pod_ip, node_name in pods:
            labels = {
                "__meta_kubernetes_namespace": NAMESPACE,
                "__meta_kubernetes_service_name": service["metadata"]["name"],
                "__meta_kubernetes_endpoints_name": service["metadata"]["name"],
                "__meta_kubernetes_endpoint_port_name": service_port["name"],
                "__meta_kubernetes_endpoint_port_protocol": service_port.get("protocol", "TCP"),
                "__meta_kubernetes_endpoint_ready": "true",
                "__meta_kubernetes_endpoint_node_name": node_name,
                "__meta_kubernetes_endpoint_address_target_kind": "Pod",
                "__meta_kubernetes_endpoint_address_target_name": pod_name,
                "__meta_kubernetes_pod_name": pod_name,
                "__meta_kubernetes_pod_ip": pod_ip,
                "__meta_kubernetes_pod_node_name": node_name,
                "__meta_kubernetes_pod_host_ip": pod_ip,
                "__meta_kubernetes_pod_ready": "true",
                "__meta_kubernetes_pod_phase": "Running",
                "__meta_kubernetes_pod_container_name": container["name"],
                "__meta_kubernetes_pod_container_port_name": container_port["name"],
                "__meta_kubernetes_pod_container_port_number": str(container_port["containerPort"]),
                "__meta_kubernetes_pod_container_port_protocol": container_port.get("protocol", "TCP"),
                **_labels_of("service", service["metadata"]["labels"]),
                **_labels_of("pod", template["metadata"]["labels"]),
            }
            entries.append({"targets": [f"{pod_ip}:{container_port['containerPort']}"], "labels": labels})
    return entries
