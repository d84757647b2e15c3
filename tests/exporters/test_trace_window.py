"""A stall dump cut to its newest records by the agent keeps every thread's stack."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

from megatrace.exporters.trace_window import dump_window
from megatrace.tracer.dumpfile import read_dump, write_dump
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import (
    DTYPE_CODES,
    OP_CODES,
    RankIdentity,
    RingWriter,
    comm_id,
    read_ring,
    ring_path,
)
from megatrace.tracer.stacks import capture_stacks, gc_paused


def test_a_dump_window_keeps_the_stack_lines(tmp_path: Path) -> None:
    identity = RankIdentity("window", 1, 0, 2, "node-1", os.getpid(), 1)
    writer = RingWriter(ring_path(tmp_path, 1), identity, 16, comm_table_bytes=4096)
    cid = comm_id([0, 1])
    writer.add_communicator(cid, (0, 1))
    rec = Recorder(writer, rank=1)
    for _ in range(5):
        rec.end(rec.begin(cid, OP_CODES["all_reduce"], 8, DTYPE_CODES["float32"], -1, 0))
    rec.begin(cid, OP_CODES["broadcast"], 8, DTYPE_CODES["float32"], 0, 0)
    rec.publish()
    release = threading.Event()
    helper = threading.Thread(target=release.wait, name="window-helper")
    helper.start()
    try:
        with gc_paused():
            stacks = capture_stacks()
    finally:
        release.set()
        helper.join()
    snapshot = dataclasses.replace(read_ring(writer.path), stacks=stacks)
    full = write_dump(tmp_path / "rank-1.1.0.dump", snapshot, "stall")
    cut = tmp_path / "cut.dump"
    cut.write_bytes(dump_window(full.read_bytes(), 2))
    back = read_dump(cut)
    assert back.stacks == stacks and any(stack.name == "window-helper" for stack in back.stacks)
    assert list(back.records["serial"]) == [5, 6]
    assert "in_flight=broadcast" in cut.read_text()
    writer.close()
