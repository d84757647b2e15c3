"""Where the drill-down finds a job's node agents. Normally from Prometheus: each rank's last
``megatrace_tracer_rank_info`` series names the agent that reported it, dialled at the host of its
``agent_address`` label (the pod's IP:port the chart adds) or, without one, of its ``instance``, and named
on cards by its ``node`` label or that ``instance``. When Prometheus cannot be asked (or knows no series
of the job), every agent of a static list (`drilldown.agents.fallback.static`) and every address a DNS
name resolves to (`drilldown.agents.fallback.dns_name`, e.g. the exporter's headless Service) is asked
instead; which ranks each holds is then learnt from the agents themselves."""

from __future__ import annotations

import dataclasses
import re
import socket

from megatrace.alertbot.config import AgentsConfig

HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*)(?::(\d+))?")


class GatherError(RuntimeError):
    """Nothing could be gathered at all (no agent known, or none answered)."""


@dataclasses.dataclass(frozen=True)
class Agent:
    """A node agent: the host the bot dials (its trace endpoint on `port`) and the name cards use."""

    address: str
    port: int
    name: str = ""
    # the host part of its Prometheus `instance` (what hint queries match on); "" when not from Prometheus
    instance: str = ""

    def describe(self) -> str:
        """ "agent 10.1.0.7:9452", or "agent on node-b (10.1.0.7:9452)" when a node name is known."""
        where = f"{self.address}:{self.port}"
        return (
            f"agent on {self.name} ({where})" if self.name and self.name != self.address else f"agent {where}"
        )


@dataclasses.dataclass
class Discovered:
    """The agents to ask and, where known (from Prometheus), which agent holds each rank (None: a rank
    of the job's world size that no series places)."""

    agents: list[Agent]
    ranks: dict[int, Agent | None]
    source: str  # "prometheus" or "fallback"
    note: str = ""  # why the fallback was used


def host_of(address: str) -> str:
    """The host part of ``HOST[:PORT]`` (IPv6 in brackets), or "" when it is no such address."""
    match = HOST_PORT.fullmatch(address)
    return match.group(1) if match else ""


def from_prometheus(url: str, job: str, cfg: AgentsConfig) -> Discovered:
    """Rank -> agent from the job's tracer series in the last `cfg.lookback_s`; GatherError when
    Prometheus cannot be asked or has no series of the job."""
    from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
    from urllib3.util.retry import Retry

    if not url:
        raise GatherError("no Prometheus is configured (drilldown.prometheus_url)")
    query = f'last_over_time(megatrace_tracer_rank_info{{job="{job}"}}[{max(60, int(cfg.lookback_s))}s])'
    try:
        prom = PrometheusConnect(
            url=url,
            disable_ssl=True,
            timeout=(min(cfg.connect_timeout_s, cfg.timeout_s), cfg.timeout_s),
            retry=Retry(total=1, read=False),
        )
        series = prom.custom_query(query, params={"timeout": f"{max(1, int(cfg.timeout_s))}s"})
    except (PrometheusApiClientException, OSError, ValueError) as exc:
        raise GatherError(
            f"Prometheus could not be asked for the job's agents: {type(exc).__name__}"
        ) from None
    ranks: dict[int, Agent | None] = {}
    world = 0
    for sample in series:
        labels = sample.get("metric", {})
        instance = host_of(labels.get("instance", ""))
        address = host_of(labels.get("agent_address", "")) or instance
        rank = labels.get("rank", "")
        if address and rank.isdigit():
            ranks[int(rank)] = Agent(address, cfg.port, labels.get("node") or instance, instance)
        world = max(world, int(labels["world_size"]) if labels.get("world_size", "").isdigit() else 0)
    if not ranks:
        raise GatherError(f"Prometheus has no tracer series of job {job!r} (megatrace_tracer_rank_info)")
    for rank in range(min(world, 1 << 20)):
        ranks.setdefault(rank, None)
    agents = sorted({a for a in ranks.values() if a is not None}, key=lambda a: (a.address, a.port))
    return Discovered(agents, ranks, "prometheus")


def from_fallback(cfg: AgentsConfig) -> list[Agent]:
    """Every agent of the static list and every address `dns_name` resolves to; GatherError when the
    name does not resolve and no static agent is listed."""
    agents = []
    for entry in cfg.fallback.static:
        match = HOST_PORT.fullmatch(entry)
        if match:
            agents.append(Agent(match.group(1), int(match.group(2) or cfg.port), match.group(1)))
    if cfg.fallback.dns_name:
        try:
            agents += [Agent(address, cfg.port) for address in resolve_all(cfg.fallback.dns_name)]
        except OSError as exc:
            if not agents:
                raise GatherError(
                    f"{cfg.fallback.dns_name} does not resolve: {exc.strerror or type(exc).__name__}"
                ) from None
    return list(dict.fromkeys(agents))


def resolve_all(name: str) -> list[str]:
    """Every address (A and AAAA records) `name` resolves to, IPv6 ones in brackets, in the resolver's
    order; OSError when it does not resolve."""
    found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    addresses = [str(info[4][0]) for info in found]
    return list(dict.fromkeys(f"[{a}]" if ":" in a else a for a in addresses))


def discover(prometheus_url: str, job: str, cfg: AgentsConfig) -> Discovered:
    """The job's agents from Prometheus, else from the fallback when one is configured; GatherError
    saying why neither gave any agent."""
    try:
        return from_prometheus(prometheus_url, job, cfg)
    except GatherError as exc:
        if not (cfg.fallback.static or cfg.fallback.dns_name):
            raise
        why = str(exc)
    agents = from_fallback(cfg)
    if not agents:
        raise GatherError(f"{why}; the fallback lists no agent")
    return Discovered(agents, {}, "fallback", f"{why}; asked every agent of the fallback instead")
