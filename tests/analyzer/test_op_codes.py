"""Every reader puts the tracer's op codes (`megatrace.tracer.format.OP_NAMES`) into the table."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from megatrace.analyzer.flight_recorder import _op as flight_recorder_op
from megatrace.analyzer.loader import load
from megatrace.analyzer.nccl_log import parse_nccl_bytes
from megatrace.tracer.format import OP_CODES, OP_GC, OP_NAMES, OP_OTHER, OP_PAUSE, P2P_OPS, op_name
from megatrace.tracer.pauses import Pauses
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import RankIdentity, RingWriter, comm_id, read_ring, ring_path
from tests.support import scenarios as S

WRITERS = {"ring": S.write_ring_files, "nccl": S.write_nccl_logs, "fr": S.write_flight_recorder}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_each_format_reads_into_the_tracers_op_codes(tmp_path: Path, fmt: str) -> None:
    trace = S.simulate(S.Scenario(world=8, tp=2, pp=2, steps=4))
    assert {op_name(int(code)) for code in trace.op} >= {"all_reduce", "send", "recv"}
    WRITERS[fmt](trace, tmp_path)
    table, _ = load([tmp_path])
    assert Counter(table["op"].tolist()) == Counter(trace.op.tolist())
    sends = table["op"] == OP_CODES["send"]
    assert sends.any() and all(table.comms[c].p2p for c in set(table["comm"][sends].tolist()))


def test_nccl_log_and_flight_recorder_names_map_through_the_one_table() -> None:
    line = b"[save_count 1] [1.000000001] [Rank 0] Fun Recv Data 4 stream 0x1 opCount 0 groupHash 5\n"
    assert parse_nccl_bytes(line, "rank_0.log").op.tolist() == [OP_CODES["recv"]]
    assert flight_recorder_op("nccl:all_gather") == OP_CODES["all_gather"] == 2
    assert flight_recorder_op("nccl:send 0->1") in P2P_OPS
    assert flight_recorder_op("nccl:_allgather_base") == OP_OTHER
    assert OP_OTHER not in OP_NAMES and op_name(OP_OTHER) == "other"
    assert {8, 9} == P2P_OPS


def test_a_flight_recorder_dump_without_a_known_op_reads_as_other(tmp_path: Path) -> None:
    entry = {"record_id": 0, "pg_id": 0, "process_group": ["0", "x"], "collective_seq_id": 1,
             "profiling_name": "nccl:mystery", "time_created_ns": 1, "state": "completed"}  # fmt: skip
    dump = {"version": "2.4", "rank": 0, "entries": [entry], "pg_config": {"0": {"ranks": "[0, 1]"}}}
    (tmp_path / "nccl_trace_rank_0.json").write_text(json.dumps(dump))
    table, _ = load([tmp_path])
    assert table["op"].tolist() == [OP_OTHER]


def test_pause_records_are_named_in_the_table_and_never_read_as_calls(tmp_path: Path) -> None:
    """A ring holds pause spans (op 13, version 3) and GC spans (op 14, version 4) between the
    collectives: the analyzer leaves them out,
    so both ranks' collectives match and no call appears on a communicator 0 or as "other"."""
    cid = comm_id((0, 1))
    for rank in (0, 1):
        identity = RankIdentity("j", rank, rank, 2, "h", 1, 1)
        writer = RingWriter(ring_path(tmp_path / "j", rank), identity, capacity=64, comm_table_bytes=4096)
        writer.add_communicator(cid, (0, 1))
        recorder = Recorder(writer, rank)
        pauses = Pauses(lambda recorder=recorder: recorder)
        for _ in range(3):
            if rank == 0:
                pauses.end(pauses.begin("dataloader"))
                recorder.record_span(OP_GC, 2, recorder.serial, 1, 5_000_001, nbytes=4000)
            recorder.end(recorder.begin(cid, OP_CODES["all_reduce"], 64, 1, -1, 0))
            recorder.mark_step()
        recorder.publish()
        writer.close()
    assert op_name(OP_PAUSE) == "pause" and OP_PAUSE not in OP_NAMES and OP_PAUSE != OP_OTHER
    ring = read_ring(ring_path(tmp_path / "j", 0))
    assert ring.records["op"].tolist().count(OP_PAUSE) == 3 and ring.records["op"].tolist().count(OP_GC) == 3
    assert op_name(OP_GC) == "gc" and OP_GC not in OP_NAMES and OP_GC != OP_OTHER
    table, _ = load([tmp_path / "j"])
    assert Counter(table["op"].tolist()) == Counter({OP_CODES["all_reduce"]: 6})
    assert {table.comms[c].key for c in set(table["comm"].tolist())} == {str(("comm", cid))}
