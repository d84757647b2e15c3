"""Trace-log analyzer: loads every supported format into one table and localizes hung and slow ranks.

`analyze(paths, layout=None)` returns the JSON report of the contract as a dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatrace.analyzer.layout import Layout, LayoutConfig, resolve


def run(
    paths,
    layout: Layout | LayoutConfig | None = None,
    progress: bool = False,
    stall_s: float = 1.0,
    uncollected: frozenset[int] = frozenset(),
    reader_options: Mapping[str, Mapping[str, Any]] | None = None,
):
    """Load and analyze; returns (report dict, table) — the table is what the Chrome trace is drawn from.
    `uncollected`: ranks whose data the caller failed to collect (never blamed for missing data).
    `reader_options`: reader name -> setting -> value (`formats.reader_settings`; ConfigError when bad).

    Traces of several jobs under the paths are analyzed job by job: the report then lists each under
    ``jobs`` and gives the most serious verdict, with every job's suspects (each naming its job).
    """
    from megatrace.analyzer.formats import reader_settings
    from megatrace.analyzer.loader import load_jobs
    from megatrace.analyzer.report import combine_jobs

    if isinstance(paths, str | Path):
        paths = [paths]
    settings = reader_settings(reader_options)
    jobs = load_jobs(list(paths), layout, progress, settings)
    results = [
        (job, *_analyze_table(table, loaded, layout, stall_s, uncollected)) for job, table, loaded in jobs
    ]
    if len(results) == 1:
        return results[0][1], results[0][2]
    report = combine_jobs([(job, report) for job, report, _table in results])
    worst = next(table for job, rep, table in results if rep["verdict"] == report["verdict"])
    return report, worst


def _analyze_table(
    table, loaded, layout: Layout | LayoutConfig | None, stall_s: float, uncollected: frozenset[int]
):
    from megatrace.analyzer.cause import explain
    from megatrace.analyzer.hang import detect_hang
    from megatrace.analyzer.infer import check_given, infer_layout
    from megatrace.analyzer.report import analysis_report
    from megatrace.analyzer.slow import detect_slow
    from megatrace.analyzer.uncollected import set_aside

    resolved = layout
    if isinstance(layout, LayoutConfig):
        resolved = (
            resolve(layout, table.world_size or None) if table.world_size or layout.world_size else None
        )
    inferred = infer_layout(table, resolved.gpus_per_node if isinstance(resolved, Layout) else 8)
    contradiction = None
    if isinstance(resolved, Layout):
        contradiction = check_given(resolved, inferred, table)
        if contradiction:
            table.notes.append(contradiction)
    else:
        resolved = inferred.layout
    hang = set_aside(detect_hang(table, stall_s), table, uncollected)
    # stages are judged by the layout that explains the traces: a contradicted one is not trusted
    slow = detect_slow(table, inferred.layout if contradiction else resolved)
    report = analysis_report(table, loaded, hang, slow, resolved)
    report["layout_inferred"] = inferred.as_dict()
    if uncollected:
        report["uncollected_ranks"] = sorted(uncollected)
    if len(table) == 0 and table.ranks:  # files read, but no rank issued a collective: nothing to judge
        report |= {"verdict": "no-data", "suspects": [], "victims": []}
        report["notes"].append("the trace files hold no collective call of any rank: nothing to judge")
    why = explain(table, report)
    if why is not None:
        report["why"] = why
    return report, table


def analyze(paths, layout: Layout | LayoutConfig | None = None) -> dict:
    """Analyze the trace logs under `paths` (files or directories); returns the JSON report as a dict."""
    return run(paths, layout)[0]
