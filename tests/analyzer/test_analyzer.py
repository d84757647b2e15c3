"""Analyzer: readers (every format and malformation), layout arithmetic, detectors, report contract, CLI."""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import time

import numpy as np
import pytest

from megatrace.analyzer import analyze
from megatrace.analyzer.layout import LayoutConfig, LayoutError, resolve
from megatrace.analyzer.nccl_log import _fast_fields, parse_nccl_bytes
from megatrace.analyzer.progress import Progress
from megatrace.cli import main
from tests.support import scenarios as S

LINE = (
    "[save_count 5] [1755877674.248008482] [Rank 3] Fun AllReduce Data 25165824 stream 0x562a9d0b5020 "
    "opCount {n} groupHash -5956285979098587305"
)


def _write(trace, fmt, path):
    {"ring": S.write_ring_files, "nccl": S.write_nccl_logs, "fr": S.write_flight_recorder}[fmt](trace, path)
    return path


@pytest.mark.parametrize("fmt", ["ring", "nccl", "fr"])
def test_healthy_slow_hang_stuck_in_every_format(tmp_path, fmt):
    base = dict(world=16, tp=2, pp=2, steps=16)
    cases = {
        "healthy": S.Scenario(**base),
        "slow": S.Scenario(**base, slow={5: 0.2}, skew_ms={1: 4.0}),
        "hang": S.Scenario(**base, hang_rank=[6], hang_at=40),
        "stuck": S.Scenario(**base, stuck_at=40, stuck_rank=3),
    }
    for name, sc in cases.items():
        trace = S.simulate(sc)
        report = analyze([_write(trace, fmt, tmp_path / name)], LayoutConfig(tp=2, pp=2))
        expected = {"healthy": "healthy", "slow": "slow"}.get(name, "hang")
        assert report["verdict"] == expected, (name, report["suspects"])
        named = {s["rank"] for s in report["suspects"]}
        assert named == (trace.truth_slow if name == "slow" else trace.truth_hang), name
        if name == "stuck":  # every member entered, none completed: the communicator, not one rank
            assert {s["cause"] for s in report["suspects"]} == {"communication_stuck"}
            assert all(s["communicator"] == sorted(trace.truth_hang) for s in report["suspects"])
        if name == "hang":
            assert {s["cause"] for s in report["suspects"]} == {"rank_missing"}


def test_report_contract_and_positions(tmp_path):
    trace = S.simulate(S.Scenario(world=16, tp=2, pp=2, steps=12, hang_rank=[9], hang_at=30))
    report = analyze([_write(trace, "ring", tmp_path)], LayoutConfig(tp=2, pp=2))
    top = report["suspects"][0]
    assert report["verdict"] == "hang" and top["rank"] == 9 and top["kind"] == "hang"
    assert 0 < top["confidence"] <= 1 and top["evidence"].endswith(".") and top["host"] == "node1"
    assert top["coords"] == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}
    assert 9 not in report["victims"] and report["victims"]


def test_nccl_log_malformations(tmp_path):
    good = [LINE.format(n=i) for i in range(5)]
    raw = "\n".join(
        [good[0], "complete garbage", good[1], good[1], good[2].replace("AllReduce", "Frobnicate"), good[3],
         good[4][:40]]
    ).encode()  # fmt: skip
    log = parse_nccl_bytes(raw, "rank_3.log")
    assert log.rank == 3 and sorted(log.op_count.tolist()) == [0, 1, 3]
    assert log.duplicates == 1 and log.skipped == 3  # garbage, unknown op, cut final line
    no_hash = parse_nccl_bytes(
        b"[save_count 1] [1755590104.253968145] [Rank 0] Fun Recv Data 1 stream 0x5 opCount 0\n"
    )
    assert not no_hash.has_hash[0] and no_hash.op_count[0] == 0


def test_nccl_without_hash_zero_hash_and_truncated(tmp_path):
    trace = S.simulate(S.Scenario(world=16, tp=2, pp=2, steps=16, hang_rank=[6], hang_at=40))
    for mode in ("none", "zero", "truncated"):
        S.write_nccl_logs(trace, tmp_path / mode, group_hash=mode, duplicate_batches=True)
        report = analyze([tmp_path / mode], LayoutConfig(tp=2, pp=2))
        assert report["verdict"] == "hang" and report["suspects"][0]["rank"] == 6, mode


def test_bad_files_are_reported_not_fatal(tmp_path):
    trace = S.simulate(S.Scenario(world=8, tp=2, steps=12, slow={3: 0.3}))
    _write(trace, "nccl", tmp_path)
    (tmp_path / "empty.log").write_bytes(b"")
    (tmp_path / "junk.bin").write_bytes(b"\x00\x01garbage")
    (tmp_path / "nccl_trace_rank_99.pkl").write_bytes(pickle.dumps({"version": "2.5"}))
    with open(tmp_path / "rank_3.log", "a") as handle:
        handle.write("half a line [save_count")
    report = analyze([tmp_path, tmp_path / "missing"])
    assert report["verdict"] == "slow" and report["suspects"][0]["rank"] == 3
    ignored = report["inputs"]["ignored"]
    assert ignored[str(tmp_path / "empty.log")] == "empty file"
    assert ignored[str(tmp_path / "junk.bin")] == "unknown format"
    assert "unreadable" in ignored[str(tmp_path / "nccl_trace_rank_99.pkl")]
    assert ignored[str(tmp_path / "missing")] == "no such file or directory"
    assert report["inputs"]["lines_skipped"][str(tmp_path / "rank_3.log")] == 1


def test_logs_ending_at_different_saves_are_not_a_hang(tmp_path):
    trace = S.simulate(S.Scenario(world=8, tp=2, steps=20))
    S.write_nccl_logs(trace, tmp_path)
    path = tmp_path / "rank_2.log"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    report = analyze([tmp_path])
    assert report["verdict"] == "healthy" and report["notes"]


def test_layout_arithmetic():
    lay = resolve(LayoutConfig(world_size=16, tp=2, pp=2))
    assert lay.sizes["dp"] == 4 and lay.group(0, "tp") == (0, 1) and lay.group(0, "dp") == (0, 2, 4, 6)
    assert lay.group(1, "pp") == (1, 9) and lay.coords(13) == {"tp": 1, "cp": 0, "ep": 0, "dp": 2, "pp": 1}
    other = resolve(LayoutConfig(world_size=16, tp=2, pp=2, order="tp-cp-ep-pp-dp"))
    assert other.group(0, "pp") == (0, 2) and other.group(0, "dp") == (0, 4, 8, 12)
    with pytest.raises(LayoutError, match="not divisible"):
        resolve(LayoutConfig(world_size=12, tp=8))
    with pytest.raises(LayoutError, match="world size is 16"):
        resolve(LayoutConfig(world_size=16, tp=2, dp=3))
    with pytest.raises(LayoutError, match="unknown dimension"):
        resolve(LayoutConfig(world_size=16, order="tp-xx-dp-pp-ep"))


def test_cli_formats_layout_file_and_errors(tmp_path, capsys):
    trace = S.simulate(S.Scenario(world=8, tp=2, steps=12, hang_rank=[5], hang_at=20))
    logs = _write(trace, "fr", tmp_path / "logs")
    layout = tmp_path / "layout.yaml"
    layout.write_text("tp: 2\ngpus_per_node: 4\n")
    assert main(["analyze", str(logs), "--format", "json", "--layout", str(layout), "--quiet"]) == 1
    report = json.loads(capsys.readouterr().out)
    top = report["suspects"][0]
    # the dumps name no host: none is made up, and the layout's node shows in the position
    assert top["rank"] == 5 and "host" not in top and top["position"].startswith("node 1,")
    out = tmp_path / "trace.json"
    assert main(["analyze", str(logs), "--format", "chrome", "--output", str(out)]) == 1
    events = json.loads(out.read_text())["traceEvents"]
    assert any(e.get("name") == "suspect: hang" and e["tid"] == 5 for e in events)
    assert main(["analyze", str(logs)]) == 1 and capsys.readouterr().out.startswith("HANG: rank 5")
    assert main(["analyze", str(logs), "--tp", "3"]) == 2
    assert "not divisible" in capsys.readouterr().err
    layout.write_text("tp: 2\nbogus: 1\n")
    assert main(["analyze", str(logs), "--layout", str(layout)]) == 2
    assert "bogus" in capsys.readouterr().err


def test_fast_and_validating_nccl_parsers_agree(tmp_path):
    trace = S.simulate(S.Scenario(world=8, tp=2, steps=12))
    S.write_nccl_logs(trace, tmp_path, duplicate_batches=True)
    raw = (tmp_path / "rank_2.log").read_bytes()
    assert _fast_fields(raw) is not None and _fast_fields(raw + b"garbage\n") is None
    fast, checked = parse_nccl_bytes(raw, "rank_2.log"), parse_nccl_bytes(raw + b"garbage\n", "rank_2.log")
    assert (fast.rank, fast.skipped, checked.skipped) == (
        2,
        0,
        1,
    ) and fast.duplicates == checked.duplicates > 0
    for name in ("enqueue_ns", "op", "count", "stream", "op_count", "group_hash", "has_hash", "hash_digits"):
        assert np.array_equal(getattr(fast, name), getattr(checked, name)), name


def _flight_recorder_dump(path, rank, pg_config, entries):
    data = {"version": "2.5", "rank": rank, "pg_config": pg_config, "entries": entries}
    path.write_bytes(pickle.dumps(data))


def _entry(record_id, pg, seq, name, created_ns, done):
    return {
        "record_id": record_id,
        "pg_id": pg,
        "process_group": [pg, ""],
        "collective_seq_id": seq,
        "profiling_name": f"nccl:{name}",
        "time_created_ns": created_ns,
        "input_sizes": [[1024]],
        "input_dtypes": ["Float"],
        "state": "completed" if done else "started",
        "time_discovered_completed_ns": created_ns + 1000 if done else None,
    }


def test_flight_recorder_pickle_round_trip(tmp_path):
    trace = S.simulate(S.Scenario(world=8, tp=2, steps=12, hang_rank=[5], hang_at=20))
    S.write_flight_recorder(trace, tmp_path / "json")
    for path in sorted((tmp_path / "json").iterdir()):  # torch writes pickles by default
        (tmp_path / "pickle").mkdir(exist_ok=True)
        target = tmp_path / "pickle" / path.stem
        target.write_bytes(pickle.dumps(json.loads(path.read_text())))
        os.utime(target, ns=(path.stat().st_mtime_ns, path.stat().st_mtime_ns))
    from_json = analyze([tmp_path / "json"], LayoutConfig(tp=2))
    from_pickle = analyze([tmp_path / "pickle"], LayoutConfig(tp=2))
    assert from_pickle["inputs"]["files_by_format"] == {"flight-recorder": 8}
    assert from_pickle["suspects"] == from_json["suspects"] and from_pickle["suspects"][0]["rank"] == 5
    (tmp_path / "pickle" / "nccl_trace_rank_9").write_bytes(
        pickle.dumps({"version": "2.5", "entries": [Progress]})
    )
    report = analyze([tmp_path / "pickle"], LayoutConfig(tp=2))
    assert "refusing to load" in report["inputs"]["ignored"][str(tmp_path / "pickle" / "nccl_trace_rank_9")]


def test_deadlock_and_rank_without_log(tmp_path):
    old = time.time_ns() - 60_000_000_000
    pgs = {"a": {"ranks": "[0, 1]"}, "b": {"ranks": "[0, 1]"}}
    # rank 0 waits in a#2, which rank 1 never issued; rank 1 waits in b#1, which rank 0 never issued
    done = _entry(0, "a", 1, "all_reduce", old, True)
    _flight_recorder_dump(
        tmp_path / "nccl_trace_rank_0", 0, pgs, [done, _entry(1, "a", 2, "all_reduce", old, False)]
    )
    _flight_recorder_dump(
        tmp_path / "nccl_trace_rank_1", 1, pgs, [done, _entry(1, "b", 1, "broadcast", old, False)]
    )
    report = analyze([tmp_path])
    assert report["verdict"] == "hang" and {s["rank"] for s in report["suspects"]} == {0, 1}
    assert {s["cause"] for s in report["suspects"]} == {"deadlock"} and "deadlock" in report["suspects"][0][
        "evidence"
    ]

    lost = tmp_path / "lost"
    lost.mkdir()
    world = {"w": {"ranks": "[0, 1, 2, 3]"}}
    for rank in range(3):  # rank 3 left no file at all
        entries = [_entry(0, "w", 1, "all_reduce", old, True), _entry(1, "w", 2, "all_reduce", old, False)]
        _flight_recorder_dump(lost / f"nccl_trace_rank_{rank}", rank, world, entries)
    report = analyze([lost])
    top = report["suspects"][0]
    assert (report["verdict"], top["rank"], top["cause"]) == ("hang", 3, "no_log")
    assert report["victims"] == [0, 1, 2]


def test_progress_bar_and_quiet(tmp_path, capsys, monkeypatch):
    stream = io.StringIO()
    bar = Progress(3, "loading traces", True, stream)
    for _ in range(3):
        bar.advance()
    bar.close()
    assert "loading traces [" in stream.getvalue() and "(3/3)" in stream.getvalue()
    silent = io.StringIO()
    Progress(3, "loading traces", False, silent).advance(3)
    assert silent.getvalue() == ""

    _write(S.simulate(S.Scenario(world=8, tp=2, steps=12)), "ring", tmp_path)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["analyze", str(tmp_path)]) == 0
    assert "loading traces [" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_replayed_long_traces_stay_healthy(tmp_path):
    trace = S.simulate(S.Scenario(world=8, tp=2, steps=6))
    S.write_ring_files(trace, tmp_path, repeat=4)
    report = analyze([tmp_path], LayoutConfig(tp=2))
    assert report["verdict"] == "healthy" and report["records"] == 4 * len(trace.rank)


@pytest.mark.parametrize("fmt", ["ring", "nccl"])
def test_pipeline_neighbours_held_up_by_a_slow_stage_on_another_host_are_not_named(tmp_path, fmt):
    """Rank 12 (stage 1, second host) runs 100 % slower: its stage-0 neighbours 4 and 5 wait for its
    gradients and reach their data-parallel all-reduces late, level with each other. In ring files the
    cross-host pipeline channel shows them waiting; in NCCL logs (no transfers) the whole tensor-parallel
    pair is late together, so neither is named on that alone."""
    sc = S.Scenario(
        world=16, tp=2, pp=2, steps=12, jitter=0.03, seed=45, slow={12: 1.0}, skew_ms={0: 3.0, 1: 3.6}
    )
    report = analyze([_write(S.simulate(sc), fmt, tmp_path / fmt)], LayoutConfig(tp=2, pp=2))
    assert report["verdict"] == "slow"
    assert [s["rank"] for s in report["suspects"]] == [12]


def test_rings_without_a_collective_are_no_data_not_a_crash(tmp_path, capsys):
    """Every rank traced, none issued a collective yet (a job stopped in its set-up): nothing to judge."""
    from megatrace.tracer.ringfile import W_FINISHED, RankIdentity, RingWriter, ring_path

    for rank in range(4):
        identity = RankIdentity("idle", rank, rank, 4, "node-1", os.getpid(), time.time_ns())
        writer = RingWriter(ring_path(tmp_path / "idle", rank), identity, capacity=64, comm_table_bytes=4096)
        writer.header[W_FINISHED] = 1
        writer.close()
    assert main(["analyze", str(tmp_path), "--format", "json", "--quiet"]) == 3
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert (report["verdict"], report["suspects"], report["ranks_with_logs"]) == ("no-data", [], 4)
    assert "Traceback" not in err
    assert main(["analyze", str(tmp_path / "idle"), "--quiet"]) == 3
    text = capsys.readouterr().out
    assert text.startswith("NO DATA") and "no collective call" in text
