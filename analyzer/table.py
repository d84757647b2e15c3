"""The one columnar table every reader fills and every detector queries.

Rows are collective/P2P calls; columns are NumPy arrays of equal length. Communicators are
interned: column ``comm`` is an index into `TraceTable.comms`, whose entry lists the member global
ranks. Point-to-point traffic lives in directed channels (``src->dst``) whose ``seq`` is the
per-channel order, so a send and its matching receive share (comm, seq) just like a collective.
Column ``op`` holds the op codes of `megatrace.tracer.format.OP_NAMES`, whatever format a call was read from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatrace.tracer.ringfile import HostSample
from megatrace.tracer.stacks import ThreadStack

COLUMNS: dict[str, str] = {
    "rank": "i4",
    "comm": "i4",
    "seq": "i8",
    "op": "u1",
    "nbytes": "i8",
    "enqueue_ns": "i8",
    "complete_ns": "i8",
}


@dataclass(frozen=True)
class Communicator:
    """One communicator (or directed P2P channel) as seen in the logs."""

    key: str
    members: tuple[int, ...]
    p2p: bool = False


@dataclass
class RankInfo:
    """What a rank's log says about the rank itself."""

    rank: int
    host: str = ""
    job: str = ""
    source: str = ""
    fmt: str = ""
    has_completion: bool = False
    finished: bool = False
    observed_until_ns: int = 0
    # observed_until_ns is the time of reading: the writer is alive, or cannot be told dead
    observed_live: bool = False
    # Our tracer's files only: the host samples of the ring header (oldest first), the span records
    # (pauses, GC; RECORD_DTYPE rows), and every thread's Python stack from the rank's newest
    # stall/signal dump or stacks file, with when it was taken. What `analyzer.cause` compares.
    host_samples: tuple[HostSample, ...] = ()
    spans: np.ndarray | None = None
    stacks: tuple[ThreadStack, ...] = ()
    stacks_ns: int = 0
    stacks_frozen: bool = False  # taken by faulthandler's timer: the rank's training thread held the GIL


@dataclass
class TraceTable:
    """Calls of all ranks, one row each, plus communicators, files and per-rank facts."""

    columns: dict[str, np.ndarray]
    comms: list[Communicator]
    files: list[str]
    ranks: dict[int, RankInfo]
    world_size: int = 0
    notes: list[str] = field(default_factory=list)
    _spans: dict[int, tuple[int, int]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.columns["rank"])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def rank_span(self, rank: int) -> tuple[int, int]:
        """Row range [start, end) of `rank` (rows are grouped by rank; empty range when absent)."""
        if self._spans is None:
            ranks = self.columns["rank"]
            uniq, starts = np.unique(ranks, return_index=True)
            ends = np.append(starts[1:], len(ranks))[: len(starts)]  # no rows: no ranks, no ends
            self._spans = {int(u): (int(s), int(e)) for u, s, e in zip(uniq, starts, ends, strict=True)}
        return self._spans.get(rank, (0, 0))


def empty_columns(n: int = 0, **given: np.ndarray) -> dict[str, np.ndarray]:
    """Columns of `n` rows with the table's dtypes: the `given` arrays (copied only where their dtype
    differs or they are strided views, a structured array's field say), the rest zeros (no completion).
    A column given whole costs one write instead of a zero-fill and a write: it counts at 4,096 ranks."""
    cols = {}
    for name, dtype in COLUMNS.items():
        if name in given:
            cols[name] = np.ascontiguousarray(given[name], dtype=dtype)
        else:
            cols[name] = np.zeros(n, dtype=dtype)
    return cols


@dataclass
class RankCalls:
    """One rank's calls from one file, before communicators are interned table-wide.

    ``columns["comm"]`` holds indices into ``comms``: reader-local entries of
    (key identifying the communicator across ranks, sorted member ranks, is-P2P-channel).
    """

    rank: int
    columns: dict[str, np.ndarray]
    comms: list[tuple[object, tuple[int, ...], bool]]
    info: RankInfo


@dataclass
class RankStacks:
    """A rank's thread stacks from a file that holds no calls (the tracer's stacks file), taken at
    `taken_ns`; the loader gives them to the rank's `RankInfo` when no newer stacks are found."""

    rank: int
    job: str
    taken_ns: int
    stacks: tuple[ThreadStack, ...]


class TableBuilder:
    """Collects `RankCalls` from any reader and interns communicators into one `TraceTable`."""

    def __init__(self) -> None:
        self._parts: list[dict[str, np.ndarray]] = []
        self._comm_index: dict[object, int] = {}
        self.comms: list[Communicator] = []
        self.files: list[str] = []
        self.ranks: dict[int, RankInfo] = {}
        self.notes: list[str] = []

    def comm_id(self, key: object, members: tuple[int, ...], p2p: bool = False) -> int:
        """Index of the communicator `key`, creating it on first sight."""
        index = self._comm_index.get(key)
        if index is None:
            index = len(self.comms)
            self._comm_index[key] = index
            self.comms.append(Communicator(str(key), tuple(sorted(members)), p2p))
        return index

    def add(self, calls: RankCalls, path: str) -> None:
        """Add one rank's calls (rows keep their order) read from `path`. The builder takes the columns
        over (`calls.columns` is left empty), so that `build` frees each rank's arrays as it joins them:
        with the caller still holding them, the peak was twice the table."""
        self.files.append(path)
        cols, calls.columns = calls.columns, {}
        n = len(cols["rank"])
        if n:
            mapping = np.array([self.comm_id(*entry) for entry in calls.comms], dtype=np.int32)
            cols["comm"] = mapping[cols["comm"]]
            self._parts.append(cols)
        known = self.ranks.get(calls.rank)
        if known is None or n > 0:
            self.ranks[calls.rank] = calls.info

    def build(self) -> TraceTable:
        # column by column, each part's copy let go as soon as it is joined: the peak holds one column
        # twice, not the whole table
        columns = {
            name: np.concatenate([part.pop(name) for part in self._parts]).astype(dtype, copy=False)
            if self._parts
            else np.zeros(0, dtype=dtype)
            for name, dtype in COLUMNS.items()
        }
        self._parts = []
        world = max([*self.ranks, -1]) + 1
        for comm in self.comms:
            if comm.members:
                world = max(world, comm.members[-1] + 1)
        return TraceTable(columns, self.comms, self.files, self.ranks, world, self.notes)
