"""The ring format's one definition (`megatrace.tracer.format`): the on-disk bytes it gives, the C++ header
generated from it, and the native library's check against it."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from megatrace.tracer import format as ring_format
from megatrace.tracer import native
from megatrace.tracer.pauses import Pauses
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import RankIdentity, RingWriter, comm_id, read_ring

IDENTITY = RankIdentity(job="j", rank=2, local_rank=2, world_size=4, host="h", pid=77, start_time_ns=5)


def test_a_ring_file_has_the_documented_bytes(tmp_path: Path) -> None:
    """Offsets and codes as docs/tracer-format.md gives them, written out here: files written before
    the format had one definition read the same, and any change to the definition fails here."""
    path = tmp_path / "rank-2.trace"
    writer = RingWriter(path, IDENTITY, capacity=4, comm_table_bytes=4096)
    cid = comm_id((0, 2))
    writer.add_communicator(cid, (0, 2))
    recorder = Recorder(writer, rank=2)
    recorder.end(recorder.begin(cid, 8, 16, 9, 0, 1))  # send 16 bytes of int64 to rank 0, async
    pauses = Pauses(lambda: recorder)
    token = pauses.begin("checkpoint")
    in_pause = struct.unpack_from("<q", writer.header.tobytes(), 31 * 8)[0]
    pauses.end(token)
    recorder.publish()
    writer.close()
    raw = path.read_bytes()
    words = struct.unpack_from("<1536q", raw)
    assert raw[:8] == b"MEGATRC\x00"
    assert (words[1], words[2], words[3], words[4], words[8], words[9], words[10], words[11]) == (
        4, 28672, 72, 4, 2, 2, 4, 77,
    )  # fmt: skip
    assert words[5] == 28672  # the communicator table follows the seven-page header
    assert raw[768:769] == b"j" and raw[1024:1025] == b"h"
    assert words[32 + 8] == 1 and words[64 + 8] == 16  # calls and bytes of op 8 (send)
    record = raw[words[7] : words[7] + 72]
    serial, record_cid, seq, nbytes = struct.unpack_from("<QQqQ", record)
    rank, peer, op, dtype, flags = struct.unpack_from("<iiBBB", record, 56)
    assert (serial, record_cid, seq, nbytes, rank, peer, op, dtype, flags) == (1, cid, 0, 16, 2, 0, 8, 9, 1)
    enqueue_ns, complete_ns = struct.unpack_from("<qq", record, 32)
    assert 0 < enqueue_ns <= complete_ns
    # version 3: the communicator's entry (byte 1536), its longest op in word 7, its histogram at byte
    # 4352 (bucket b: duration of bit length 20 + b, clamped to 0..21) with the sum in word 22
    took = complete_ns - enqueue_ns
    assert words[192] == cid and words[192 + 7] == took
    histogram = words[544 : 544 + 22]
    bucket = min(max(took.bit_length() - 20, 0), 21)
    assert sum(histogram) == 1 and histogram[bucket] == 1 and words[544 + 22] == took
    # the pause: word 31 named kind 1 (checkpoint) while it lasted; its entry at byte 4096 (since,
    # ended, total) and a record with op 13, peer = the kind, seq 0, communicator 0
    assert in_pause == 1 and words[31] == 0
    since, ended, total = words[512 : 512 + 3]
    assert (since, ended) == (0, 1) and total >= 0
    pause = raw[words[7] + 72 : words[7] + 144]
    serial, pause_cid, pause_seq, _ = struct.unpack_from("<QQqQ", pause)
    _, pause_peer, pause_op = struct.unpack_from("<iiB", pause, 56)
    start_ns, end_ns = struct.unpack_from("<qq", pause, 32)
    assert (serial, pause_cid, pause_seq, pause_peer, pause_op) == (2, 0, 0, 1, 13)
    assert end_ns - start_ns == total and words[32 + 13] == 1
    assert read_ring(path).records["op"].tolist() == [ring_format.OP_CODES["send"], ring_format.OP_PAUSE]


def test_the_record_dtype_and_the_writer_struct_agree() -> None:
    from megatrace.tracer.ringfile import RECORD_STRUCT

    values = (0, 2**62, 3, 4096, 10, 20, 7, 5, -1, 2, 1, 3)
    buffer = bytearray(ring_format.RECORD_SIZE)
    RECORD_STRUCT.pack_into(buffer, 0, *values)
    record = np.frombuffer(bytes(buffer), dtype=ring_format.RECORD_DTYPE)[0]
    assert tuple(int(record[name]) for name, _, _ in ring_format.RECORD_FIELDS) == values


def test_the_generated_header_holds_every_constant_with_its_value() -> None:
    header = ring_format.cpp_header()
    found = dict(re.findall(r'\{"([A-Z0-9_]+)", static_cast<int64_t>\((.+?)\)\}', header))
    assert set(found) == set(ring_format.native_layout())
    defined = {name: int(value) for name, value in re.findall(r"constexpr \w+ (k\w+) = (\d+);", header)}
    for name, value in ring_format.layout_constants().items():
        assert defined[found[name]] == value, name
    assert "kWStepCount = 19;" in header and "kFlagProcessGroup = 2;" in header
    assert "kSend = 8" in header and "kDtypeBfloat16 = 3;" in header
    assert "static_assert(offsetof(Record, op) == 64" in header


def test_every_module_constant_is_in_the_layout() -> None:
    constants = ring_format.layout_constants()
    for name in dir(ring_format):
        if name.isupper() and type(getattr(ring_format, name)) is int:
            assert constants[name] == getattr(ring_format, name)
    assert len(constants) >= 50


@pytest.mark.parametrize("name", sorted(ring_format.native_layout()))
def test_a_library_that_differs_in_any_one_constant_is_refused(name: str) -> None:
    """Each of the constants, codes and record offsets is compared, not a dozen of them."""
    layout = ring_format.native_layout()
    layout[name] += 1
    assert native.layout_differences(SimpleNamespace(layout=lambda: layout)) == [name]  # type: ignore[arg-type]
    del layout[name]
    assert native.layout_differences(SimpleNamespace(layout=lambda: layout)) == [name]  # type: ignore[arg-type]


def test_the_native_library_reports_the_python_layout(native_module: ModuleType) -> None:
    assert native_module.layout() == ring_format.native_layout()
    assert native.layout_differences(native_module) == []


def test_the_native_build_folder_changes_with_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library built from another layout is never found in the cache under this one's key."""
    before = native.build_dir()
    monkeypatch.setattr(ring_format, "W_STEP_COUNT", ring_format.W_STEP_COUNT + 1)
    assert native.build_dir() != before
