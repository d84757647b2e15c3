"""A window of one rank's ring file, cut out as a ring file of its own (the source's format version),
and the newest records of a stall dump, as a dump.

The node agent serves these to the alert bot: the window's file has the source's header (identity and
counters) with its geometry rewritten (capacity = the records in the window, a communicator table of
just the used bytes), so the analyzer's and tracer's readers take it as any ring file. Records are read
with the tracer's `read_ring` (slots caught mid-write are left out) and come oldest first.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from megatrace.regular_files import open_regular
from megatrace.tracer.ringfile import (
    HEADER_PAGE,
    HEADER_SIZE,
    W_CAPACITY,
    W_COMM_TABLE_OFFSET,
    W_COMM_TABLE_SIZE,
    W_COMM_TABLE_USED,
    W_RECORDS_OFFSET,
    W_VERSION,
    W_WRITER_FLAGS,
    WRITER_HOLDS_LOCK,
    RingFormatError,
    header_size_of,
    read_ring,
)


class WindowTooLarge(ValueError):
    """The window holds more records than the agent serves in one response."""


@dataclasses.dataclass(frozen=True)
class Window:
    """Which records to serve: the newest `last`, those after serial `after_serial`, and those enqueued
    in [`since_ns`, `until_ns`) plus any still in flight; every given bound applies."""

    last: int | None = None
    after_serial: int | None = None
    since_ns: int | None = None
    until_ns: int | None = None


def select(records: np.ndarray, window: Window) -> np.ndarray:
    """The records (oldest first) inside `window`."""
    keep = np.ones(len(records), dtype=bool)
    if window.after_serial is not None:
        keep &= records["serial"] > np.uint64(max(0, window.after_serial))
    if window.since_ns is not None:
        keep &= (records["enqueue_ns"] >= window.since_ns) | (records["complete_ns"] == 0)
    if window.until_ns is not None:
        keep &= records["enqueue_ns"] < window.until_ns
    chosen = records[keep]
    if window.last is not None:
        chosen = chosen[len(chosen) - min(len(chosen), max(0, window.last)) :]
    return chosen


def _raw_header_and_table(path: Path) -> tuple[bytearray, bytes]:
    fd = open_regular(path)
    try:
        header = bytearray(os.pread(fd, HEADER_SIZE, 0))
        if len(header) < HEADER_PAGE:
            raise RingFormatError(f"{path}: too short for a ring file header")
        size = header_size_of(int(np.frombuffer(header, dtype="<i8", count=HEADER_PAGE // 8)[W_VERSION]))
        if len(header) < size:
            raise RingFormatError(f"{path}: too short for a ring file header")
        del header[size:]
        words = np.frombuffer(header, dtype="<i8")
        used = max(0, min(int(words[W_COMM_TABLE_USED]), int(words[W_COMM_TABLE_SIZE])))
        table = os.pread(fd, used, int(words[W_COMM_TABLE_OFFSET]))
    finally:
        os.close(fd)
    return header, table


def ring_window(path: Path, window: Window, max_records: int, writer_alive: bool) -> tuple[bytes, int]:
    """The window of the ring file at `path` as ring file bytes, and its record count.

    `writer_alive` says whether the rank was running when read: a live rank's window carries no
    liveness-lock flag (its reader takes the trace as observed when it reads it); a dead one's keeps
    the flag, so a reader that finds no lock ends the trace at the rank's last sign of life.
    Raises WindowTooLarge past `max_records`, RingFormatError for a file that is no ring."""
    header, table = _raw_header_and_table(path)
    snapshot = read_ring(path)
    records = select(snapshot.records, window)
    if len(records) > max_records:
        raise WindowTooLarge(
            f"the window holds {len(records)} records, more than the {max_records} served at once; "
            "ask for fewer (last=, after_serial=, since_ns=, until_ns=)"
        )
    words = np.frombuffer(header, dtype="<i8").copy()
    table_size = (len(table) + 7) // 8 * 8
    words[W_CAPACITY] = len(records)
    words[W_COMM_TABLE_OFFSET] = len(header)
    words[W_COMM_TABLE_SIZE] = table_size
    words[W_COMM_TABLE_USED] = len(table)
    words[W_RECORDS_OFFSET] = len(header) + table_size
    if writer_alive:
        words[W_WRITER_FLAGS] &= ~WRITER_HOLDS_LOCK
    header[: len(words) * 8] = words.tobytes()
    body = b"".join([bytes(header), table.ljust(table_size, b"\0"), records.tobytes()])
    return body, len(records)


def dump_window(text: bytes, last: int | None) -> bytes:
    """A stall dump with only its newest `last` records (all when None): its ``#`` lines (magic,
    header, communicators, counters) stay, record lines are oldest first, so the tail is kept."""
    if last is None:
        return text
    lines = text.splitlines(keepends=True)
    head = [line for line in lines if line.startswith(b"#")]
    records = [line for line in lines if line.strip() and not line.startswith(b"#")]
    return b"".join(head + records[len(records) - min(len(records), max(0, last)) :])
