"""The node's trace files as the trace endpoint sees them: jobs, ranks, stall dumps and stacks files
under one root.

Every name that comes from a request is checked before it touches the file system (a job name of
plain characters, a rank number, a dump or stacks file name of the tracer's form), and every path is
resolved and must stay inside the trace root: a symlink leading out of it is refused like a ``..``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from pathlib import Path

from megatrace.regular_files import is_regular, open_regular
from megatrace.tracer.ringfile import RingFormatError, RingHeader, read_header

JOB_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@+=-]{0,199}")
DUMP_NAME = re.compile(r"rank-(\d{1,9})\.\d{1,10}\.\d{1,10}\.dump")
RING_NAME = re.compile(r"rank-(\d{1,9})\.trace")
STACKS_NAME = re.compile(r"rank-(\d{1,9})\.\d{1,10}\.stacks")


class Refused(Exception):
    """A request the store will not answer; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[type[Refused], tuple[int, str]]:
        # raised in the serving process (`megatrace.exporters.trace_workers`), re-raised in the agent
        return Refused, (self.status, str(self))


@dataclasses.dataclass
class RankEntry:
    """One rank of a job found on this node: its ring file (if any), stall dumps and stacks files
    (faulthandler's, `megatrace.tracer.stack_fallback`), newest last."""

    rank: int
    ring: Path | None = None
    dumps: list[Path] = dataclasses.field(default_factory=list)
    stacks: list[Path] = dataclasses.field(default_factory=list)


class TraceStore:
    """Read-only access to ``<root>/<job>/rank-N.trace``, ``rank-N.<pid>.<k>.dump`` and
    ``rank-N.<pid>.stacks``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _inside(self, path: Path, what: str) -> Path:
        base = self.root.resolve()
        resolved = path.resolve()
        if resolved == base or not resolved.is_relative_to(base):
            raise Refused(403, f"{what} leads outside the trace root; refused")
        return resolved

    def jobs(self) -> list[str]:
        """Job folders directly under the root (those whose names a request could name)."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return sorted(name for name in names if JOB_NAME.fullmatch(name) and (self.root / name).is_dir())

    def job_dir(self, job: str) -> Path:
        if not JOB_NAME.fullmatch(job) or set(job) == {"."}:
            raise Refused(400, f"{job[:80]!r} is not a job name")
        path = self.root / job
        if not path.is_dir() and not path.is_symlink():
            raise Refused(404, f"no job {job!r} under the trace root")
        resolved = self._inside(path, f"job {job!r}")
        if not resolved.is_dir():
            raise Refused(404, f"no job {job!r} under the trace root")
        return resolved

    def ranks(self, job: str) -> dict[int, RankEntry]:
        """The job's ranks on this node, by rank."""
        directory = self.job_dir(job)
        found: dict[int, RankEntry] = {}
        for name in sorted(os.listdir(directory)):
            ring, dump, stacks = (
                RING_NAME.fullmatch(name),
                DUMP_NAME.fullmatch(name),
                STACKS_NAME.fullmatch(name),
            )
            match = ring or dump or stacks
            if match is None or not is_regular(directory / name):
                continue
            try:
                path = self._inside(directory / name, name)
            except Refused:
                continue
            entry = found.setdefault(int(match.group(1)), RankEntry(int(match.group(1))))
            if ring:
                entry.ring = path
            else:
                (entry.dumps if dump else entry.stacks).append(path)
        for entry in found.values():
            entry.dumps.sort(key=_mtime)
            entry.stacks.sort(key=_mtime)
        return dict(sorted(found.items()))

    def rank(self, job: str, rank: str) -> RankEntry:
        if not rank.isdigit() or len(rank) > 9:
            raise Refused(400, f"{rank[:80]!r} is not a rank number")
        entry = self.ranks(job).get(int(rank))
        if entry is None:
            raise Refused(404, f"no rank {int(rank)} of job {job!r} on this node")
        return entry

    def ring(self, job: str, rank: str) -> Path | None:
        """The rank's ring file (None: the rank has only stall dumps here); Refused as `rank` says.

        Looked up by its name first: listing the job's folder for every request would cost each one
        time in proportion to the ranks on the node (milliseconds at 64)."""
        if not rank.isdigit() or len(rank) > 9:
            raise Refused(400, f"{rank[:80]!r} is not a rank number")
        name = f"rank-{int(rank)}.trace"
        path = self.job_dir(job) / name
        if is_regular(path):
            with contextlib.suppress(Refused):  # leads out of the root: as if it were not there
                return self._inside(path, name)
        return self.rank(job, rank).ring

    def dump(self, job: str, name: str) -> Path:
        if not DUMP_NAME.fullmatch(name):
            raise Refused(400, f"{name[:80]!r} is not a stall dump name (rank-N.PID.K.dump)")
        return self._named(job, name, "dump")

    def stacks(self, job: str, name: str) -> Path:
        if not STACKS_NAME.fullmatch(name):
            raise Refused(400, f"{name[:80]!r} is not a stacks file name (rank-N.PID.stacks)")
        return self._named(job, name, "stacks file")

    def _named(self, job: str, name: str, what: str) -> Path:
        path = self.job_dir(job) / name
        if not path.exists() and not path.is_symlink():
            raise Refused(404, f"no {what} {name!r} of job {job!r}")
        resolved = self._inside(path, f"{what} {name!r}")
        if not is_regular(resolved):
            raise Refused(404, f"no {what} {name!r} of job {job!r}")
        return resolved


def read_bounded(path: Path, limit: int) -> bytes:
    """A regular file's bytes; Refused (413) when it holds more than `limit`."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise Refused(413, f"{path.name} holds {size} bytes, more than the {limit} served at once")
        return os.read(fd, limit + 1)[:limit]
    finally:
        os.close(fd)


def header_or_none(path: Path | None) -> RingHeader | None:
    if path is None:
        return None
    try:
        return read_header(path)
    except RingFormatError:
        return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
