"""The tracer in real multi-process gloo jobs (world size 4, TP and DP subgroups made with new_group)."""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from megatrace.analyzer.frames import where_stuck
from megatrace.tracer.dumpfile import read_dump
from megatrace.tracer.format import OP_GC, SPAN_NAMES
from megatrace.tracer.host_signals import resolve_cgroup
from megatrace.tracer.ringfile import (
    FLAG_ASYNC,
    FLAG_PROCESS_GROUP,
    OP_NAMES,
    RingSnapshot,
    comm_id,
    ops_only,
    read_header,
    read_ring,
)
from tests.support.gloo_job import run_traced_job, start_traced_job, trace_under_torchrun
from tests.support.waiting import wait_for
from tests.tracer import ops_job

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
GROUPS = {
    ops_job.WORLD: lambda rank: (0, 1, 2, 3),
    ops_job.PAIRS: lambda rank: (rank // 2 * 2, rank // 2 * 2 + 1),
    ops_job.EVEN_ODD: lambda rank: (rank % 2, rank % 2 + 2),
}


def rings(job_dir: Path, world: int = 4) -> dict[int, RingSnapshot]:
    return {rank: read_ring(job_dir / f"rank-{rank}.trace") for rank in range(world)}


def assert_collectives_line_up(snaps: dict[int, RingSnapshot], cut_short: bool = False) -> int:
    """Every (comm, seq) collective has one record per member rank, same op and bytes; returns count.

    With `cut_short` (a killed job) members may lack the newest collectives; the rest must agree.
    """
    seen: dict[tuple[int, int], dict[int, tuple[int, int]]] = defaultdict(dict)
    for rank, snap in snaps.items():
        for row in snap.records:
            if int(row["op"]) in SPAN_NAMES or OP_NAMES[int(row["op"])] in ("send", "recv"):
                continue  # a pause span (the job's data loader), a GC span or a point-to-point op
            key = (int(row["comm_id"]), int(row["seq"]))
            assert rank not in seen[key], f"rank {rank} recorded {key} twice"
            seen[key][rank] = (int(row["op"]), int(row["nbytes"]))
    for (cid, seq), by_rank in seen.items():
        members = snaps[next(iter(by_rank))].communicators[cid]
        assert comm_id(members) == cid
        if cut_short:
            assert set(by_rank) <= set(members), f"comm {cid} seq {seq}: ranks {sorted(by_rank)}"
        else:
            assert sorted(by_rank) == list(members), f"comm {cid} seq {seq}: ranks {sorted(by_rank)}"
        assert len(set(by_rank.values())) == 1, f"comm {cid} seq {seq}: {by_rank}"
    return len(seen)


ROOTS = {"broadcast": 1, "reduce": 2, "gather": 0, "scatter": 3}


def expected_records(rank: int) -> list[tuple[str, tuple[int, ...], int, int, bool | None]]:
    """(op, members, nbytes, peer, async) of each record rank `rank` should have from ops_job."""
    expected = []
    for op, group, nbytes, is_async in ops_job.CALLS:
        members = GROUPS[group](rank)
        other = members[1] if members[0] == rank else members[0]
        if op == "send_recv":
            expected.append(("send" if rank % 2 == 0 else "recv", members, nbytes, other, None))
        elif op == "isend_irecv":
            expected.append(("send" if rank < 2 else "recv", members, nbytes, other, True))
        elif op == "batch":
            expected.append(("send", members, nbytes, (rank + 1) % 4, True))
            expected.append(("recv", members, nbytes, (rank - 1) % 4, True))
        else:
            expected.append((op, members, nbytes, ROOTS.get(op, -1), is_async))
    return expected


@pytest.mark.parametrize("capture", ["native", "python"])
def test_every_op_recorded_on_every_rank_under_megatrace_trace_and_torchrun(
    tmp_path: Path, capture: str, request: pytest.FixtureRequest
) -> None:
    if capture == "native":
        request.getfixturevalue("native_module")
    done = trace_under_torchrun(tmp_path, "ops", HERE / "ops_job.py", 4, capture == "native", timeout=240)
    assert f"megatrace trace: capture: {capture}" in done.stderr

    snaps = rings(tmp_path / "ops")
    for rank, snap in snaps.items():
        expected = expected_records(rank)
        r = ops_only(snap.records)
        assert [OP_NAMES[int(code)] for code in r["op"]] == [entry[0] for entry in expected]
        for row, (_, members, nbytes, peer, is_async) in zip(r, expected, strict=True):
            assert snap.communicators[int(row["comm_id"])] == members
            assert (int(row["nbytes"]), int(row["rank"]), int(row["peer"])) == (nbytes, rank, peer)
            assert row["complete_ns"] >= row["enqueue_ns"] > 0
            # The process-group layer cannot tell whether the caller asked for an async op.
            assert bool(row["flags"] & FLAG_PROCESS_GROUP) == (capture == "native")
            if (
                is_async is not None and capture == "python"
            ):  # sync send/recv: isend/irecv + wait in some torch
                assert bool(row["flags"] & FLAG_ASYNC) == is_async
        h = snap.header
        assert h.capture == capture and h.cuda_device == -1
        assert h.finished and h.oldest_inflight_enqueue_ns == 0
        assert sum(c.issued for c in h.comm_counters.values()) == len(ops_only(snap.records))
        assert all(c.completed == c.issued and c.inflight_seq == -1 for c in h.comm_counters.values())
        assert h.calls_by_op["all_gather"] == 4 and h.bytes_by_op["all_reduce"] == 40 + 48 + 12
        assert sum(h.calls_by_op.values()) == len(r)
    assert assert_collectives_line_up(snaps) == 12 + 2 * 3 + 2 * 2  # world, 2 pair groups, 2 even/odd groups
    exit_dumps = sorted((tmp_path / "ops").glob("rank-*.dump"))
    assert len(exit_dumps) == 4 and all(read_dump(p).reason == "exit" for p in exit_dumps)


def test_live_counters_signal_dump_and_killed_rank_leave_readable_files(tmp_path: Path) -> None:
    with start_traced_job(tmp_path, steps=100000, env={"MEGATRACE_TRACE_STALL_MS": "60000"}) as (proc, job):
        paths = [job / f"rank-{rank}.trace" for rank in range(4)]
        wait_for(lambda: all(p.exists() for p in paths), what="ring files")
        # the header's call counters are published by the watchdog's tick (every 250 ms at most)
        first = wait_for(
            lambda: (h := read_header(paths[3])).step_count >= 2 and h.calls_by_op["all_reduce"] and h,
            what="two steps, published",
        )
        later = wait_for(
            lambda: (
                (h := read_header(paths[3])).step_count > first.step_count + 2
                and h.wait_ns_total > first.wait_ns_total
                and h
            ),
            what="more steps, published",
        )
        assert proc.poll() is None and not later.finished
        assert later.calls_by_op["all_reduce"] > first.calls_by_op["all_reduce"]
        assert later.bytes_by_op["all_reduce"] > first.bytes_by_op["all_reduce"]
        assert later.last_enqueue_ns > first.last_enqueue_ns and later.wait_ns_total > first.wait_ns_total
        assert later.last_step_ns > 0 and later.last_step_end_ns > first.last_step_end_ns
        assert (later.world_size, later.local_rank, later.rank) == (4, 3, 3)
        assert later.stall_threshold_ns == 60_000_000_000

        os.kill(later.pid, signal.SIGUSR1)
        dump = wait_for(
            lambda: [p for p in job.glob(f"rank-3.{later.pid}.*.dump") if read_dump(p).reason == "signal"],
            what="signal dump",
        )[0]
        assert read_dump(dump).header.step_count >= later.step_count

        os.kill(read_header(paths[1]).pid, signal.SIGKILL)
        wait_for(lambda: proc.poll() is not None, what="job to end after a rank was killed")
    snaps = rings(job)
    assert all(not snap.header.finished for snap in snaps.values())
    assert len(snaps[1].records) > 0 and assert_collectives_line_up(snaps, cut_short=True) > 10


def test_injected_hang_dumps_on_every_rank_and_shows_who_never_entered(tmp_path: Path) -> None:
    env = {
        "MEGATRACE_FAULT_HANG_RANK": "2",
        "MEGATRACE_FAULT_HANG_AT_STEP": "3",
        "MEGATRACE_TRACE_STALL_MS": "1500",
    }
    job = run_traced_job(tmp_path, steps=50, env=env)
    latest = {}
    for path in job.glob("rank-*.dump"):
        snap = read_dump(path)
        if snap.reason == "stall" and snap.taken_ns > latest.get(snap.header.rank, (0, None))[0]:
            latest[snap.header.rank] = (snap.taken_ns, snap)
    assert sorted(latest) == [0, 1, 2, 3]
    stuck = {}
    for rank in (0, 1, 3):
        snap = latest[rank][1]
        inflight = snap.records[snap.records["complete_ns"] == 0]
        assert len(inflight) == 1, f"rank {rank}"
        stuck[rank] = (int(inflight["comm_id"][0]), int(inflight["seq"][0]))
        assert snap.taken_ns - int(inflight["enqueue_ns"][0]) > 1_500_000_000
        assert snap.header.oldest_inflight_enqueue_ns == int(inflight["enqueue_ns"][0])
    (cid, seq), *_ = set(stuck.values())
    assert len(set(stuck.values())) == 1 and 2 in latest[0][1].communicators[cid]
    hung = latest[2][1]
    assert np.all(hung.records["complete_ns"] > 0)
    assert hung.header.step_count == 3
    assert int(hung.records[hung.records["comm_id"] == cid]["seq"].max()) == seq - 1
    assert all(not snap.header.finished for snap in rings(job).values())
    # every stall dump carries the rank's stacks: the hung rank waits in the injected hang, the
    # others in the training loop with the collective in flight
    hung_at = where_stuck(hung.stacks, hung.header.oldest_inflight_op)
    assert hung_at is not None and hung_at.frames[0].function == "hang_forever"
    for rank in (0, 1, 3):
        snap = latest[rank][1]
        waiting = where_stuck(snap.stacks, snap.header.oldest_inflight_op)
        assert waiting is not None and waiting.frames[0].file.endswith("example_train.py"), waiting
        assert "→ `torch.distributed.distributed_c10d.all_reduce` (example_train.py:" in waiting.text
        assert waiting.text.endswith(f"collective `{snap.header.oldest_inflight_op}` in flight")
        assert {stack.name for stack in snap.stacks} >= {"MainThread", "megatrace-watchdog"}


def test_injected_slow_rank_arrives_last_in_the_recorded_times(tmp_path: Path) -> None:
    env = {
        "MEGATRACE_FAULT_SLOW_RANK": "1",
        "MEGATRACE_FAULT_SLOW_PCT": "400",
        "NCCL_MEGATRACE_SENSTIME": "60000",
    }
    snaps = rings(run_traced_job(tmp_path, steps=12, env=env))
    enqueue: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
    for rank, snap in snaps.items():
        for row in ops_only(snap.records):  # spans are numbered per rank, not matched across ranks
            enqueue[(int(row["comm_id"]), int(row["seq"]))][rank] = int(row["enqueue_ns"])
    with_slow = [by_rank for by_rank in enqueue.values() if 1 in by_rank and len(by_rank) > 1]
    last_is_slow = sum(max(by_rank, key=by_rank.get) == 1 for by_rank in with_slow)
    assert last_is_slow >= 0.8 * len(with_slow), (last_is_slow, len(with_slow))
    waits = {rank: snap.header.wait_ns_total for rank, snap in snaps.items()}
    assert waits[1] < min(waits[0], waits[2], waits[3])


def test_a_real_job_writes_host_samples_and_gc_spans_without_code_change(tmp_path: Path) -> None:
    """gc_job.py builds Python objects as a data pipeline does and knows nothing of the tracer; under
    ``megatrace trace`` each rank counts its garbage collections, writes the long ones as GC spans, and
    samples its own process and cgroup into its ring and its exit dump."""
    trace_under_torchrun(tmp_path, "gc", HERE / "gc_job.py", 2)
    cgroup = resolve_cgroup()
    for rank in range(2):
        snap = read_ring(tmp_path / "gc" / f"rank-{rank}.trace")
        h = snap.header
        spans = snap.records[snap.records["op"] == OP_GC]
        assert h.version == 4 and h.gc_collections >= len(spans) > 0 and h.gc_ns > 0
        took = spans["complete_ns"] - spans["enqueue_ns"]
        assert (took >= 1_000_000).all() and int(took.sum()) <= h.gc_ns
        assert set(spans["peer"].tolist()) <= {0, 1, 2} and (spans["comm_id"] == 0).all()
        assert list(spans["seq"]) == sorted(set(spans["seq"].tolist()))  # each collection once, in order
        assert h.host_samples and h.main_thread_id != 0 and h.cgroup_version == cgroup.version
        first, last = h.host_samples[0], h.host_samples[-1]
        assert last.cpu_ns >= first.cpu_ns > 0 and last.time_ns >= first.time_ns
        assert last.gc_collections <= h.gc_collections and last.nonvoluntary_switches >= 0
        (exit_dump,) = (tmp_path / "gc").glob(f"rank-{rank}.*.dump")
        dumped = read_dump(exit_dump).header
        assert dumped.host_samples == h.host_samples and dumped.gc_collections == h.gc_collections
        assert assert_collectives_line_up({rank: snap}, cut_short=True) > 0
