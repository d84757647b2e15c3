"""A trace format with one setting, written as a new reader is: this one file, plus one row in the
`READERS` table (the tests add the row; a real format adds it in ``analyzer/formats.py``).

A file holds one rank's calls as text: the line ``# example-calls v1``, then ``observed T`` (when the
trace was taken), then one line per call: ``RANK MEMBERS SEQ OP ENQUEUE COMPLETE`` with MEMBERS the
communicator's ranks joined by ``-`` and COMPLETE 0 for a call still open. Times are in the unit of
the setting ``time_unit`` (``ns`` or ``us``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from megatrace.analyzer.reader_api import Parsed, Reader, ReaderError, each_alone
from megatrace.analyzer.table import RankCalls, RankInfo, empty_columns
from megatrace.tracer.format import OP_CODES

MAGIC = b"# example-calls v1\n"
SCALE = {"ns": 1, "us": 1000}


@dataclass(frozen=True)
class ExampleSettings:
    """Settings of the example format (``--reader-option example-calls.time_unit=us``)."""

    time_unit: Literal["ns", "us"] = "ns"


def _parse(path: Path, settings: ExampleSettings) -> Parsed:
    lines = path.read_text(encoding="utf-8").splitlines()
    scale = SCALE[settings.time_unit]
    if len(lines) < 2 or not lines[1].startswith("observed "):
        raise ReaderError("no 'observed' line")
    observed = int(lines[1].split()[1]) * scale
    rows = [line.split() for line in lines[2:] if line.strip()]
    index: dict[str, int] = {}
    for row in rows:
        index.setdefault(row[1], len(index))
    comms: list[tuple[object, tuple[int, ...], bool]] = [
        (key, tuple(int(m) for m in key.split("-")), False) for key in index
    ]
    rank = int(rows[0][0]) if rows else -1
    cols = empty_columns(len(rows))
    cols["rank"][:] = rank
    cols["comm"][:] = [index[row[1]] for row in rows]
    cols["seq"][:] = [int(row[2]) for row in rows]
    cols["op"][:] = [OP_CODES[row[3]] for row in rows]
    cols["enqueue_ns"][:] = np.array([int(row[4]) for row in rows], dtype=np.int64) * scale
    cols["complete_ns"][:] = np.array([int(row[5]) for row in rows], dtype=np.int64) * scale
    info = RankInfo(
        rank, source=str(path), fmt="example-calls", has_completion=True, observed_until_ns=observed
    )
    return Parsed(RankCalls(rank, cols, comms, info))


READER = Reader(
    "example-calls", 1, lambda head: head.startswith(MAGIC), _parse, each_alone, settings=ExampleSettings
)
