"""The converter making Megatrace NCCL logs from our ring files (bench/ring_to_nccl_log.py), for scoring."""

from __future__ import annotations

import re
import sys
import tarfile
from pathlib import Path

from megatrace.analyzer import analyze

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

import ring_to_nccl_log as convert

LINE = re.compile(
    r"^\[save_count 1\] \[\d+\.\d{9}\] \[Rank (\d+)\] "
    r"Fun (AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|Send|Recv) Data \d+ "
    r"stream 0x[0-9a-f]+ opCount \d+( groupHash -?\d*)?$"
)


def test_converted_logs_have_the_documented_shape_and_read_as_the_run(tmp_path):
    with tarfile.open(Path(__file__).parents[1] / "fixtures" / "real_runs.tar.gz") as archive:
        archive.extractall(tmp_path, filter="data")
    ring_dir = next((tmp_path / "003-hang-p2p" / "trace").iterdir())
    written = convert.convert(ring_dir, tmp_path / "nccl")
    assert sorted(p.name for p in written) == [f"rank_{r}.log" for r in range(8)]
    for path in written:
        lines = path.read_text().splitlines()
        assert lines and all(len(line) <= convert.LINE_CUT and LINE.match(line) for line in lines)
        assert {LINE.match(line)[1] for line in lines} == {path.stem.split("_")[1]}
        assert any(" Fun Send " in line for line in lines) or any(" Fun Recv " in line for line in lines)
    report = analyze([tmp_path / "nccl"])
    assert report["inputs"]["files_by_format"] == {"nccl-log": 8}
    assert report["verdict"] == "hang" and report["suspects"][0]["rank"] == 0  # it stopped first


def test_transfers_get_a_split_communicators_hash_and_a_stream_per_neighbour():
    assert convert.group_hash(12345, p2p=True) == 0
    assert convert.group_hash(12345, p2p=False) == convert.group_hash(12345, p2p=False) != 0
    assert convert.stream_of(3, 99, 2) != convert.stream_of(3, 99, 4) != convert.stream_of(5, 99, 4)
