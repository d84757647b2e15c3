"""Ring file layout, writer, reader, communicator table and dump round trips (no torch)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest

from megatrace.tracer.dumpfile import DumpFormatError, dump_path, read_dump, write_dump
from megatrace.tracer.format import HEADER_PAGE
from megatrace.tracer.pauses import Pauses
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import (
    DTYPE_CODES,
    FLAG_ASYNC,
    OP_CODES,
    W_VERSION,
    CommCounters,
    RankIdentity,
    RingFormatError,
    RingWriter,
    comm_id,
    read_header,
    read_ring,
    ring_path,
    writer_holds_lock,
)
from megatrace.tracer.watchdog import Watchdog

IDENTITY = RankIdentity(
    job="job 7/α", rank=3, local_rank=1, world_size=8, host="node-3", pid=4242, start_time_ns=1_000
)

STALL_NS = 1_500_000_000


def counted(*durations: int) -> tuple[int, ...]:
    """The histogram of `durations`, bucket by bucket as docs/tracer-format.md defines them."""
    buckets = [0] * 22
    for duration in durations:
        buckets[min(max(duration.bit_length() - 20, 0), 21)] += 1
    return tuple(buckets)


def make_writer(tmp_path: Path, capacity: int = 16) -> RingWriter:
    return RingWriter(
        ring_path(tmp_path / "job", 3), IDENTITY, capacity, comm_table_bytes=4096, stall_threshold_ns=STALL_NS
    )


def test_comm_id_depends_only_on_member_set() -> None:
    assert comm_id([3, 1, 2]) == comm_id((1, 2, 3))
    assert comm_id([1, 2, 3]) != comm_id([1, 2, 4])
    assert 0 <= comm_id(range(1000)) < 2**63


def test_written_records_and_counters_read_back(tmp_path: Path) -> None:
    writer = make_writer(tmp_path)
    cid = comm_id([0, 1, 2, 3])
    assert writer.add_communicator(cid, (0, 1, 2, 3))
    rec = Recorder(writer, rank=3)
    first = rec.begin(cid, OP_CODES["all_reduce"], 64, DTYPE_CODES["float32"], -1, 0)
    rec.end(first)
    second = rec.begin(cid, OP_CODES["all_gather"], 32, DTYPE_CODES["bfloat16"], -1, FLAG_ASYNC)
    rec.mark_step()
    send = rec.begin(cid, OP_CODES["send"], 8, DTYPE_CODES["int64"], 1, 0)
    rec.publish()  # the watchdog's job, every tick

    snap = read_ring(tmp_path / "job" / "rank-3.trace")
    h = snap.header
    assert (h.version, h.job, h.rank, h.local_rank, h.world_size, h.host, h.pid) == (
        4, "job 7/α", 3, 1, 8, "node-3", 4242,
    )  # fmt: skip
    assert (h.capture, h.cuda_device, h.device_uuid) == ("", -1, "")
    took = int(snap.records["complete_ns"][0] - snap.records["enqueue_ns"][0])
    assert h.comm_counters == {
        cid: CommCounters(issued=3, completed=1, inflight_op="all_gather", inflight_seq=1,
                          inflight_enqueue_ns=int(snap.records["enqueue_ns"][1]), max_duration_ns=took,
                          histogram=counted(took), duration_sum_ns=took)
    }  # fmt: skip
    assert h.calls_by_op["all_reduce"] == 1 and h.calls_by_op["all_gather"] == 1
    assert h.bytes_by_op["all_reduce"] == 64 and h.bytes_by_op["send"] == 8
    assert h.oldest_inflight_op == "all_gather"
    assert h.oldest_inflight_enqueue_ns == int(snap.records["enqueue_ns"][1])
    assert h.step_count == 1 and h.last_step_ns > 0
    assert snap.records["enqueue_ns"][1] <= h.last_step_end_ns <= snap.records["enqueue_ns"][2]
    assert h.wait_ns_total == int(snap.records["complete_ns"][0] - snap.records["enqueue_ns"][0])
    assert not h.finished and h.stall_threshold_ns == STALL_NS
    assert snap.communicators == {cid: (0, 1, 2, 3)}
    r = snap.records
    assert list(r["serial"]) == [first, second, send]
    assert list(r["op"]) == [OP_CODES["all_reduce"], OP_CODES["all_gather"], OP_CODES["send"]]
    assert list(r["seq"]) == [0, 1, 0]
    assert list(r["step"]) == [0, 0, 1]
    assert list(r["peer"]) == [-1, -1, 1]
    assert list(r["rank"]) == [3, 3, 3]
    assert r["complete_ns"][0] >= r["enqueue_ns"][0] > 0 and r["complete_ns"][1] == 0
    assert r["flags"][1] == FLAG_ASYNC and r["dtype"][1] == DTYPE_CODES["bfloat16"]
    assert all(r["comm_id"] == cid)

    rec.end(second)
    rec.publish()
    h = read_header(tmp_path / "job" / "rank-3.trace")
    assert h.oldest_inflight_op == "send"
    assert (h.comm_counters[cid].completed, h.comm_counters[cid].inflight_op) == (2, "send")
    rec.end(send)
    rec.publish()
    h = read_header(tmp_path / "job" / "rank-3.trace")
    assert (h.oldest_inflight_op, h.oldest_inflight_enqueue_ns) == ("", 0)
    r = read_ring(tmp_path / "job" / "rank-3.trace").records
    durations = [int(d) for d in r["complete_ns"] - r["enqueue_ns"]]
    assert h.comm_counters[cid] == CommCounters(
        issued=3, completed=3, max_duration_ns=max(durations), histogram=counted(*durations),
        duration_sum_ns=sum(durations),
    )  # fmt: skip


def as_older_version(path: Path, version: int) -> Path:
    """The file a version 1 or 2 writer would have written with the same contents as the version 3 ring
    at `path`: the first page is the whole header (version and header size words set, word 31 and
    counter word 7 zero), the communicator table and the records follow at once. Written next to it."""
    raw = bytearray(path.read_bytes())
    words = np.frombuffer(raw, dtype="<i8", count=HEADER_PAGE // 8).copy()
    table_offset, records_offset = int(words[5]), int(words[7])
    words[W_VERSION], words[2], words[31] = version, HEADER_PAGE, 0
    words[5], words[7] = HEADER_PAGE, HEADER_PAGE + records_offset - table_offset
    words[192 + 7 :: 8] = 0  # the counter entries' word 7, reserved before version 3
    old = path.with_name(f"v{version}-{path.name}")
    old.write_bytes(words.tobytes() + bytes(raw[table_offset:]))
    return old


def test_version_1_and_2_files_are_read_and_unknown_versions_refused(tmp_path: Path) -> None:
    writer = make_writer(tmp_path)
    writer.set_capture("native")
    writer.set_device(3, "GPU-5d7b")
    cid = comm_id([0, 3])
    writer.add_communicator(cid, (0, 3))
    rec = Recorder(writer, rank=3)
    rec.end(rec.begin(cid, OP_CODES["all_reduce"], 64, DTYPE_CODES["float32"], -1, 0))
    pauses = Pauses(lambda: rec)
    pauses.end(pauses.begin("eval"))
    rec.publish()
    new = read_ring(writer.path)
    assert new.header.pauses["eval"].ended == 1 and sum(new.header.comm_counters[cid].histogram) == 1
    v2 = read_ring(as_older_version(writer.path, 2))
    assert v2.header.version == 2 and (v2.header.capture, v2.header.device_uuid) == ("native", "GPU-5d7b")
    assert v2.header.comm_counters == {cid: CommCounters(issued=1, completed=1)}
    assert (v2.header.pauses, v2.header.pause_kind) == ({}, "")
    assert v2.records.tolist() == new.records.tolist() and v2.communicators == new.communicators
    assert read_header(tmp_path / "job" / "v2-rank-3.trace").comm_counters == v2.header.comm_counters
    old = read_header(as_older_version(writer.path, 1))
    assert (old.version, old.capture, old.cuda_device, old.device_uuid, old.comm_counters) == (
        1,
        "",
        -1,
        "",
        {},
    )
    writer.header[W_VERSION] = 5
    with pytest.raises(RingFormatError, match="ring format version 5 is not supported"):
        read_ring(writer.path)


def test_ring_wraps_and_keeps_newest_in_order(tmp_path: Path) -> None:
    writer = make_writer(tmp_path, capacity=5)
    rec = Recorder(writer, rank=3)
    for _ in range(12):
        rec.end(rec.begin(7, OP_CODES["broadcast"], 4, 1, -1, 0))
    rec.publish()
    snap = read_ring(writer.path)
    assert list(snap.records["serial"]) == [8, 9, 10, 11, 12]
    assert list(snap.records["seq"]) == [7, 8, 9, 10, 11]
    assert snap.header.calls_by_op["broadcast"] == 12 and snap.header.records_written == 12


def test_torn_slot_is_skipped(tmp_path: Path) -> None:
    writer = make_writer(tmp_path)
    rec = Recorder(writer, rank=3)
    for _ in range(3):
        rec.begin(7, OP_CODES["all_reduce"], 4, 1, -1, 0)
    writer.rec_q[1 * 9] = 0  # slot 1 caught between "serial = 0" and the commit write
    assert list(read_ring(writer.path).records["serial"]) == [1, 3]


def test_p2p_sequence_counts_per_peer_and_direction(tmp_path: Path) -> None:
    rec = Recorder(make_writer(tmp_path), rank=3)
    for op, peer in [("send", 1), ("send", 2), ("recv", 1), ("send", 1), ("all_reduce", -1)]:
        rec.begin(7, OP_CODES[op], 4, 1, peer, 0)
    assert list(read_ring(rec.writer.path).records["seq"]) == [0, 0, 0, 1, 0]


def test_full_communicator_table_refuses_more(tmp_path: Path) -> None:
    writer = make_writer(tmp_path)
    assert writer.add_communicator(1, tuple(range(1000)))
    assert not writer.add_communicator(2, tuple(range(100)))
    assert read_ring(writer.path).communicators == {1: tuple(range(1000))}


def _hammer(path: str, stop_after: int) -> None:
    writer = RingWriter(Path(path), IDENTITY, capacity=64, comm_table_bytes=4096)
    rec = Recorder(writer, rank=3)
    for _ in range(stop_after):
        rec.end(rec.begin(7, OP_CODES["all_reduce"], 16, 1, -1, 0))
    writer.header[22] = 1


def test_reader_sees_consistent_records_while_another_process_writes(tmp_path: Path) -> None:
    path = tmp_path / "rank-3.trace"
    proc = multiprocessing.get_context("spawn").Process(target=_hammer, args=(str(path), 200_000))
    proc.start()
    try:
        reads = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not path.exists():
                continue
            snap = read_ring(path)
            serials = snap.records["serial"].astype(np.int64)
            assert np.all(np.diff(serials) > 0)
            assert np.all(snap.records["seq"] == serials - 1)
            assert np.all(snap.records["nbytes"] == 16)
            reads += 1
            if snap.header.finished:
                break
        assert snap.header.finished and reads > 1
    finally:
        proc.join(30)


def test_dump_round_trip(tmp_path: Path) -> None:
    writer = make_writer(tmp_path)
    cid = comm_id([0, 3])
    writer.add_communicator(cid, (0, 3))
    rec = Recorder(writer, rank=3)
    rec.end(rec.begin(cid, OP_CODES["reduce_scatter"], 128, DTYPE_CODES["float16"], -1, 0))
    rec.begin(cid, OP_CODES["recv"], 8, DTYPE_CODES["int32"], 0, FLAG_ASYNC)
    pauses = Pauses(lambda: rec)
    pauses.end(pauses.begin("dataloader"))
    pauses.begin("checkpoint")
    rec.publish()
    snap = read_ring(writer.path)
    assert snap.header.pause_kind == "checkpoint" and snap.header.pauses["checkpoint"].since_ns > 0
    path = write_dump(dump_path(tmp_path, 3, 4242, 0), snap, "stall", taken_ns=99)
    assert path.name == "rank-3.4242.0.dump"
    text = path.read_text()
    assert "op=recv" in text and "state=inflight" in text and "state=completed" in text
    assert "# pause_kind=checkpoint" in text and "op=pause kind=dataloader" in text
    back = read_dump(path)
    assert back.header == snap.header
    assert back.communicators == snap.communicators
    assert back.records.dtype == snap.records.dtype
    assert back.records.tolist() == snap.records.tolist()
    assert (back.reason, back.taken_ns) == ("stall", 99)


def test_writer_holds_its_lock_until_closed(tmp_path: Path) -> None:
    writer = make_writer(tmp_path)
    assert read_header(writer.path).writer_locks
    assert writer_holds_lock(writer.path) is True
    writer.close()
    assert writer_holds_lock(writer.path) is False
    assert writer_holds_lock(tmp_path / "absent.trace") is None


def test_threshold_is_unknown_in_files_and_dumps_from_writers_that_lack_it(tmp_path: Path) -> None:
    old = RingWriter(tmp_path / "rank-0.trace", IDENTITY, capacity=4, comm_table_bytes=4096)
    assert read_header(old.path).stall_threshold_ns == 0
    path = write_dump(tmp_path / "d.dump", read_ring(make_writer(tmp_path).path), "exit")
    assert read_dump(path).header.stall_threshold_ns == STALL_NS
    path.write_text(path.read_text().replace(f" stall_threshold_ns={STALL_NS}", ""))
    assert read_dump(path).header.stall_threshold_ns == 0


def test_dump_keeps_newest_records_only(tmp_path: Path) -> None:
    rec = Recorder(make_writer(tmp_path), rank=3)
    for _ in range(10):
        rec.begin(7, OP_CODES["barrier"], 0, 0, -1, 0)
    path = write_dump(tmp_path / "d.dump", read_ring(rec.writer.path), "signal", max_records=4)
    assert list(read_dump(path).records["serial"]) == [7, 8, 9, 10]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("hello\n", "not a Megatrace dump"),
        ("# megatrace-dump version=9\n", "version 9"),
        ("# megatrace-dump version=1\n# job=x\n", "missing rank"),
    ],
)
def test_bad_dumps_are_named_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.dump"
    path.write_text(content)
    with pytest.raises(DumpFormatError, match=message):
        read_dump(path)


def test_bad_record_line_names_line(tmp_path: Path) -> None:
    rec = Recorder(make_writer(tmp_path), rank=3)
    rec.begin(7, OP_CODES["barrier"], 0, 0, -1, 0)
    path = write_dump(tmp_path / "d.dump", read_ring(rec.writer.path), "exit")
    path.write_text(path.read_text().replace("seq=0", "seq=zero"))
    with pytest.raises(DumpFormatError, match=r"d\.dump:\d+: seq= is not an integer"):
        read_dump(path)


@pytest.mark.parametrize("content", [b"", b"x" * 5000, b"MEGATRC\x00" + b"\x00" * 5000])
def test_bad_ring_files_are_named_errors(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "rank-0.trace"
    path.write_bytes(content)
    with pytest.raises(RingFormatError, match=r"rank-0\.trace"):
        read_ring(path)


def test_missing_ring_file_is_named_error(tmp_path: Path) -> None:
    with pytest.raises(RingFormatError, match="cannot read"):
        read_ring(tmp_path / "nope.trace")


def test_a_stall_dump_written_during_a_pause_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer = make_writer(tmp_path)
    rec = Recorder(writer, rank=3)
    rec.begin(comm_id([0, 3]), OP_CODES["all_reduce"], 4, DTYPE_CODES["float32"], -1, 0)
    dog = Watchdog(rec, tmp_path / "job", 3, STALL_NS)
    pauses = Pauses(lambda: rec)
    quiet = read_dump(dog.dump("stall"))
    token = pauses.begin("checkpoint")
    with caplog.at_level("WARNING", logger="megatrace.tracer"):
        during = read_dump(dog.dump("stall"))
    pauses.end(token)
    assert quiet.header.pause_kind == "" and during.header.pause_kind == "checkpoint"
    assert during.header.pauses["checkpoint"].since_ns > 0
    assert "during a checkpoint pause" in caplog.text
    writer.close()
