"""Reader for PyTorch Flight Recorder dumps, pickle or JSON, as torch writes them (format 2.x).

Facts this relies on (checked on dumps torch 2.13 wrote from gloo jobs, and torch's NCCL format):
- one dump per rank, with no rank field in it: the rank is the number the file name ends with;
- ``process_group`` is ``(name, desc)``; the name is global (``"0"`` the default group, then one per
  ``new_group`` in creation order, the same on every rank), while ``pg_id`` is a per-rank index;
- ``pg_config`` gives each group's ranks on NCCL, and is one empty entry on gloo: there the members
  of a group are the ranks whose dumps hold its entries (the default group: every rank), completed to
  the layout's group holding them when a layout is given (a rank that left no dump is still a member);
- ``collective_seq_id`` numbers a group's collectives the same on every member; sends and receives
  (``nccl:send 1->2``, group ranks) are matched by their directed channel and order;
- ``state`` says ``completed`` with ``time_discovered_completed_ns`` on NCCL; on gloo every entry stays
  ``scheduled``, and completion is told by ``pg_status[pg_id].last_completed_collective`` (a string in
  JSON), so a collective past it was still in flight when the dump was taken.
"""

from __future__ import annotations

import ast
import io
import json
import pickle
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrace.analyzer.layout import Layout
from megatrace.analyzer.reader_api import Parsed, Reader
from megatrace.analyzer.table import RankCalls, RankInfo, empty_columns
from megatrace.tracer.format import OP_CODES, OP_OTHER


class FlightRecorderError(ValueError):
    """A file that is not a usable Flight Recorder dump."""


_P2P = re.compile(r":(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.\w+)?$")
_DTYPE_BYTES = {"Float": 4, "Half": 2, "BFloat16": 2, "Double": 8, "Long": 8, "Int": 4, "Byte": 1, "Char": 1}
DEFAULT_GROUP = "0"


class _SafeUnpickler(pickle.Unpickler):
    """Flight Recorder dumps hold only builtins; refuse anything that would import code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a trace dump")


@dataclass
class FlightRecorderDump:
    """One rank's parsed dump."""

    path: str
    rank: int
    data: dict
    written_ns: int = 0


def load_dump(raw: bytes) -> dict:
    if raw[:1] in (b"{", b" ", b"\n"):
        data = json.loads(raw.decode("utf-8"))
    else:
        data = _SafeUnpickler(io.BytesIO(raw)).load()
    if not isinstance(data, dict) or "entries" not in data or "version" not in data:
        raise FlightRecorderError("not a Flight Recorder dump (no 'version'/'entries')")
    return data


def looks_like_flight_recorder(head: bytes) -> bool:
    return head[:1] == b"\x80" or (
        (head.lstrip()[:1] == b"{" and b'"entries"' in head) or b'"version"' in head
    )


def read_dump(path: Path) -> FlightRecorderDump:
    """Parse one dump; the rank is the dump's own ``rank`` where present, else the file name's number."""
    data = load_dump(path.read_bytes())
    match = _RANK_IN_NAME.search(path.name)
    rank = data.get("rank", match.group(1) if match else None)
    if rank is None:
        raise FlightRecorderError("no rank: the file name does not end with the rank number")
    return FlightRecorderDump(str(path), int(rank), data, path.stat().st_mtime_ns)


def _ranks(value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return ()


def _op(name: str) -> int:
    base = name.split(":", 1)[-1].split()[0] if name else "other"
    return OP_CODES.get(base, OP_OTHER)


def _nbytes(entry: dict) -> int:
    total = 0
    for shape, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or [], strict=False):
        count = int(np.prod(shape)) if shape else 1
        total += count * _DTYPE_BYTES.get(dtype, 4)
    return total


def _group_name(entry: dict) -> str:
    group = entry.get("process_group")
    if isinstance(group, list | tuple) and group:
        return str(group[0])
    return str(entry.get("pg_id", DEFAULT_GROUP))


def _configured_members(dump: FlightRecorderDump) -> dict[str, tuple[int, ...]]:
    """Group name -> ranks, from ``pg_config`` where torch filled it in (NCCL)."""
    out = {}
    for key, config in (dump.data.get("pg_config") or {}).items():
        if not isinstance(config, dict):
            continue
        ranks = _ranks(config.get("ranks"))
        if ranks:
            out[str(config.get("name") or key)] = ranks
    return out


def group_members(dumps: list[FlightRecorderDump], layout: Layout | None) -> dict[str, tuple[int, ...]]:
    """Every group's members: configured where the dumps say, else the ranks whose dumps use it."""
    members: dict[str, set[int]] = defaultdict(set)
    configured: dict[str, tuple[int, ...]] = {}
    for dump in dumps:
        configured.update(_configured_members(dump))
        for entry in dump.data.get("entries") or []:
            members[_group_name(entry)].add(dump.rank)
    world = max([d.rank for d in dumps] + [layout.world_size - 1 if layout else -1]) + 1
    out = {
        name: layout.group_holding(ranks, single=True) if layout is not None else tuple(sorted(ranks))
        for name, ranks in members.items()
    }
    out[DEFAULT_GROUP] = tuple(range(world))
    out.update(configured)
    return out


def _completed_through(dump: FlightRecorderDump) -> dict[str, int]:
    """pg_id (as text) -> the last collective sequence number completed, from ``pg_status``."""
    out = {}
    for key, status in (dump.data.get("pg_status") or {}).items():
        try:
            out[str(key)] = int(status.get("last_completed_collective", -1))
        except (TypeError, ValueError, AttributeError):
            continue
    return out


def dump_calls(dump: FlightRecorderDump, members_of: dict[str, tuple[int, ...]]) -> RankCalls:
    """One rank's calls from its parsed dump, communicators keyed by the global group name."""
    rank = dump.rank
    entries = sorted(dump.data.get("entries") or [], key=lambda e: e.get("record_id", 0))
    completed_through = _completed_through(dump)
    comms: list[tuple[object, tuple[int, ...], bool]] = []
    index: dict[object, int] = {}
    p2p_count: dict[object, int] = {}
    rows = []
    for entry in entries:
        pg = _group_name(entry)
        members = members_of.get(pg, ())
        name = entry.get("profiling_name", "")
        p2p = _P2P.search(name)
        if p2p:
            _kind, a, arrow, b = p2p.groups()
            a_g, b_g = (
                (members[int(a)], members[int(b)])
                if members and max(int(a), int(b)) < len(members)
                else (int(a), int(b))
            )
            src, dst = (a_g, b_g) if arrow == "->" else (b_g, a_g)
            key: object = ("p2p", pg, src, dst)
            seq = p2p_count.get(key, 0)
            p2p_count[key] = seq + 1
            comm_members, is_p2p = tuple(sorted({src, dst})), True
        else:
            key = ("pg", pg)
            seq = int(entry.get("collective_seq_id", 0))
            comm_members, is_p2p = members, False
        if key not in index:
            index[key] = len(comms)
            comms.append((key, comm_members, is_p2p))
        created = int(entry.get("time_created_ns") or 0)
        done = 0
        if entry.get("state") == "completed":
            done = int(entry.get("time_discovered_completed_ns") or 0) or created
        elif not is_p2p and seq <= completed_through.get(str(entry.get("pg_id")), -1):
            done = created  # completed (pg_status says so); torch keeps no time for it
        rows.append((index[key], seq, _op(name), _nbytes(entry), created, done))
    cols = empty_columns(len(rows))
    if rows:
        arr = np.array(rows, dtype=np.int64)
        if not any(entry.get("state") == "completed" for entry in entries):
            _past_completed(arr)
        for j, col in enumerate(("comm", "seq", "op", "nbytes", "enqueue_ns", "complete_ns")):
            cols[col][:] = arr[:, j]
    cols["rank"][:] = rank
    # torch writes no dump time: the file's modification time is when it was written
    observed = max(int(max((r[4] for r in rows), default=0)), dump.written_ns)
    info = RankInfo(
        rank=rank, source=dump.path, fmt="flight-recorder", has_completion=True, observed_until_ns=observed
    )
    return RankCalls(rank, cols, comms, info)


def _past_completed(arr: np.ndarray) -> None:
    """Gloo's collectives (rows: comm, seq, op, nbytes, created, done), completed where the rank has
    completed a later one. ``pg_status`` is updated as torch finds work done, and at a dump its newest
    collectives can read in flight on a rank that waited for them and went on: a healthy job's last
    gradient reduction read in flight on both members after the step's loss reduction, created after
    it, read completed (real dumps of a finished run). A rank's main thread waits for its collectives
    before the next step's, so a later completed one means this one was past."""
    done = arr[:, 5] > 0
    if not done.any():
        return
    last = int(arr[done, 4].max())
    late = ~done & (arr[:, 4] < last) & (arr[:, 4] > 0)
    arr[late, 5] = arr[late, 4]


def flight_recorder_calls(dumps: list[FlightRecorderDump], layout: Layout | None = None) -> list[RankCalls]:
    """Every dump's calls, with group memberships resolved across all the dumps."""
    members = group_members(dumps, layout)
    return [dump_calls(dump, members) for dump in dumps]


def _parse(path: Path, _settings: None) -> Parsed:
    return Parsed(read_dump(path))


READER = Reader("flight-recorder", 1, looks_like_flight_recorder, _parse, flight_recorder_calls)
