"""Find trace files under the given paths, detect each file's format, and load all into one table.

Formats are told apart by their first bytes, never by file name. A file that cannot be read, is
empty or is of no known format is listed under ``ignored`` with the reason; skipped lines inside
readable files are counted per file. Nothing here raises for bad input.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatrace.analyzer.formats import READERS, detect, reader_settings
from megatrace.analyzer.layout import Layout, LayoutConfig, resolve
from megatrace.analyzer.progress import Progress
from megatrace.analyzer.reader_api import Reader, ReaderError
from megatrace.analyzer.table import RankCalls, RankStacks, TableBuilder, TraceTable
from megatrace.regular_files import open_regular
from megatrace.tracer.stacks import ThreadStack

HEAD_BYTES = 4096


@dataclass
class LoadReport:
    """What was read, what was skipped and why."""

    files_by_format: dict[str, int] = field(default_factory=dict)
    lines_skipped: dict[str, int] = field(default_factory=dict)
    duplicates_dropped: int = 0
    ignored: dict[str, str] = field(default_factory=dict)
    superseded: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "files_by_format": self.files_by_format,
            "lines_skipped": self.lines_skipped,
            "duplicates_dropped": self.duplicates_dropped,
            "ignored": self.ignored,
            "superseded": self.superseded,
        }


def find_files(paths: list[str | Path], report: LoadReport) -> list[Path]:
    """Every regular file under `paths` (directories are walked), sorted; missing paths and anything
    that is not a regular file (a FIFO, a socket, a device: reading one could block) are reported."""
    found: list[Path] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            for root, _dirs, names in os.walk(path):
                for name in names:
                    if name.startswith("."):
                        continue
                    full = Path(root) / name
                    if _regular(full, report):
                        found.append(full)
        elif path.exists():
            if _regular(path, report):
                found.append(path)
        else:
            report.ignored[str(path)] = "no such file or directory"
    return sorted(set(found))


def _regular(path: Path, report: LoadReport) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        report.ignored[str(path)] = f"cannot read: {exc.strerror or exc}"
        return False
    if not stat.S_ISREG(mode):
        report.ignored[str(path)] = "not a regular file"
        return False
    return True


def _head(path: Path) -> bytes:
    """The first bytes of a regular file, opened without blocking (it may have become a FIFO since)."""
    fd = open_regular(path)
    try:
        return os.read(fd, HEAD_BYTES)
    finally:
        os.close(fd)


def _read_one(path: Path, report: LoadReport, settings: Mapping[str, Any]) -> tuple[Reader, object] | None:
    try:
        head = _head(path)
    except OSError as exc:
        report.ignored[str(path)] = f"cannot read: {exc.strerror or exc}"
        return None
    if not head.strip():
        report.ignored[str(path)] = "empty file"
        return None
    reader = detect(head)
    if reader is None:
        report.ignored[str(path)] = "unknown format"
        return None
    try:
        parsed = reader.parse(path, settings.get(reader.name))
    except ReaderError as exc:
        report.ignored[str(path)] = str(exc)
        return None
    except Exception as exc:  # any reader failure is one ignored file, never a failed run
        report.ignored[str(path)] = f"unreadable {reader.name}: {exc}"
        return None
    if parsed.skipped:
        report.lines_skipped[str(path)] = parsed.skipped
    report.duplicates_dropped += parsed.duplicates
    return reader, parsed.item


def _parse_all(
    paths: list[str | Path], progress: bool, settings: Mapping[str, Any] | None
) -> tuple[dict[str, dict[str, list[object]]], LoadReport]:
    """Every readable file under `paths`, parsed: job -> format -> items (our files name their job;
    other formats name none, job ""). `settings`: reader name -> its settings (`reader_settings`;
    the defaults when None)."""
    settings = reader_settings() if settings is None else settings
    report = LoadReport()
    files = find_files(paths, report)
    bar = Progress(len(files), "loading traces", progress)
    jobs: dict[str, dict[str, list[object]]] = {}
    for path in files:
        got = _read_one(path, report, settings)
        bar.advance()
        if got is None:
            continue
        reader, item = got
        report.files_by_format[reader.name] = report.files_by_format.get(reader.name, 0) + 1
        job = (
            item.info.job if isinstance(item, RankCalls) else item.job if isinstance(item, RankStacks) else ""
        )
        jobs.setdefault(job, {}).setdefault(reader.name, []).append(item)
    bar.close()
    return jobs, report


def load_jobs(
    paths: list[str | Path],
    layout: Layout | LayoutConfig | None = None,
    progress: bool = False,
    settings: Mapping[str, Any] | None = None,
) -> list[tuple[str, TraceTable, LoadReport]]:
    """One `TraceTable` per job found under `paths`: a folder holding several jobs' traces (our files
    name their job) gives several. A `LayoutConfig` without a world size is resolved with the highest
    rank that left a log; `LayoutError` when the sizes do not fit. `settings` as `_parse_all` takes them."""
    jobs, report = _parse_all(paths, progress, settings)
    if len(jobs) <= 1:
        parsed = next(iter(jobs.values()), {})
        return [(next(iter(jobs), ""), _table(parsed, layout, report), report)]
    out = []
    for job in sorted(jobs):
        job_report = _report_of(report, jobs[job])
        out.append((job, _table(jobs[job], layout, job_report), job_report))
    return out


def load(
    paths: list[str | Path],
    layout: Layout | LayoutConfig | None = None,
    progress: bool = False,
    settings: Mapping[str, Any] | None = None,
) -> tuple[TraceTable, LoadReport]:
    """Every trace file under `paths` in one `TraceTable`, whatever job each names."""
    jobs, report = _parse_all(paths, progress, settings)
    parsed: dict[str, list[object]] = {}
    for per_format in jobs.values():
        for fmt, items in per_format.items():
            parsed.setdefault(fmt, []).extend(items)
    return _table(parsed, layout, report), report


def _report_of(report: LoadReport, parsed: dict[str, list[object]]) -> LoadReport:
    """The load report of one job: its own file counts, the shared list of what was skipped."""
    return LoadReport(
        files_by_format={fmt: len(items) for fmt, items in parsed.items()},
        lines_skipped=report.lines_skipped,
        duplicates_dropped=report.duplicates_dropped,
        ignored=report.ignored,
        superseded={},
    )


def _table(
    parsed: dict[str, list[object]], layout: Layout | LayoutConfig | None, report: LoadReport
) -> TraceTable:
    if isinstance(layout, LayoutConfig):
        seen = [_rank_of(item) for items in parsed.values() for item in items]
        layout = resolve(layout, max(seen) + 1 if seen else None) if seen or layout.world_size else None
    by_rank: dict[int, tuple[int, int, str, RankCalls]] = {}
    # the latest any file shows of a rank: a stall dump after the ring, or a stacks file (faulthandler's
    # timer wrote it from inside the process, so it was alive then, its ring silent)
    seen_until: dict[int, int] = {}
    stacks: dict[
        int, tuple[int, tuple[ThreadStack, ...], bool]
    ] = {}  # each rank's newest stacks, from any file
    for name, items in parsed.items():
        for item in items:
            if isinstance(item, RankStacks) and item.stacks:
                _newest_stacks(stacks, item.rank, item.taken_ns, item.stacks, True)
                seen_until[item.rank] = max(seen_until.get(item.rank, 0), item.taken_ns)
        for calls in READERS[name].resolve(items, layout):
            _keep_best(by_rank, name, calls, report)
            seen_until[calls.rank] = max(seen_until.get(calls.rank, 0), calls.info.observed_until_ns)
            if calls.info.stacks:
                _newest_stacks(stacks, calls.rank, calls.info.observed_until_ns, calls.info.stacks, False)
    builder = TableBuilder()
    for rank in sorted(by_rank):
        calls = by_rank[rank][3]
        calls.info.observed_until_ns = seen_until[rank]
        calls.info.stacks_ns, calls.info.stacks, calls.info.stacks_frozen = stacks.get(rank, (0, (), False))
        builder.add(calls, calls.info.source)
    table = builder.build()
    # what the per-rank arrays left in glibc's heap (the small ones) goes back to the system too
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    return table


def _newest_stacks(
    found: dict[int, tuple[int, tuple[ThreadStack, ...], bool]],
    rank: int,
    taken_ns: int,
    stacks: tuple[ThreadStack, ...],
    frozen: bool,
) -> None:
    """Keep the newest stacks of `rank`; `frozen`: faulthandler's timer wrote them (the stacks file),
    so the rank's Python watchdog could not run: its training thread held the GIL."""
    if rank not in found or taken_ns > found[rank][0]:
        found[rank] = (taken_ns, stacks, frozen)


def _rank_of(item: object) -> int:
    return int(getattr(item, "rank", -1))


def _keep_best(by_rank: dict, fmt: str, calls: RankCalls, report: LoadReport) -> None:
    """Keep one source per rank: the live ring over dumps, the newest dump over older ones."""
    rank = calls.rank
    score = (READERS[fmt].priority, calls.info.observed_until_ns)
    current = by_rank.get(rank)
    if current is None or score > current[:2]:
        if current is not None:
            report.superseded[current[3].info.source] = f"rank {rank} also in {calls.info.source}"
        by_rank[rank] = (*score, fmt, calls)
    else:
        report.superseded[calls.info.source] = f"rank {rank} also in {current[3].info.source}"
