"""Reader for PyTorch Flight Recorder dumps (ProcessGroupNCCL trace buffer, pickle or JSON, version 2.x).

Collectives match across ranks by (process group, ``collective_seq_id``); sends and receives by
their directed channel and order. The entry ``state`` gives completion: ``completed`` entries get
their discovered completion time (or the creation time when none was recorded).
"""

from __future__ import annotations

import ast
import json
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np

from megatrace.analyzer.table import OP_CODE, RankCalls, RankInfo, empty_columns


class FlightRecorderError(ValueError):
    """A file that is not a usable Flight Recorder dump."""


_P2P = re.compile(r"nccl:(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.\w+)?$")
_DTYPE_BYTES = {"Float": 4, "Half": 2, "BFloat16": 2, "Double": 8, "Long": 8, "Int": 4, "Byte": 1, "Char": 1}


class _SafeUnpickler(pickle.Unpickler):
    """Flight Recorder dumps hold only builtins; refuse anything that would import code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a trace dump")


def load_dump(raw: bytes) -> dict:
    if raw[:1] in (b"{", b" ", b"\n"):
        data = json.loads(raw.decode("utf-8"))
    else:
        import io

        data = _SafeUnpickler(io.BytesIO(raw)).load()
    if not isinstance(data, dict) or "entries" not in data or "version" not in data:
        raise FlightRecorderError("not a Flight Recorder dump (no 'version'/'entries')")
    return data


def looks_like_flight_recorder(head: bytes) -> bool:
    return head[:1] == b"\x80" or (
        (head.lstrip()[:1] == b"{" and b'"entries"' in head) or b'"version"' in head
    )


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
    return OP_CODE.get(base, OP_CODE["other"])


def _nbytes(entry: dict) -> int:
    total = 0
    for shape, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or [], strict=False):
        count = int(np.prod(shape)) if shape else 1
        total += count * _DTYPE_BYTES.get(dtype, 4)
    return total


def flight_recorder_calls(data: dict, path: str) -> RankCalls:
    """One rank's calls from a parsed dump."""
    match = _RANK_IN_NAME.search(Path(path).name)
    rank = int(data.get("rank", match.group(1) if match else -1))
    pg_ranks = {str(k): _ranks(v.get("ranks")) for k, v in (data.get("pg_config") or {}).items()}
    entries = sorted(data.get("entries") or [], key=lambda e: e.get("record_id", 0))
    comms: list[tuple[object, tuple[int, ...], bool]] = []
    index: dict[object, int] = {}
    p2p_count: dict[object, int] = {}
    rows = []
    for entry in entries:
        pg = str(entry.get("pg_id", (entry.get("process_group") or ["0"])[0]))
        members = pg_ranks.get(pg, ())
        name = entry.get("profiling_name", "")
        p2p = _P2P.search(name)
        if p2p:
            kind, a, arrow, b = p2p.groups()
            a_g, b_g = (
                (members[int(a)], members[int(b)])
                if members and max(int(a), int(b)) < len(members)
                else (int(a), int(b))
            )
            src, dst = (a_g, b_g) if arrow == "->" else (b_g, a_g)
            key: object = ("p2p", pg, src, dst)
            seq = p2p_count.get(key, 0)
            p2p_count[key] = seq + 1
            comm_members, is_p2p, peer = tuple(sorted({src, dst})), True, (dst if kind == "send" else src)
        else:
            key = ("pg", pg, members)
            seq = int(entry.get("collective_seq_id", 0))
            comm_members, is_p2p, peer = members, False, -1
        if key not in index:
            index[key] = len(comms)
            comms.append((key, comm_members, is_p2p))
        created = int(entry.get("time_created_ns") or 0)
        done = 0
        if entry.get("state") == "completed":
            done = int(entry.get("time_discovered_completed_ns") or 0) or created
        rows.append((index[key], seq, _op(name), _nbytes(entry), created, done, peer))
    cols = empty_columns(len(rows))
    if rows:
        arr = np.array(rows, dtype=np.int64)
        for j, name in enumerate(("comm", "seq", "op", "nbytes", "enqueue_ns", "complete_ns", "peer")):
            cols[name][:] = arr[:, j]
    cols["rank"][:] = rank
    observed = int(max((r[4] for r in rows), default=0))
    info = RankInfo(
        rank=rank, source=path, fmt="flight-recorder", has_completion=True, observed_until_ns=observed
    )
    return RankCalls(rank, cols, comms, info)
