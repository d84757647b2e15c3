"""Ranks whose trace data was not collected (their agent unreachable, timed out or partitioned away):
the caller names them, and the hang verdict then never blames them for data that is missing only
because collection failed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the bot formats rank lists with this module without loading the analyzer's numpy
    from megatrace.analyzer.hang import HangResult
    from megatrace.analyzer.table import TraceTable

RANK_ITEM = re.compile(r"(\d+)(?:-(\d+))?")
MAX_RANK = 1 << 20


def parse_ranks(spec: str) -> frozenset[int]:
    """Ranks from a list such as ``0-3,8`` (commas or white space between items); ValueError naming the
    bad item."""
    ranks: set[int] = set()
    for item in re.split(r"[\s,]+", spec.strip()):
        if not item:
            continue
        match = RANK_ITEM.fullmatch(item)
        if match is None:
            raise ValueError(f"{item!r} is not a rank or a range of ranks (e.g. 0-3,8)")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first or last >= MAX_RANK:
            raise ValueError(f"{item!r} is not a range of ranks from low to high below {MAX_RANK}")
        ranks.update(range(first, last + 1))
    return frozenset(ranks)


def read_ranks_file(path: str | Path) -> frozenset[int]:
    """Ranks listed in a file, as `parse_ranks` reads them; text after ``#`` on a line is a comment."""
    text = Path(path).read_text(encoding="utf-8")
    return parse_ranks(" ".join(line.split("#", 1)[0] for line in text.splitlines()))


def format_ranks(ranks: set[int] | frozenset[int]) -> str:
    """The shortest list `parse_ranks` reads back as `ranks`: ``0-3,8``."""
    items: list[str] = []
    ordered = sorted(ranks)
    start = 0
    for i, rank in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != rank + 1:
            first = ordered[start]
            items.append(str(first) if first == rank else f"{first}-{rank}")
            start = i + 1
    return ",".join(items)


def set_aside(hang: HangResult, table: TraceTable, uncollected: frozenset[int]) -> HangResult:
    """`hang` without the suspects named only because their data is missing, where it was not collected
    (a rank that left data is still judged by it); the ranks that waited on them become victims."""
    from megatrace.analyzer.hang import HangResult

    absent = {rank for rank in uncollected if rank not in table.ranks}
    if not absent:
        return hang
    dropped = [s for s in hang.suspects if s.rank in absent and s.cause == "no_log"]
    kept = [s for s in hang.suspects if not (s.rank in absent and s.cause == "no_log")]
    notes = list(hang.notes)
    if dropped:
        waiting = sorted({w for s in dropped for w in s.waited_by})
        notes.append(
            f"rank(s) {format_ranks({s.rank for s in dropped})} were waited on by rank(s) "
            f"{format_ranks(set(waiting))}, but their trace data was not collected: missing data is no "
            "evidence against them, so they are not named"
        )
    notes.append(f"trace data of rank(s) {format_ranks(absent)} was not collected")
    named = {s.rank for s in kept}
    victims = sorted(r for r in hang.blocked_at if r not in named)
    return HangResult(kept, victims, hang.blocked_at, notes, hang.silent)
