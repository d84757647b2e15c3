"""Gathers a job's trace data from the node agents' trace endpoints, for the drill-down.

Which agents hold the job's ranks comes from `megatrace.alertbot.discovery` (Prometheus, else a static
or DNS fallback). Each agent is asked for the job's ranks on its node (with their node, pod, container
and GPU), then each rank's newest ``records_per_rank`` records as a ring file, and the header of its
newest stall dump (when the rank was seen stalled; the whole dump's newest records for a rank whose ring
is gone), in parallel (one rank of each agent in turn), each request with a connect timeout, a timeout
and a few retries, all within the gathering's deadline. What came back is written to a folder of ring
and dump files the analyzer reads as any trace folder; ranks whose agent is down, slow or missing them
are listed with the reason, and those whose data could not be collected (as opposed to an agent that
answered and has no files of them) are told apart, so that the analyzer does not blame them for it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from megatrace.alertbot.config import AgentsConfig
from megatrace.alertbot.discovery import Agent, Discovered, GatherError, discover
from megatrace.exporters.trace_store import DUMP_NAME, STACKS_NAME

log = logging.getLogger(__name__)

# Rank facts the agents report that name where a rank runs, as the verdict carries them.
PLACEMENT_KEYS = ("node", "host", "local_rank", "namespace", "pod", "container", "gpu", "gpu_uuid")
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclasses.dataclass
class Gathered:
    """The folder the fetched files went to, where each rank runs, the ranks that gave no data (and
    why), which of those could not be collected at all, and how the agents were found."""

    directory: Path
    placement: dict[int, dict[str, Any]]
    no_data: dict[int, str]
    fetched_bytes: int = 0
    uncollected: set[int] = dataclasses.field(default_factory=set)
    notes: list[str] = dataclasses.field(default_factory=list)


class NotHere(RuntimeError):
    """The agent answered 404: it has no files of what was asked."""


class AgentClient:
    """Requests to the agents' trace endpoints: bearer token, connect timeout and timeout, retries with
    backoff, and nothing past the gathering's `deadline` (time.monotonic())."""

    def __init__(self, cfg: AgentsConfig, deadline: float) -> None:
        self.cfg = cfg
        self.deadline = deadline
        self.token = Path(cfg.token_file).read_text().strip() if cfg.token_file else ""
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers["Authorization"] = f"Bearer {self.token}"
            session.headers["Accept-Encoding"] = "gzip"
        return session

    def url(self, agent: Agent, path: str) -> str:
        return f"{self.cfg.scheme}://{agent.address}:{agent.port}{path}"

    def get(
        self, agent: Agent, path: str, params: dict[str, int] | None = None, to: Path | None = None
    ) -> Any:
        """The JSON answer, or the body written to `to` (its size returned); NotHere for a 404,
        RuntimeError saying why not otherwise."""
        reason = f"not asked: the gathering's deadline ({self.cfg.deadline_s:g} s) had passed"
        failures = 0
        # an agent answering 503 (all its slots busy) is waited for, within the time the tries would take
        deadline = min(self.deadline, time.monotonic() + self.cfg.timeout_s * (self.cfg.retries + 1))
        while failures <= self.cfg.retries and (left := deadline - time.monotonic()) > 0:
            timeout = (min(self.cfg.connect_timeout_s, left), min(self.cfg.timeout_s, left))
            try:
                with self._session().get(
                    self.url(agent, path), params=params, timeout=timeout, stream=to is not None
                ) as response:
                    if response.status_code == 503:
                        reason = "HTTP 503 (busy)"
                        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                        continue
                    if response.status_code in RETRY_STATUSES:
                        reason = f"HTTP {response.status_code}"
                    elif response.status_code == 404:
                        raise NotHere(f"HTTP 404: {_error_text(response)}")
                    elif response.status_code != 200:
                        raise RuntimeError(f"HTTP {response.status_code}: {_error_text(response)}")
                    elif to is None:
                        return response.json()
                    else:
                        return _save(response, to)
            except requests.ConnectTimeout:
                reason = f"no connection within {timeout[0]:.3g} s (unreachable or partitioned)"
            except (requests.ConnectionError, requests.Timeout) as exc:
                reason = "timed out" if isinstance(exc, requests.Timeout) else "connection refused or lost"
            except (requests.RequestException, ValueError) as exc:
                reason = f"bad answer ({type(exc).__name__})"
            failures += 1
            if failures <= self.cfg.retries:
                time.sleep(min(2.0, 0.2 * 2**failures, max(0.0, deadline - time.monotonic())))
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
    """Fetch the job's trace data from its agents into `directory` within `cfg.deadline_s`;
    GatherError when there is nothing to ask (no agent known)."""
    deadline = time.monotonic() + cfg.deadline_s
    found = discover(prometheus_url, job, cfg)
    client = AgentClient(cfg, deadline)
    directory.mkdir(parents=True, exist_ok=True)
    unknown = "no agent known (no tracer series of the rank in Prometheus)"
    no_data = {rank: unknown for rank, agent in found.ranks.items() if agent is None}
    uncollected = set(no_data)
    placement: dict[int, dict[str, Any]] = {}
    fetched = 0
    got: set[int] = set()
    stack_notes: list[str] = []
    lock = threading.Lock()

    def listing(agent: Agent) -> tuple[Agent, dict[str, Any] | str]:
        try:
            return agent, client.get(agent, f"/v1/jobs/{job}")
        except NotHere:
            return agent, {"ranks": []}
        except RuntimeError as exc:
            return agent, f"{agent.describe()}: {exc}"

    def fetch(agent: Agent, item: dict[str, Any]) -> None:
        nonlocal fetched
        rank = int(item["rank"])
        dumps = [str(name) for name in item.get("dumps", []) if DUMP_NAME.fullmatch(str(name))]
        try:
            size = 0
            if item.get("ring"):
                path = f"/v1/jobs/{job}/ranks/{rank}/ring"
                to = directory / f"rank-{rank}.trace"
                size += client.get(agent, path, {"last": cfg.records_per_rank}, to)
            elif not dumps:
                raise RuntimeError("neither a ring file nor a stall dump")
            if dumps:
                # the newest stall dump says when the rank was seen stalled; its records only when no ring
                last = 0 if item.get("ring") else cfg.records_per_rank
                path = f"/v1/jobs/{job}/dumps/{dumps[-1]}"
                size += client.get(agent, path, {"last": last}, directory / f"rank-{rank}.dump")
        except RuntimeError as exc:
            with lock:
                no_data[rank] = f"{agent.describe()}: {exc}"
                uncollected.add(rank)
            return
        size += fetch_stacks(agent, item)
        with lock:
            fetched += size
            got.add(rank)

    def fetch_stacks(agent: Agent, item: dict[str, Any]) -> int:
        """The rank's newest stacks file (its threads' stacks when its watchdog could not run):
        optional, so a failure is a note, not a rank without data."""
        stacks = [str(name) for name in item.get("stacks", []) if STACKS_NAME.fullmatch(str(name))]
        if not stacks:
            return 0
        rank = int(item["rank"])
        try:
            return client.get(
                agent, f"/v1/jobs/{job}/stacks/{stacks[-1]}", None, directory / f"rank-{rank}.stacks"
            )
        except RuntimeError as exc:
            with lock:
                stack_notes.append(
                    f"rank {rank}: stacks file {stacks[-1]} not fetched from {agent.describe()}: {exc}"
                )
            return 0

    with ThreadPoolExecutor(max_workers=max(1, cfg.parallel), thread_name_prefix="gather") as pool:
        listings = dict(pool.map(listing, found.agents))
        per_agent = _place(found, listings, placement, no_data, uncollected)
        jobs = [pool.submit(fetch, agent, item) for agent, item in interleave(per_agent)]
        for future in jobs:
            future.result()
    missing = {rank: why for rank, why in sorted(no_data.items()) if rank not in got}
    notes = ([found.note] if found.note else []) + sorted(stack_notes)
    return Gathered(directory, placement, missing, fetched, uncollected - got, notes)


def _place(
    found: Discovered,
    listings: dict[Agent, dict[str, Any] | str],
    placement: dict[int, dict[str, Any]],
    no_data: dict[int, str],
    uncollected: set[int],
) -> list[list[tuple[Agent, dict[str, Any]]]]:
    """Each agent's ranks to fetch, from its listing: placement filled in, and the ranks no answer
    covers put in `no_data` (in `uncollected` too where an agent that did not answer may hold them)."""
    per_agent: list[list[tuple[Agent, dict[str, Any]]]] = []
    failed = [answer for answer in listings.values() if isinstance(answer, str)]
    unanswered = "; ".join(failed[:3]) + (f"; and {len(failed) - 3} more" if len(failed) > 3 else "")
    world = 0
    by_agent: dict[Agent, set[int]] = {}
    for rank, holder in found.ranks.items():
        if holder is not None:
            by_agent.setdefault(holder, set()).add(rank)
    for agent, answer in listings.items():
        expected = by_agent.get(agent, set())
        if isinstance(answer, str):
            no_data.update(dict.fromkeys(expected, answer))
            uncollected.update(expected)
            continue
        node = str(answer.get("node", "")) or agent.name
        held = set()
        per_agent.append([])
        for item in answer.get("ranks", []):
            rank = int(item["rank"])
            if rank in placement or (found.ranks and rank not in found.ranks):
                continue
            world = max(world, int(item.get("world_size") or 0))
            held.add(rank)
            placement[rank] = {"node": node, "agent": agent.instance or node} | {
                k: item[k] for k in PLACEMENT_KEYS if k in item
            }
            per_agent[-1].append((agent, item))
        for rank in expected - held:
            no_data[rank] = f"{agent.describe()} has no files of the rank"
    if not found.ranks:  # found through the fallback: the ranks no agent that answered holds
        for rank in set(range(min(world, 1 << 20))) - set(placement):
            if failed:
                no_data[rank] = f"on none of the agents that answered; these did not: {unanswered}"
                uncollected.add(rank)
            else:
                no_data[rank] = "no agent has files of the rank"
        if failed and not placement:
            raise GatherError(f"no agent answered: {unanswered}")
    return per_agent
