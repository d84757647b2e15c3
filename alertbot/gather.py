"""Gathers a job's trace data from the node agents' trace endpoints, for the drill-down.

Which agents hold the job's ranks comes from Prometheus: the ``instance`` label of the job's
``megatrace_tracer_rank_info`` series (the agent's /metrics address; its trace endpoint is the same
host on ``agents.port``). Each agent is asked for the job's ranks on its node (with their node, pod,
container and GPU), then each rank's newest ``records_per_rank`` records as a ring file, and the
header of its newest stall dump (when the rank was seen stalled; the whole dump's newest records for a
rank whose ring is gone), in parallel (one rank of each agent in turn), each request with a timeout
and a few retries. What came back is written to a folder of ring and dump files the analyzer reads as
any trace folder; ranks whose agent is down, slow or missing them are listed with the reason.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from megatrace.alertbot.config import AgentsConfig
from megatrace.exporters.trace_store import DUMP_NAME

log = logging.getLogger(__name__)

# Rank facts the agents report that name where a rank runs, as the verdict carries them.
PLACEMENT_KEYS = ("node", "host", "local_rank", "namespace", "pod", "container", "gpu", "gpu_uuid")
INSTANCE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*)(:\d+)?")
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class GatherError(RuntimeError):
    """Nothing could be gathered at all (Prometheus unreachable or no series of the job)."""


@dataclasses.dataclass
class Gathered:
    """The folder the fetched files went to, where each rank runs, and the ranks that gave no data."""

    directory: Path
    placement: dict[int, dict[str, Any]]
    no_data: dict[int, str]
    fetched_bytes: int = 0


def job_agents(prometheus_url: str, job: str, lookback_s: float, timeout: float) -> dict[int, str]:
    """Rank -> the agent host holding it, and the job's world size (as rank -1 -> ""), from Prometheus."""
    from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
    from urllib3.util.retry import Retry

    query = f'last_over_time(megatrace_tracer_rank_info{{job="{job}"}}[{max(60, int(lookback_s))}s])'
    try:
        prom = PrometheusConnect(
            url=prometheus_url, disable_ssl=True, timeout=timeout, retry=Retry(total=1, read=False)
        )
        series = prom.custom_query(query, params={"timeout": f"{max(1, int(timeout))}s"})
    except (PrometheusApiClientException, OSError, ValueError) as exc:
        raise GatherError(
            f"Prometheus could not be asked for the job's agents: {type(exc).__name__}"
        ) from None
    hosts: dict[int, str] = {}
    world = 0
    for sample in series:
        labels = sample.get("metric", {})
        match = INSTANCE.fullmatch(labels.get("instance", ""))
        rank = labels.get("rank", "")
        if match and rank.isdigit():
            hosts[int(rank)] = match.group(1)
        world = max(world, int(labels["world_size"]) if labels.get("world_size", "").isdigit() else 0)
    if not hosts:
        raise GatherError(f"Prometheus has no tracer series of job {job!r} (megatrace_tracer_rank_info)")
    for rank in range(min(world, 1 << 20)):
        hosts.setdefault(rank, "")
    return hosts


class AgentClient:
    """Requests to the agents' trace endpoints: bearer token, timeout, retries with backoff."""

    def __init__(self, cfg: AgentsConfig) -> None:
        self.cfg = cfg
        self.token = Path(cfg.token_file).read_text().strip() if cfg.token_file else ""
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers["Authorization"] = f"Bearer {self.token}"
            session.headers["Accept-Encoding"] = "gzip"
        return session

    def url(self, host: str, path: str) -> str:
        return f"{self.cfg.scheme}://{host}:{self.cfg.port}{path}"

    def get(self, host: str, path: str, params: dict[str, int] | None = None, to: Path | None = None) -> Any:
        """The JSON answer, or the body written to `to` (its size returned); RuntimeError saying why not."""
        reason = ""
        failures = 0
        # an agent answering 503 (all its slots busy) is waited for, within the time the tries would take
        deadline = time.monotonic() + self.cfg.timeout_s * (self.cfg.retries + 1)
        while failures <= self.cfg.retries and time.monotonic() < deadline:
            try:
                with self._session().get(
                    self.url(host, path), params=params, timeout=self.cfg.timeout_s, stream=to is not None
                ) as response:
                    if response.status_code == 503:
                        reason = "HTTP 503 (busy)"
                        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                        continue
                    if response.status_code in RETRY_STATUSES:
                        reason = f"HTTP {response.status_code}"
                    elif response.status_code != 200:
                        raise RuntimeError(f"HTTP {response.status_code}: {_error_text(response)}")
                    elif to is None:
                        return response.json()
                    else:
                        return _save(response, to)
            except (requests.ConnectionError, requests.Timeout) as exc:
                reason = "timed out" if isinstance(exc, requests.Timeout) else "connection refused or lost"
            except (requests.RequestException, ValueError) as exc:
                reason = f"bad answer ({type(exc).__name__})"
            failures += 1
            if failures <= self.cfg.retries:
                time.sleep(min(2.0, 0.2 * 2**failures))
        raise RuntimeError(f"{reason} after {failures} tries" if failures else reason)


def _error_text(response: requests.Response) -> str:
    try:
        return str(response.json().get("error", ""))[:200]
    except ValueError:
        return response.text[:200]


def _save(response: requests.Response, to: Path) -> int:
    size = 0
    tmp = to.with_name(f".{to.name}.part")
    with open(tmp, "wb") as out:
        for chunk in response.iter_content(chunk_size=1 << 20):
            out.write(chunk)
            size += len(chunk)
    tmp.replace(to)
    return size


def interleave(lists: list[list[Any]]) -> list[Any]:
    """One item of each list in turn: the fetches, in this order, spread over the agents at once instead
    of queueing at the first ones (an agent serves `trace_max_concurrent` requests at a time and
    answers the rest 503, to be tried again a second later)."""
    return [
        item for batch in itertools.zip_longest(*lists, fillvalue=_GAP) for item in batch if item is not _GAP
    ]


_GAP = object()


def gather(job: str, prometheus_url: str, cfg: AgentsConfig, directory: Path) -> Gathered:
    """Fetch the job's trace data from its agents into `directory`; GatherError when there is nothing
    to ask (no agent known)."""
    hosts = job_agents(prometheus_url, job, cfg.lookback_s, cfg.timeout_s)
    client = AgentClient(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    unknown = "no agent known (no tracer series of the rank in Prometheus)"
    no_data = {rank: unknown for rank, host in hosts.items() if not host}
    agents = sorted({h for h in hosts.values() if h})
    placement: dict[int, dict[str, Any]] = {}
    fetched = 0
    got: set[int] = set()
    lock = threading.Lock()

    def listing(host: str) -> tuple[str, dict[str, Any] | str]:
        try:
            return host, client.get(host, f"/v1/jobs/{job}")
        except RuntimeError as exc:
            return host, f"agent {host}:{cfg.port}: {exc}"

    def fetch(host: str, item: dict[str, Any]) -> None:
        nonlocal fetched
        rank = int(item["rank"])
        dumps = [str(name) for name in item.get("dumps", []) if DUMP_NAME.fullmatch(str(name))]
        try:
            size = 0
            if item.get("ring"):
                path = f"/v1/jobs/{job}/ranks/{rank}/ring"
                to = directory / f"rank-{rank}.trace"
                size += client.get(host, path, {"last": cfg.records_per_rank}, to)
            elif not dumps:
                raise RuntimeError("neither a ring file nor a stall dump")
            if dumps:
                # the newest stall dump says when the rank was seen stalled; its records only when no ring
                last = 0 if item.get("ring") else cfg.records_per_rank
                path = f"/v1/jobs/{job}/dumps/{dumps[-1]}"
                size += client.get(host, path, {"last": last}, directory / f"rank-{rank}.dump")
        except RuntimeError as exc:
            with lock:
                no_data[rank] = f"agent {host}:{cfg.port}: {exc}"
            return
        with lock:
            fetched += size
            got.add(rank)

    with ThreadPoolExecutor(max_workers=max(1, cfg.parallel), thread_name_prefix="gather") as pool:
        listings = dict(pool.map(listing, agents))
        per_agent: list[list[tuple[str, dict[str, Any]]]] = []
        for host, answer in listings.items():
            expected = {rank for rank, h in hosts.items() if h == host}
            if isinstance(answer, str):
                no_data.update(dict.fromkeys(expected, answer))
                continue
            node = str(answer.get("node", ""))
            held = set()
            per_agent.append([])
            for item in answer.get("ranks", []):
                rank = int(item["rank"])
                if rank not in hosts:
                    continue
                held.add(rank)
                placement[rank] = {"node": node, "agent": host} | {
                    k: item[k] for k in PLACEMENT_KEYS if k in item
                }
                per_agent[-1].append((host, item))
            for rank in expected - held:
                no_data[rank] = f"agent {host}:{cfg.port} has no files of the rank"
        jobs = [pool.submit(fetch, host, item) for host, item in interleave(per_agent)]
        for future in jobs:
            future.result()
    missing = {rank: why for rank, why in sorted(no_data.items()) if rank not in got}
    return Gathered(directory, placement, missing, fetched)
