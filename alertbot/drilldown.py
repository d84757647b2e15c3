"""Drill-down for hang and slow-rank alerts: run the analyzer on the job's trace data and ask
Prometheus about the suspect's node. The verdict goes into the incident's card: the first card waits
for it a bounded time (`drilldown.verdict_wait_s`), a card already out is updated. The data comes, as
``drilldown.source`` says, from the job's folder under the configured roots on this machine, or from
the node agents holding its ranks (`megatrace.alertbot.gather`); either way each suspect is named by
node, host, local rank, GPU and (from the agents) pod and container."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megatrace.alertbot.config import DrilldownConfig
from megatrace.alertbot.gather import Gathered, GatherError, gather
from megatrace.alertbot.kinds import DrilldownState
from megatrace.alertbot.metrics import BotMetrics
from megatrace.alertbot.node_findings import cause_from_nodes, node_findings
from megatrace.alertbot.pipeline import Pipeline
from megatrace.analyzer.uncollected import format_ranks
from megatrace.exporters.trace_store import JOB_NAME
from megatrace.tracer.ringfile import RingFormatError, read_header

log = logging.getLogger(__name__)


def resolve_trace_dir(roots: list[str], job: str) -> Path | None:
    """`<root>/<job>` for the first root holding it, only if it stays inside that root (a job label
    with separators or dots-only, or a symlink leading out of the root, is refused)."""
    if not JOB_NAME.fullmatch(job) or job in (".", ".."):
        return None
    for root in roots:
        base = Path(root).resolve()
        candidate = base / job
        if not candidate.is_dir():
            continue
        resolved = candidate.resolve()
        if resolved.parent == base or (resolved.is_relative_to(base) and resolved != base):
            return resolved
        log.warning("trace directory for job %r leaves the root %s; refused", job, base)
    return None


def analyzer_argv(command: list[str], directory: Path, uncollected: set[int] | None = None) -> list[str]:
    """The analyzer's command line for `directory`, naming the ranks whose data was not collected."""
    base = command or [sys.executable, "-m", "megatrace.cli", "analyze"]
    extra = ["--uncollected-ranks", format_ranks(uncollected)] if uncollected else []
    return [*base, str(directory), "--format", "json", "--quiet", *extra]


def run_analyzer(
    command: list[str], directory: Path, timeout: float, uncollected: set[int] | None = None
) -> dict[str, Any]:
    """The analyzer's JSON report for `directory` (`uncollected`: ranks whose data could not be
    collected, never blamed for missing it), or ``{"error": ...}``."""
    try:
        done = subprocess.run(
            analyzer_argv(command, directory, uncollected),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the analyzer took longer than {timeout:.0f}s"}
    except OSError as exc:
        return {"error": f"cannot run the analyzer: {exc.strerror or exc}"}
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"analyzer exit {done.returncode}: {tail[0][:300]}"}
    if (
        not isinstance(report, dict)
        or "verdict" not in report
        or not isinstance(report.get("suspects"), list)
    ):
        return {"error": "the analyzer's report has no verdict/suspects"}
    return report


def from_directory(cfg: DrilldownConfig, job: str, _scratch: Path) -> Gathered | str:
    """The job's folder under the configured roots, its ranks placed from their ring headers."""
    directory = resolve_trace_dir(cfg.trace_roots, job)
    if directory is None:
        return f"no trace directory for job {job!r} under the configured trace roots"
    placement: dict[int, dict[str, Any]] = {}
    for path in sorted(directory.glob("rank-*.trace")):
        try:
            header = read_header(path)
        except RingFormatError:
            continue
        placement[header.rank] = {
            "node": header.host,
            "host": header.host,
            "local_rank": header.local_rank,
            "gpu": header.cuda_device,
            "gpu_uuid": header.device_uuid,
        }
    return Gathered(directory, placement, {})


def from_agents(cfg: DrilldownConfig, job: str, scratch: Path) -> Gathered | str:
    """The job's windows fetched from the node agents holding its ranks into `scratch`."""
    if not JOB_NAME.fullmatch(job):
        return f"{job[:80]!r} is not a job name the agents serve"
    try:
        return gather(job, cfg.prometheus_url, cfg.agents, scratch / job)
    except (GatherError, OSError) as exc:
        return f"the job's trace data could not be gathered: {exc}"


# drilldown.source -> where the analyzer's input comes from.
SOURCES: dict[str, Callable[[DrilldownConfig, str, Path], Gathered | str]] = {
    "directory": from_directory,
    "agents": from_agents,
}


def name_suspects(report: dict[str, Any], placement: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The report with each suspect's node, pod, container and GPU (where known) beside its rank."""
    suspects = []
    for suspect in report.get("suspects", []):
        rank = suspect.get("rank") if isinstance(suspect, dict) else None
        where = placement.get(rank, {}) if isinstance(rank, int) else {}
        known = {key: value for key, value in where.items() if value not in ("", None, -1)}
        suspects.append({**known, **suspect} if isinstance(suspect, dict) else suspect)
    return report | {"suspects": suspects} if "suspects" in report else report


def no_data_summary(no_data: dict[int, str]) -> list[dict[str, Any]]:
    """Ranks that gave no data, grouped by why: [{"reason", "ranks"}], most ranks first."""
    by_reason: dict[str, list[int]] = {}
    for rank, reason in sorted(no_data.items()):
        by_reason.setdefault(reason, []).append(rank)
    return [
        {"reason": reason, "ranks": ranks}
        for reason, ranks in sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[0]))
    ]


class DrilldownRunner:
    """Runs stored drill-down requests in worker threads and puts each verdict on its incident's card."""

    def __init__(
        self,
        pipeline: Pipeline,
        cfg: DrilldownConfig,
        metrics: BotMetrics,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.wake = wake
        self.pipeline = pipeline
        self.store = pipeline.store
        self.cfg = cfg
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=max(1, cfg.workers), thread_name_prefix="drilldown")
        self._running: set[int] = set()
        self._lock = threading.Lock()

    def submit_pending(self) -> None:
        for row in self.store.incidents.pending_drilldowns():
            with self._lock:
                if row.id in self._running:
                    continue
                self._running.add(row.id)
            self.store.incidents.update_drilldown(row.id, state=DrilldownState.RUNNING)
            self.executor.submit(self.run, row.id)

    def investigate(self, job: str) -> dict[str, Any]:
        work_dir = self.cfg.agents.work_dir or None
        with tempfile.TemporaryDirectory(prefix="megatrace-drilldown-", dir=work_dir) as scratch:
            found = SOURCES[self.cfg.source](self.cfg, job, Path(scratch))
            if isinstance(found, str):
                return {"error": found}
            report = run_analyzer(
                self.cfg.analyzer_command, found.directory, self.cfg.timeout_s, found.uncollected
            )
        report = name_suspects(report, found.placement)
        if found.no_data:
            report["no_data"] = no_data_summary(found.no_data)
        if found.notes:
            report["gather_notes"] = found.notes
        return report | {"hints": self.node_hints(report, found.placement)}

    def node_hints(self, report: dict[str, Any], placement: dict[int, dict[str, Any]]) -> list[str]:
        """The card's hints about the first two suspects' nodes; where the analyzer named no host cause
        (`why` unknown), also the GPU or network class when the culprit's GPU or node stands out."""
        suspects = [s for s in report.get("suspects", [])[:2] if isinstance(s, dict)]
        hosts = [str(s.get("agent") or s.get("host")) for s in suspects if s.get("agent") or s.get("host")]
        why = report.get("why")
        unexplained = isinstance(why, dict) and why.get("class") == "unknown" and suspects
        peer_hosts = [str(p.get("agent") or p.get("host") or "") for p in placement.values()]
        findings, error = node_findings(
            self.cfg.prometheus_url,
            [host for host in hosts + (peer_hosts if unexplained else []) if host],
            self.cfg.hint_lookback_s,
            connect_timeout=self.cfg.agents.connect_timeout_s,
        )
        if unexplained and isinstance(why, dict):
            culprit = {**suspects[0], "host": hosts[0] if hosts else ""}
            peers = [
                {**p, "host": p.get("agent") or p.get("host")}
                for rank, p in placement.items()
                if rank != suspects[0].get("rank")
            ]
            named = cause_from_nodes(culprit, peers, findings)
            if named is not None:
                why.update(named)
        hints = [f.text for host in sorted(set(hosts)) for f in findings if f.host == host]
        return hints + ([error] if error else [])

    def run(self, drilldown_id: int) -> None:
        try:
            row = self.store.incidents.drilldown(drilldown_id)
            if row is None:  # purged meanwhile
                return
            try:
                result = self.investigate(row.job)
            except Exception as exc:  # still tell the group, so the alert is not left without an answer
                log.exception("drill-down %s crashed", drilldown_id)
                result = {
                    "error": f"the drill-down crashed ({type(exc).__name__}); the bot's log has the details"
                }
            self.metrics.drilldowns.labels("error" if "error" in result else "done").inc()
            episode = self.store.episodes.get(row.episode_id)
            now = time.time()
            with self.store.transaction():
                self.store.incidents.update_drilldown(
                    drilldown_id, state=DrilldownState.DONE, result=json.dumps(result), finished_at=now
                )
                if episode is not None and episode.incident_id is not None:
                    self.store.incidents.update(
                        episode.incident_id, verdict=json.dumps(result), verdict_at=now
                    )
                    self.pipeline.incident_changed(episode.incident_id, now, f"verdict@{drilldown_id}")
        except Exception:
            log.exception("drill-down %s failed", drilldown_id)
            self.metrics.drilldowns.labels("crashed").inc()
            self.store.incidents.update_drilldown(
                drilldown_id, state=DrilldownState.FAILED, finished_at=time.time()
            )
        finally:
            with self._lock:
                self._running.discard(drilldown_id)
            self.wake()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
