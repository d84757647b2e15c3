"""Find trace files under the given paths, detect each file's format, and load all into one table.

Formats are told apart by their first bytes, never by file name. A file that cannot be read, is
empty or is of no known format is listed under ``ignored`` with the reason; skipped lines inside
readable files are counted per file. Nothing here raises for bad input.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from megatrace.analyzer.flight_recorder import flight_recorder_calls, load_dump, looks_like_flight_recorder
from megatrace.analyzer.layout import Layout, LayoutConfig, resolve
from megatrace.analyzer.nccl_comms import nccl_rank_calls
from megatrace.analyzer.nccl_log import NcclRankLog, looks_like_nccl_log, parse_nccl_bytes
from megatrace.analyzer.progress import Progress
from megatrace.analyzer.table import RankCalls, TableBuilder, TraceTable
from megatrace.analyzer.tracer_files import read_ring_file, snapshot_calls
from megatrace.tracer.dumpfile import DUMP_MAGIC, read_dump
from megatrace.tracer.ringfile import MAGIC

PRIORITY = {"ring": 3, "dump": 2, "flight-recorder": 1, "nccl-log": 1}


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
    """Every regular file under `paths` (directories are walked), sorted; missing paths are reported."""
    found: list[Path] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            for root, _dirs, names in os.walk(path):
                found.extend(Path(root) / name for name in names if not name.startswith("."))
        elif path.is_file():
            found.append(path)
        else:
            report.ignored[str(path)] = "no such file or directory"
    return sorted(set(found))


def detect(head: bytes) -> str | None:
    if head.startswith(MAGIC):
        return "ring"
    if head.startswith(DUMP_MAGIC.encode()):
        return "dump"
    if looks_like_nccl_log(head):
        return "nccl-log"
    if looks_like_flight_recorder(head):
        return "flight-recorder"
    return None


def _read_one(path: Path, report: LoadReport) -> tuple[str, object] | None:
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError as exc:
        report.ignored[str(path)] = f"cannot read: {exc.strerror or exc}"
        return None
    if not head.strip():
        report.ignored[str(path)] = "empty file"
        return None
    fmt = detect(head)
    if fmt is None:
        report.ignored[str(path)] = "unknown format"
        return None
    try:
        if fmt == "ring":
            return fmt, snapshot_calls(read_ring_file(path), str(path), fmt)
        if fmt == "dump":
            return fmt, snapshot_calls(read_dump(path), str(path), fmt)
        raw = path.read_bytes()
        if fmt == "nccl-log":
            log = parse_nccl_bytes(raw, str(path))
            if log.rank < 0 or not len(log.enqueue_ns):
                report.ignored[str(path)] = f"no readable NCCL log lines ({log.skipped} skipped)"
                return None
            return fmt, log
        return fmt, flight_recorder_calls(load_dump(raw), str(path))
    except Exception as exc:  # any reader failure is one ignored file, never a failed run
        report.ignored[str(path)] = f"unreadable {fmt}: {exc}"
        return None


def load(
    paths: list[str | Path], layout: Layout | LayoutConfig | None = None, progress: bool = False
) -> tuple[TraceTable, LoadReport]:
    """Read every trace file under `paths` into one `TraceTable`.

    A `LayoutConfig` without a world size is resolved with the highest rank that left a log (it helps
    to tell communicators apart in NCCL logs); `LayoutError` when the sizes do not fit.
    """
    report = LoadReport()
    files = find_files(paths, report)
    bar = Progress(len(files), "loading traces", progress)
    by_rank: dict[int, tuple[int, int, str, RankCalls]] = {}
    nccl_logs: list[NcclRankLog] = []
    for path in files:
        got = _read_one(path, report)
        bar.advance()
        if got is None:
            continue
        fmt, item = got
        report.files_by_format[fmt] = report.files_by_format.get(fmt, 0) + 1
        if isinstance(item, NcclRankLog):
            if item.skipped:
                report.lines_skipped[str(path)] = item.skipped
            report.duplicates_dropped += item.duplicates
            nccl_logs.append(item)
            continue
        _keep_best(by_rank, fmt, item, report)
    bar.close()
    if isinstance(layout, LayoutConfig):
        seen = [*by_rank, *(log.rank for log in nccl_logs)]
        layout = resolve(layout, max(seen) + 1 if seen else None) if seen or layout.world_size else None
    for calls in nccl_rank_calls(nccl_logs, layout):
        _keep_best(by_rank, "nccl-log", calls, report)
    builder = TableBuilder()
    for rank in sorted(by_rank):
        calls = by_rank[rank][3]
        calls.info.observed_until_ns = max(calls.info.observed_until_ns, _mtime_ns(calls.info.source))
        builder.add(calls, calls.info.source)
    return builder.build(), report


def _keep_best(by_rank: dict, fmt: str, calls: RankCalls, report: LoadReport) -> None:
    """Keep one source per rank: the live ring over dumps, the newest dump over older ones."""
    rank = calls.rank
    score = (PRIORITY[fmt], calls.info.observed_until_ns)
    current = by_rank.get(rank)
    if current is None or score > current[:2]:
        if current is not None:
            report.superseded[current[3].info.source] = f"rank {rank} also in {calls.info.source}"
        by_rank[rank] = (*score, fmt, calls)
    else:
        report.superseded[calls.info.source] = f"rank {rank} also in {current[3].info.source}"


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0
