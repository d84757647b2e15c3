"""Reports: the JSON contract (`verdict`, `suspects`, …), terminal text, a Chrome-trace/Perfetto timeline."""

from __future__ import annotations

import json

import numpy as np

from megatrace.analyzer.hang import HangResult
from megatrace.analyzer.layout import Layout
from megatrace.analyzer.loader import LoadReport
from megatrace.analyzer.quiet import ended_together
from megatrace.analyzer.slow import SlowResult
from megatrace.analyzer.table import TraceTable
from megatrace.tracer.format import op_name

CHROME_MAX_EVENTS_PER_RANK = 2000


def analysis_report(
    table: TraceTable, load: LoadReport, hang: HangResult, slow: SlowResult, layout: Layout | None
) -> dict:
    """The analyzer's JSON report (the contract of ``megatrace analyze --format json``) of one job's
    table, from the hang and slow detectors' results."""
    suspects = []
    hangs = hang.suspects
    notes = [*table.notes, *hang.notes, *slow.notes]
    if hangs and all(s.tentative for s in hangs) and slow.suspects:
        notes += [f"not called a hang: rank {s.rank}: {s.evidence}" for s in hangs]
        hangs = []
    for s in hangs:
        suspects.append(
            {
                "rank": s.rank,
                "kind": "hang",
                "confidence": s.confidence,
                "evidence": s.evidence,
                "cause": s.cause,
            }
        )
        if s.group:
            suspects[-1]["communicator"] = list(s.group)
        if s.tied:
            suspects[-1]["tied"] = True
    if not suspects:
        for s in slow.suspects:
            entry = {"rank": s.rank, "kind": "slow", "confidence": s.confidence, "evidence": s.evidence}
            entry["slowdown_estimate"] = round(s.relative, 4)
            if s.test is not None:
                entry.update(s.test.as_dict(slow.tests))
            suspects.append(entry)
    for entry in suspects:
        rank = entry["rank"]
        info = table.ranks.get(rank)
        if info is not None and info.host:  # only hosts the logs name: never one made up from a rank number
            entry["host"] = info.host
        if layout is not None and rank < layout.world_size:
            entry["position"] = layout.describe(rank)
            entry["coords"] = layout.coords(rank)
    verdict = "hang" if hangs else ("slow" if suspects else "healthy")
    tie = {"ranks": [s.rank for s in hangs if s.tied], "reason": hang.tie} if hangs and hang.tie else None
    if hang.tie and not tie:
        notes.append(hang.tie)
    if not table.ranks:
        verdict = "no-data"
        notes.append("no readable trace file: nothing to judge (see inputs.ignored for what was skipped)")
    elif verdict == "healthy" and hang.blocked_at:
        verdict = "inconclusive"
        stuck = sorted(hang.blocked_at)
        notes.append(
            f"rank(s) {_short_list(stuck)} are stuck in calls that never completed, but the logs do not "
            "show which rank they wait for"
        )
    elif verdict == "healthy" and (together := ended_together(table, hang.silent)):
        notes.append(together)
    elif verdict == "healthy" and len(hang.silent) * 2 >= len(table.ranks):
        verdict = "inconclusive"
        quiet = sorted(hang.silent)
        notes.append(
            f"rank(s) {_short_list(quiet)} made no traced call for {min(hang.silent.values()):.0f} s or more "
            "before their traces end, with no call open: they wait where the traces do not show (a call "
            "the trace format does not record, or compute)"
        )
    return {
        "verdict": verdict,
        "suspects": suspects,
        "victims": hang.victims if hangs else [],
        "tie": tie,
        "world_size": table.world_size,
        "ranks_with_logs": len(table.ranks),
        "records": len(table),
        "communicators": len(table.comms),
        "clock_offsets_ms": {h: round(v / 1e6, 3) for h, v in sorted(slow.skew_ns.items())},
        "slow_test": slow.test_summary(),
        "notes": notes,
        "inputs": load.as_dict(),
        "layout": None
        if layout is None
        else {"world_size": layout.world_size, **layout.sizes, "order": "-".join(layout.order)},
    }


SEVERITY = {"hang": 4, "slow": 3, "inconclusive": 2, "no-data": 1, "healthy": 0}


def combine_jobs(reports: list[tuple[str, dict]]) -> dict:
    """One report for several jobs: the most serious verdict, every job's suspects (naming the job),
    and each job's own report under ``jobs``."""
    verdict = max((r["verdict"] for _job, r in reports), key=SEVERITY.__getitem__)
    suspects = [{**s, "job": job} for job, r in reports for s in r["suspects"]]
    suspects.sort(key=lambda s: -SEVERITY[s["kind"]])
    return {
        "verdict": verdict,
        "suspects": suspects,
        "victims": [],
        "notes": [f"traces of {len(reports)} jobs found; each was analyzed on its own: see jobs"],
        "jobs": {job: r for job, r in reports},
        "inputs": reports[0][1]["inputs"],
    }


def _short_list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def render_text(report: dict) -> str:
    if "jobs" in report:
        parts = [
            f"{len(report['jobs'])} jobs found, each analyzed on its own; most serious: {report['verdict']}"
        ]
        parts += [f"\n== job {job or '(unnamed)'} ==\n{render_text(r)}" for job, r in report["jobs"].items()]
        return "\n".join(parts)
    verdict = report["verdict"]
    suspects = report["suspects"]
    if verdict == "healthy":
        head = f"HEALTHY: no hung or slow rank found in {report['ranks_with_logs']} rank log(s)."
    elif verdict == "no-data":
        head = f"NO DATA: {report['notes'][-1] if report['notes'] else 'no readable trace file'}."
    elif verdict == "inconclusive":
        head = f"INCONCLUSIVE: {report['notes'][-1]}."
    elif report.get("tie"):
        tied = " or ".join(f"rank {r}" for r in report["tie"]["ranks"])
        head = f"{verdict.upper()}: {tied} (tied) — {report['tie']['reason']}"
    else:
        top = suspects[0]
        where = f" on {top['host']}" if top.get("host") else ""
        head = f"{verdict.upper()}: rank {top['rank']}{where} — {top['evidence']}"
    lines = [head, ""]
    if report.get("why"):
        why = report["why"]
        where = f" — {why['where']}" if why.get("where") else ""
        lines += [f"why: {why['class']}{where} — {why['evidence']}", ""]
    if suspects:
        lines.append(f"{'rank':>6}  {'kind':<5} {'conf':>5}  {'host':<16} {'position':<28} evidence")
        for s in suspects:
            lines.append(
                f"{s['rank']:>6}  {s['kind']:<5} {s['confidence']:>5.2f}  {s.get('host', ''):<16} "
                f"{s.get('position', ''):<28} {s['evidence']}"
            )
        lines.append("")
    if report.get("victims"):
        v = report["victims"]
        lines.append(
            f"victims (blocked behind the suspects): {len(v)} rank(s): {v[:32]}{' …' if len(v) > 32 else ''}"
        )
    skew = {h: o for h, o in report["clock_offsets_ms"].items() if abs(o) >= 0.5}
    if skew:
        lines.append("clock offsets removed (ms): " + ", ".join(f"{h} {o:+.1f}" for h, o in skew.items()))
    inputs = report["inputs"]
    read = (
        ", ".join(f"{count} {fmt} file(s)" for fmt, count in inputs["files_by_format"].items()) or "nothing"
    )
    lines.append(f"read: {read} — {report['records']} calls, {report['communicators']} communicators")
    if report.get("layout_inferred") and report.get("layout") is None:
        lay = report["layout_inferred"]
        lines.append(f"layout read from the traces: tp {lay['tp']}, dp {lay['dp']}, pp {lay['pp']}")
    for path, count in inputs["lines_skipped"].items():
        lines.append(f"skipped {count} malformed line(s) in {path}")
    if inputs["duplicates_dropped"]:
        lines.append(
            f"dropped {inputs['duplicates_dropped']} duplicate record(s) from overlapping save batches"
        )
    for path, why in inputs["ignored"].items():
        lines.append(f"ignored {path}: {why}")
    lines.extend(f"note: {note}" for note in report["notes"])
    return "\n".join(lines) + "\n"


def chrome_trace(table: TraceTable, report: dict) -> dict:
    """All ranks' calls as complete events (pid = host, tid = rank); suspects marked in names and args."""
    suspects = {s["rank"]: s for s in report["suspects"]}
    events: list[dict] = []
    cols = table.columns
    if not len(table):
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = int(cols["enqueue_ns"].min())
    tend = int(max(cols["enqueue_ns"].max(), cols["complete_ns"].max()))
    hosts = sorted({(info.host or f"ranks {r // 8 * 8}-{r // 8 * 8 + 7}") for r, info in table.ranks.items()})
    pid_of = {h: i + 1 for i, h in enumerate(hosts)}
    for h, pid in pid_of.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": h}})
    for rank in sorted(table.ranks):
        info = table.ranks[rank]
        pid = pid_of[info.host or f"ranks {rank // 8 * 8}-{rank // 8 * 8 + 7}"]
        mark = suspects.get(rank)
        label = f"rank {rank}" + (f" [SUSPECT {mark['kind']}]" if mark else "")
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank, "args": {"name": label}})
        lo, hi = table.rank_span(rank)
        lo = max(lo, hi - CHROME_MAX_EVENTS_PER_RANK)
        enq = cols["enqueue_ns"][lo:hi]
        done = cols["complete_ns"][lo:hi]
        nxt = np.append(enq[1:], enq[-1] if len(enq) else 0)
        end = np.where(done > 0, done, np.where(np.arange(len(enq)) < len(enq) - 1, nxt, tend))
        for i in range(hi - lo):
            row = lo + i
            name = op_name(int(cols["op"][row]))
            events.append(
                {
                    "name": name + ("" if done[i] > 0 or not info.has_completion else " (never completed)"),
                    "cat": table.comms[int(cols["comm"][row])].key,
                    "ph": "X",
                    "ts": (int(enq[i]) - t0) / 1000.0,
                    "dur": max(int(end[i]) - int(enq[i]), 0) / 1000.0,
                    "pid": pid,
                    "tid": rank,
                    "args": {"seq": int(cols["seq"][row]), "bytes": int(cols["nbytes"][row])},
                }
            )
        if mark:
            events.append(
                {
                    "name": f"suspect: {mark['kind']}",
                    "ph": "i",
                    "s": "t",
                    "ts": (tend - t0) / 1000.0,
                    "pid": pid,
                    "tid": rank,
                    "args": {"evidence": mark["evidence"], "confidence": mark["confidence"]},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"verdict": report["verdict"]}}


def render(report: dict, fmt: str, table: TraceTable) -> str:
    if fmt == "json":
        return json.dumps(report, indent=2) + "\n"
    if fmt == "chrome":
        return json.dumps(chrome_trace(table, report)) + "\n"
    return render_text(report)
