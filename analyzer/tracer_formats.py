"""Our tracer's ring files, stall dumps and stacks files, read with the tracer's own format definitions
and readers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from megatrace.analyzer.layout import Layout
from megatrace.analyzer.reader_api import Parsed, Reader, each_alone
from megatrace.analyzer.table import RankCalls, RankInfo, RankStacks, empty_columns
from megatrace.regular_files import open_regular
from megatrace.tracer.dumpfile import DUMP_MAGIC, read_dump
from megatrace.tracer.format import OP_CODES, OP_NAMES, OP_OTHER, P2P_OPS, SPAN_NAMES, W_MAGIC
from megatrace.tracer.ringfile import (
    HEADER_SIZE,
    MAGIC,
    MAX_OPS,
    RECORD_DTYPE,
    W_CALLS_BY_OP,
    W_CAPACITY,
    W_COMM_COUNT,
    W_COMM_TABLE_OFFSET,
    W_COMM_TABLE_SIZE,
    W_COMM_TABLE_USED,
    W_RECORDS_OFFSET,
    RingFormatError,
    RingSnapshot,
    header_of,
    parse_comm_table,
    read_ring,
    writer_holds_lock,
)
from megatrace.tracer.stack_fallback import STACKS_MAGIC, read_stacks_file

# a record's op byte -> the table's op code: the same code, "other" for a byte the table lacks
_OP_MAP = np.full(256, OP_OTHER, dtype=np.uint8)
_OP_MAP[list(OP_NAMES)] = list(OP_NAMES)


def read_ring_file(path: Path) -> RingSnapshot:
    """A ring file's snapshot, by plain reads where possible: the records in one `np.fromfile`, which
    costs a fraction of the tracer's memory-mapped `read_ring`. When the rank appended records while
    they were being read (the call counters in the header moved), the tracer's `read_ring`, which skips
    slots caught mid-write, reads the file instead; so does it for anything unexpected in the header,
    and reports it. One open and one header parse a file: at 4,096 ranks each costs seconds."""
    try:
        with open(open_regular(path), "rb") as handle:
            raw = handle.read(HEADER_SIZE)
            words = np.frombuffer(raw, dtype="<i8") if len(raw) == HEADER_SIZE else None
            if words is None or words[W_MAGIC] != np.frombuffer(MAGIC, dtype="<i8")[0]:
                return read_ring(path)
            capacity = int(words[W_CAPACITY])
            handle.seek(int(words[W_COMM_TABLE_OFFSET]))
            table = handle.read(min(int(words[W_COMM_TABLE_USED]), int(words[W_COMM_TABLE_SIZE])))
            handle.seek(int(words[W_RECORDS_OFFSET]))
            records = np.fromfile(handle, dtype=RECORD_DTYPE, count=max(capacity, 0))
            taken_ns = time.time_ns()
            again = os.pread(handle.fileno(), HEADER_SIZE, 0)
    except OSError as exc:
        raise RingFormatError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    calls = slice(W_CALLS_BY_OP * 8, (W_CALLS_BY_OP + MAX_OPS) * 8)
    if again[calls] != raw[calls] or len(records) != capacity:
        return read_ring(path)
    after = header_of(path, again)
    serial = records["serial"]
    if not serial.all():
        records = records[serial != 0]
        serial = records["serial"]
    if len(serial) > 1 and not bool((serial[1:] > serial[:-1]).all()):
        records = records[np.argsort(serial, kind="stable")]
    communicators = parse_comm_table(table, int(words[W_COMM_COUNT]))
    return RingSnapshot(header=after, records=records, communicators=communicators, taken_ns=taken_ns)


def factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, uniques) with uniques in order of first appearance, as pandas' ``factorize`` gives them
    (pandas is not imported for this: it would add ~40 MiB to every analyzer run)."""
    uniques, first, inverse = np.unique(values, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    code_of = np.empty(len(order), dtype=np.int64)
    code_of[order] = np.arange(len(order))
    return code_of[inverse.reshape(-1)], uniques[order]


def snapshot_calls(snapshot: RingSnapshot, path: str, fmt: str) -> RankCalls:
    """Columns of one rank's snapshot; P2P ops go to directed channels ``(comm, src, dst)``. Records
    that are no op (pause spans) are left out: they are never matched as calls."""
    rec = snapshot.records
    spans = np.isin(rec["op"], list(SPAN_NAMES))
    span_rows = rec[spans]
    if spans.any():
        rec = rec[~spans]
    header = snapshot.header
    rank = header.rank
    ops = _OP_MAP[rec["op"]]
    cols = empty_columns(
        len(rec),
        rank=np.full(len(rec), rank, dtype=np.int32),
        seq=rec["seq"],
        op=ops,
        nbytes=rec["nbytes"],
        enqueue_ns=rec["enqueue_ns"],
        complete_ns=rec["complete_ns"],
    )
    comms: list[tuple[object, tuple[int, ...], bool]] = []
    is_p2p = np.isin(ops, list(P2P_OPS)) & (rec["peer"] >= 0)
    cid_index, cids = factorize(rec["comm_id"])
    cid_index = cid_index.astype(np.int64)
    if is_p2p.any():
        # one int64 key per (communicator, direction): collectives keep their communicator's index,
        # sends and receives get a directed channel src->dst
        is_send = ops == OP_CODES["send"]
        src = np.where(is_send, rank, rec["peer"]).astype(np.int64)
        dst = np.where(is_send, rec["peer"], rank).astype(np.int64)
        width = int(max(rank, int(rec["peer"].max()))) + 1
        channel = len(cids) + (cid_index * width + src) * width + dst
        inverse, keys = factorize(np.where(is_p2p, channel, cid_index))
    else:
        keys, inverse = np.arange(len(cids)), cid_index
    for key in keys.tolist():
        if key < len(cids):
            cid = int(cids[key])
            comms.append((("comm", cid), snapshot.communicators.get(cid, ()), False))
        else:
            ci, rest = divmod(key - len(cids), width * width)
            s, d = divmod(rest, width)
            comms.append((("p2p", int(cids[ci]), s, d), tuple(sorted({s, d})), True))
    cols["comm"] = np.asarray(inverse, dtype=np.int32)
    info = RankInfo(
        rank=rank,
        host=header.host,
        job=header.job,
        source=path,
        fmt=fmt,
        has_completion=True,
        finished=header.finished,
        observed_until_ns=snapshot.taken_ns,
        host_samples=header.host_samples,
        spans=span_rows,
        stacks=snapshot.stacks,
    )
    return RankCalls(rank, cols, comms, info)


def _parse_ring(path: Path, _settings: None) -> Parsed:
    snapshot = read_ring_file(path)
    calls = snapshot_calls(snapshot, str(path), "ring")
    if snapshot.header.writer_locks and not writer_holds_lock(path):
        # the writer is gone: the trace ends at the rank's last sign of life, not at the time of reading
        # (a writer that keeps no lock cannot be told alive or dead: its trace is taken as of now)
        header, rec = snapshot.header, snapshot.records
        last = [header.last_enqueue_ns, header.last_complete_ns, header.last_step_end_ns]
        last.append(header.start_time_ns)
        if len(rec):
            last += [int(rec["enqueue_ns"].max()), int(rec["complete_ns"].max())]
        calls.info.observed_until_ns = max(last)
    else:
        calls.info.observed_live = True
    return Parsed(calls)


def _parse_dump(path: Path, _settings: None) -> Parsed:
    return Parsed(snapshot_calls(read_dump(path), str(path), "dump"))


def _parse_stacks(path: Path, _settings: None) -> Parsed:
    """A stacks file (faulthandler's output when the watchdog could not run), dated by its last change."""
    found = read_stacks_file(path)
    return Parsed(RankStacks(found.rank, found.job, path.stat().st_mtime_ns, found.stacks))


def no_calls(_items: list[RankStacks], _layout: Layout | None) -> list[RankCalls]:
    """`resolve` of a format that holds stacks, no calls (the loader hands the stacks to the ranks)."""
    return []


RING = Reader("ring", 3, lambda head: head.startswith(MAGIC), _parse_ring, each_alone)
DUMP = Reader("dump", 2, lambda head: head.startswith(DUMP_MAGIC.encode()), _parse_dump, each_alone)
STACKS = Reader("stacks", 0, lambda head: head.startswith(STACKS_MAGIC.encode()), _parse_stacks, no_calls)
