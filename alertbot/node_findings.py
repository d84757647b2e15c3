"""What Prometheus knows about the nodes of a drill-down's ranks: GPU clock events, XID errors and
InfiniBand error counters over the lookback, as findings per node. The card lists the suspects' findings
as hints; when the analyzer could name no host cause (``why.class`` ``unknown``), a finding on the
culprit's GPU or node that its peers' GPUs or nodes do not share names the class ``gpu`` or ``network``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
IB_COUNTERS = (
    "link_downed_total",
    "link_error_recovery_total",
    "port_errors_received_total",
    "port_discards_received_total",
)
_PORT = re.compile(r":[0-9]+$")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing Prometheus shows on a node: `kind` "gpu" (with the GPU's index) or "network"."""

    host: str
    kind: str
    gpu: str
    text: str


def _promql_hosts(hosts: Iterable[str]) -> str:
    alternatives = "|".join(re.escape(host).replace("\\", "\\\\") for host in hosts)
    return f'instance=~"({alternatives})(:[0-9]+)?"'


def _queries(where: str, window: str, minutes: str) -> list[tuple[str, str, Callable[[dict, float], str]]]:
    """(query, kind, describe) for every node counter a finding can come from."""
    queries: list[tuple[str, str, Callable[[dict, float], str]]] = [
        (
            f"max_over_time(megatrace_gpu_clock_event_active{{{where}}}[{window}]) > 0",
            "gpu",
            lambda m, v: f"GPU {m.get('gpu', '?')}: clock event {m.get('reason', '?')} in the last {minutes}",
        ),
        (
            f"increase(megatrace_gpu_xid_errors_total{{{where}}}[{window}]) > 0",
            "gpu",
            lambda m, v: (
                f"GPU {m.get('gpu', '?')}: {v:.0f} XID {m.get('xid', '?')} error(s) in the last {minutes}"
            ),
        ),
    ]
    for counter in IB_COUNTERS:
        queries.append(
            (
                f"increase(megatrace_infiniband_{counter}{{{where}}}[{window}]) > 0",
                "network",
                _port_counter(counter, minutes),
            )
        )
    return queries


def _port_counter(counter: str, minutes: str) -> Callable[[dict, float], str]:
    def describe(m: dict, v: float) -> str:
        return f"{m.get('device', '?')} port {m.get('port', '?')}: {counter} +{v:.0f} in the last {minutes}"

    return describe


def node_findings(
    url: str, hosts: list[str], lookback_s: float, timeout: float = 10.0, connect_timeout: float = 3.0
) -> tuple[list[Finding], str]:
    """Findings on `hosts` in the last `lookback_s`, and "" or why Prometheus could not be asked.

    Each request waits at most `timeout` seconds (`connect_timeout` to connect) and is not retried: a
    Prometheus that accepts the connection and never answers costs one timeout, one partitioned away
    one connect timeout. Host names that are not plain names are not asked about."""
    from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
    from urllib3.util.retry import Retry

    hosts = [host for host in dict.fromkeys(hosts) if HOST_NAME.fullmatch(host)]
    if not url or not hosts:
        return [], ""
    window = f"{max(60, int(lookback_s))}s"
    minutes = f"{max(1, int(lookback_s // 60))} min"
    findings = []
    try:
        prom = PrometheusConnect(
            url=url,
            disable_ssl=True,
            timeout=(min(connect_timeout, timeout), timeout),
            retry=Retry(total=0, read=False),
        )
        for query, kind, describe in _queries(_promql_hosts(hosts), window, minutes):
            for sample in prom.custom_query(query, params={"timeout": f"{max(1, int(timeout))}s"}):
                metric = sample.get("metric", {})
                host = _PORT.sub("", str(metric.get("instance", "")))
                text = describe(metric, float(sample["value"][1]))
                findings.append(Finding(host, kind, str(metric.get("gpu", "")), text))
    except (PrometheusApiClientException, OSError, ValueError, KeyError) as exc:
        return findings, f"Prometheus could not be asked about {', '.join(hosts)}: {type(exc).__name__}"
    return findings, ""


def prometheus_hints(
    url: str, host: str, lookback_s: float, timeout: float = 10.0, connect_timeout: float = 3.0
) -> list[str]:
    """The card's hints about one suspect's node: its findings, or why Prometheus could not be asked."""
    findings, error = node_findings(url, [host], lookback_s, timeout, connect_timeout)
    return [f.text for f in findings if f.host == host] + ([error] if error else [])


def _matches(finding: Finding, host: str, gpu: str) -> bool:
    return finding.host == host and (finding.kind == "network" or not gpu or finding.gpu == gpu)


def cause_from_nodes(
    culprit: dict[str, Any], peers: list[dict[str, Any]], findings: list[Finding]
) -> dict[str, str] | None:
    """{"class", "evidence"} when the culprit's GPU (or, for the network, its node) shows a finding
    that none of its peers' GPUs (nodes) shows; None otherwise. `culprit` and `peers` are placements
    (``host``, ``gpu``)."""
    host, gpu = str(culprit.get("host", "")), _gpu(culprit)
    for kind in ("gpu", "network"):
        own = [f for f in findings if f.kind == kind and _matches(f, host, gpu)]
        if not own:
            continue
        others = {
            (str(p.get("host", "")), _gpu(p) if kind == "gpu" else "")
            for p in peers
            if (str(p.get("host", "")), _gpu(p) if kind == "gpu" else "")
            != (host, gpu if kind == "gpu" else "")
        }
        if not others:
            continue
        shared = [o for o in others if any(f.kind == kind and _matches(f, *o) for f in findings)]
        if shared:
            continue
        what = "GPU" if kind == "gpu" else "node"
        return {
            "class": kind,
            "evidence": f"{own[0].text} on node {host}; none on the {len(others)} other {what}(s) "
            "of its peers",
        }
    return None


def _gpu(placement: dict[str, Any]) -> str:
    gpu = placement.get("gpu")
    return str(gpu) if isinstance(gpu, int) and gpu >= 0 else ""
