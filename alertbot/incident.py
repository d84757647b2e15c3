"""What an incident says. A job's hang or slow alerts at one level form one incident, shown as one
card that names the culprit — from the alert's labels (``culprit_rank``, ``culprit_node``,
``culprit_seen``) where the rules could tell, else from the drill-down's verdict — what was seen, in
one plain sentence, and what to do first."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any

from megatrace.alertbot.kinds import IncidentKind
from megatrace.alertbot.store import Store

UNKNOWN = ("", "unknown")
SLOW_ALERTS = frozenset({"MegatraceSlowRank"})
SEEN = {
    "dead": "Rank {rank} stopped: its process is gone or no longer reports, and the other ranks wait for it.",
    "lagging": "Rank {rank} fell behind: the other ranks are ahead and wait for it.",
    "awaited": "The other ranks wait for rank {rank} in a collective it has not joined.",
    "slow": "Rank {rank} takes longer per step than the others, and they wait for it every step.",
    "lost": "Node {node} is lost: its agent stopped answering, and rank {rank} with the node's other ranks "
    "no longer reports while the rest of the job waits.",
}


@dataclasses.dataclass
class Culprit:
    """The rank an incident is about: where it runs (`node` as operators name it, `where` for pod,
    GPU and local rank), how it was seen and, from the analyzer, its confidence."""

    rank: str
    node: str = ""
    seen: str = ""
    sentence: str = ""
    confidence: float | None = None
    where: str = ""
    # `node` is only the host part of an exporter's scrape address: a node name found elsewhere wins.
    node_is_address: bool = False
    # the analyzer could not tell these ranks apart (`rank` is the first of them), and why
    tied: tuple[str, ...] = ()
    tie_reason: str = ""

    @property
    def named(self) -> str:
        """ "rank 3", or for tied ranks "rank 3 or rank 7"."""
        return " or ".join(f"rank {r}" for r in self.tied or (self.rank,))


@dataclasses.dataclass
class Incident:
    """An incident as its card shows it."""

    job: str
    level: str
    kind: IncidentKind
    closed: bool
    ended: float | None
    culprit: Culprit | None
    verdict: dict[str, Any]  # the drill-down's report ({} until it answered)
    others: list[int]  # ranks the member alerts name besides the culprit
    # The known pause a member alert fired in (``pause`` label: checkpoint, eval, dataloader) and the
    # rank in it; "" when none did.
    pause: str = ""
    pause_rank: str = ""


def known(value: Any) -> str:
    text = str(value if value is not None else "").strip()
    return "" if text in UNKNOWN else text


def node_of(labels: dict[str, str]) -> str:
    """The node an alert is about, as operators name it: `node`, `hostname` or the host of `instance`."""
    for key in ("node", "hostname"):
        if labels.get(key):
            return labels[key]
    instance = labels.get("instance", "")
    return instance.rsplit(":", 1)[0] if instance.count(":") == 1 else instance


def from_labels(alertname: str, labels: dict[str, str]) -> Culprit | None:
    """The culprit the rules named (None when they could not tell): a hang's ``culprit_*`` labels, a
    slow-rank alert's own rank."""
    if alertname in SLOW_ALERTS and known(labels.get("rank")):
        rank = labels["rank"]
        named = labels.get("node") or labels.get("hostname")
        return Culprit(
            rank, node_of(labels), "slow", SEEN["slow"].format(rank=rank), node_is_address=not named
        )
    rank = known(labels.get("culprit_rank"))
    if not rank:
        return None
    seen = known(labels.get("culprit_seen"))
    node = known(labels.get("culprit_node"))
    sentence = SEEN[seen].format(rank=rank, node=node or "?") if seen in SEEN else ""
    return Culprit(rank, node, seen, sentence)


def from_verdict(report: dict[str, Any], where: str = "") -> Culprit | None:
    """The analyzer's first suspect (None when it failed, found nothing, or is still running); where
    the analyzer reports suspects tied (it could not tell them apart), all of them, without a
    confidence, and the reason."""
    suspects = [s for s in report.get("suspects", []) if isinstance(s, dict) and "rank" in s]
    if report.get("error") or report.get("verdict") == "healthy" or not suspects:
        return None
    first = suspects[0]
    tie = report.get("tie") if isinstance(report.get("tie"), dict) else None
    if first.get("tied") and tie:
        tied = [s for s in suspects if s.get("tied")]
        nodes = {known(s.get("node") or s.get("host")) for s in tied}
        return Culprit(
            str(first["rank"]), nodes.pop() if len(nodes) == 1 else "", str(first.get("kind", "")),
            str(first.get("evidence", "")), None, where, tied=tuple(str(s["rank"]) for s in tied),
            tie_reason=str(tie.get("reason", "")),
        )  # fmt: skip
    confidence = first.get("confidence")
    return Culprit(
        str(first["rank"]),
        known(first.get("node") or first.get("host")),
        str(first.get("kind", "")),
        str(first.get("evidence", "")),
        float(confidence) if isinstance(confidence, int | float) else None,
        where,
    )


def culprit_of(
    alerts: Iterable[tuple[str, dict[str, str]]], report: dict[str, Any], where: str = ""
) -> Culprit | None:
    """The rules' culprit when any member alert (name, labels) names one, completed by the analyzer's
    evidence when it names the same rank; else the analyzer's."""
    by_rules = next((c for c in (from_labels(*alert) for alert in alerts) if c is not None), None)
    by_analyzer = from_verdict(report, where)
    if by_rules is None:
        return by_analyzer
    if by_analyzer is not None and by_analyzer.rank == by_rules.rank:
        address = by_rules.node_is_address or not by_rules.node
        return dataclasses.replace(
            by_analyzer,
            node=by_analyzer.node if address and by_analyzer.node else by_rules.node,
            seen=by_rules.seen or by_analyzer.seen,
            sentence=by_analyzer.sentence or by_rules.sentence,
        )
    return by_rules


def load(
    store: Store, incident_id: int, placement: Callable[[dict[str, Any]], str] | None = None
) -> Incident | None:
    """The incident as its card shows it; `placement(suspect) -> str` describes where a suspect runs."""
    row = store.incidents.get(incident_id)
    if row is None:
        return None
    members = store.incidents.members(incident_id)
    labels = [m.labels for m in members]
    report = json.loads(row.verdict) if row.verdict else {}
    suspects = [s for s in report.get("suspects", []) if isinstance(s, dict)]
    where = placement(suspects[0]) if placement and suspects else ""
    culprit = culprit_of(zip((m.alertname for m in members), labels, strict=True), report, where)
    ranks = {int(lab["rank"]) for lab in labels if str(lab.get("rank", "")).isdigit()}
    named = set(culprit.tied or (culprit.rank,)) if culprit else set()
    others = sorted(r for r in ranks if str(r) not in named)
    slow = all(m.alertname in SLOW_ALERTS for m in members)
    ends = [m.ends_at for m in members if m.ends_at is not None]
    closed = row.closed_at is not None
    kind = IncidentKind.SLOW if slow else IncidentKind.HANG
    ended = max(ends) if closed and ends else None
    paused = next((lab for lab in labels if lab.get("pause")), {})
    pause, pause_rank = paused.get("pause", ""), paused.get("pause_rank", "")
    return Incident(row.job, row.level, kind, closed, ended, culprit, report, others, pause, pause_rank)


def headline(incident: Incident) -> str:
    """Who and what, for the card's title: "rank 3 hung on gpu-7 — job llm"."""
    verb = "is slow" if incident.kind == IncidentKind.SLOW else "hung"
    culprit = incident.culprit
    if culprit is None:
        what = "has a slow rank" if incident.kind == IncidentKind.SLOW else "hangs"
        return f"job {incident.job} {what} — culprit not known yet"
    where = f" on {culprit.node}" if culprit.node else ""
    return f"{culprit.named} {verb}{where} — job {incident.job}"


# What to do first when a hang fired during a known pause: the pause itself is what is stuck.
PAUSE_STEPS = {
    "checkpoint": "Check the storage {rank} writes its checkpoint to (a hung mount, a full disk, a lock); "
    "the other ranks of job {job} wait for it.",
    "eval": "Check {rank}'s evaluation pass (its data, a deadlock outside collectives); the other ranks of "
    "job {job} wait for it.",
    "dataloader": "Check {rank}'s data loader (its storage, its worker processes); the other ranks of job "
    "{job} wait for it.",
}


# What to do first for each cause class the drill-down names (`why.class`; docs/analyzer.md).
CAUSE_STEPS = {
    "gpu": "Check the GPU of {rank} on {node} (the clock event or XID in the hints); if it is faulty, drain "
    "the node and restart job {job} from its last checkpoint.",
    "network": "Check the InfiniBand/RoCE ports of {node} (the error counters in the hints); if a link is "
    "bad, drain the node and restart job {job} from its last checkpoint.",
    "cpu_contention": "Find what else runs on the CPUs of {rank} on {node} (another process or pod takes "
    "them); move it away or give the rank its own cores.",
    "cpu_quota": "Raise or remove the CPU limit of {rank}'s container: its cgroup's quota throttles it, and "
    "the other ranks of job {job} wait for it.",
    "memory_pressure": "Raise the memory limit of {rank}'s container or cut its host memory use (data-loader "
    "workers, pinned buffers): it is at its limit and pages.",
    "io_stall": "Check the storage {rank} reads on {node} (a slow or throttled disk, a hung mount): its main "
    "thread waits on I/O.",
    "dataloader": "Speed up {rank}'s data loading (more DataLoader workers, faster preprocessing or "
    "storage): the other ranks of job {job} wait for its batches.",
    "gc": "Cut {rank}'s garbage-collection pauses (reference cycles built each step; `gc.freeze()` after "
    "setup): they stall its training loop.",
    "python": "Look at what {rank} is doing {where}: a lock, a file or a blocking call outside any "
    "collective; the other ranks of job {job} wait for it.",
}


def cause_of(incident: Incident) -> dict[str, Any] | None:
    """The drill-down's cause class (`why`) when it is about the card's culprit and names a class."""
    why = incident.verdict.get("why")
    culprit = incident.culprit
    if not isinstance(why, dict) or culprit is None or why.get("class") not in CAUSE_STEPS:
        return None
    return why if str(why.get("rank")) == culprit.rank else None


CAUSE_NAMES = {
    "gpu": "GPU",
    "network": "network",
    "cpu_contention": "host CPU contention",
    "cpu_quota": "CPU quota",
    "memory_pressure": "memory pressure",
    "io_stall": "I/O stall",
    "dataloader": "data loader",
    "gc": "garbage collection",
    "python": "stuck in Python",
}


def cause_text(incident: Incident) -> str:
    """The card's "Why" line: the class and its evidence, or where a rank stuck in Python is ("" when
    no class is named)."""
    why = cause_of(incident)
    if why is None:
        return ""
    name = CAUSE_NAMES[str(why["class"])]
    if why.get("where"):
        return f"{name}: rank {why['rank']} is {why['where']}"
    return f"{name}: {why.get('evidence', '')}"


def next_step(incident: Incident) -> str:
    """What the person on call does first."""
    culprit, job = incident.culprit, incident.job
    node = culprit.node if culprit and culprit.node else ""
    why = cause_of(incident)
    if why is not None and culprit is not None:
        return CAUSE_STEPS[str(why["class"])].format(
            rank=f"rank {culprit.rank}",
            node=f"node {node}" if node else "its node",
            job=job,
            where=why.get("where") or "where it is stuck",
        )
    if incident.kind == IncidentKind.SLOW:
        target = f"node {node}" if node else "the slow rank's node"
        return (
            f"Check {target} (GPU clocks, XID errors, IB links); if its hardware is at fault, drain it "
            f"and restart job {job} from its last checkpoint."
        )
    if incident.pause in PAUSE_STEPS:
        rank = f"rank {incident.pause_rank}" if incident.pause_rank else "the paused rank"
        return PAUSE_STEPS[incident.pause].format(rank=rank, job=job)
    if node:
        return f"Drain node {node}, then restart job {job} from its last checkpoint."
    return (
        f"Find the hung rank (`megatrace analyze` on job {job}'s traces), drain its node, then restart "
        "the job from its last checkpoint."
    )


def pending_text(incident: Incident) -> str:
    """What the card says while no culprit is named."""
    if incident.verdict.get("error"):
        return f"not named: the drill-down failed ({incident.verdict['error']})"
    if incident.verdict.get("verdict") == "healthy":
        return "not named: the analyzer found no hung or slow rank in the trace data"
    if incident.verdict.get("verdict") in ("inconclusive", "no-data"):
        return "not named: the trace data the drill-down could collect allows no safe call"
    return "not known yet; the drill-down's verdict follows"
