"""The native capture at the process-group layer: every path that issues collectives, once each; device
completion semantics with a Work whose completion the test controls; the Python fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
import torch

from megatrace.exporters.tracer_files import TracerCollector
from megatrace.tracer.dumpfile import read_dump
from megatrace.tracer.recorder import NativeRecorder
from megatrace.tracer.ringfile import (
    FLAG_PROCESS_GROUP,
    OP_NAMES,
    RankIdentity,
    RingSnapshot,
    RingWriter,
    comm_id,
    ops_only,
    read_header,
    read_ring,
    ring_path,
)
from megatrace.tracer.watchdog import Watchdog, is_stalled
from tests.exporters.exposition import render, value
from tests.support.gloo_job import trace_under_torchrun
from tests.tracer import paths_job, pipeline_job
from tests.tracer.test_tracing_gloo import assert_collectives_line_up, wait_for

HERE = Path(__file__).parent
WORLD = (0, 1)


def run_paths_job(tmp_path: Path, native: bool) -> tuple[dict[int, RingSnapshot], str]:
    done = trace_under_torchrun(tmp_path, "paths", HERE / "paths_job.py", 2, native)
    snaps = {rank: read_ring(tmp_path / "paths" / f"rank-{rank}.trace") for rank in WORLD}
    return snaps, done.stderr


def all_reduces_by_section(snap: RingSnapshot) -> dict[str, int]:
    r = snap.records
    steps = r["step"][r["op"] == 1]  # all_reduce
    return {path: int((steps == step).sum()) for step, (path, _) in enumerate(paths_job.SECTIONS, start=1)}


@pytest.mark.slow
def test_all_19_all_reduces_traced_once_on_each_rank_whoever_issued_them(
    tmp_path: Path, native_module: ModuleType
) -> None:
    snaps, stderr = run_paths_job(tmp_path, native=True)
    assert "megatrace trace: capture: native" in stderr
    world = comm_id(WORLD)
    for rank, snap in snaps.items():
        assert snap.header.capture == "native"
        assert all_reduces_by_section(snap) == dict(paths_job.SECTIONS)
        assert sum(all_reduces_by_section(snap).values()) == 19
        r = ops_only(snap.records)
        assert all(r["flags"] & FLAG_PROCESS_GROUP) and all(r["comm_id"] == world)
        assert all(r["complete_ns"] >= r["enqueue_ns"]) and all(r["enqueue_ns"] > 0)
        collectives = r[r["op"] < 8]
        assert list(collectives["seq"]) == list(range(len(collectives)))  # each op once, none missing
        fsdp_step = len(paths_job.SECTIONS) + 1
        fsdp = Counter(OP_NAMES[int(op)] for op in r["op"][r["step"] == fsdp_step])
        assert fsdp == Counter(dict(paths_job.FSDP_OPS))
        p2p = r[r["step"] == fsdp_step + 1]
        assert [(OP_NAMES[int(p["op"])], int(p["peer"]), int(p["nbytes"])) for p in p2p] == [
            ("send", 1, 12) if rank == 0 else ("recv", 0, 12)
        ]
        counters = snap.header.comm_counters[world]
        assert counters.issued == counters.completed == len(r) and counters.inflight_seq == -1
        assert snap.communicators == {world: WORLD}
    assert assert_collectives_line_up(snaps) == len(ops_only(snaps[0].records)) - 1


@pytest.mark.slow
def test_python_fallback_traces_the_torch_distributed_calls_and_says_so(tmp_path: Path) -> None:
    snaps, stderr = run_paths_job(tmp_path, native=False)
    assert "megatrace trace: capture: python" in stderr
    assert stderr.count("native capture unavailable (turned off by MEGATRACE_TRACE_NATIVE=0)") == 2
    for snap in snaps.values():
        assert snap.header.capture == "python"
        sections = all_reduces_by_section(snap)
        assert sections["dist_all_reduce"] == 4 and sections["ddp_reducer"] == 0
        assert not any(snap.records["flags"] & FLAG_PROCESS_GROUP)
    assert assert_collectives_line_up(snaps) > 4


def test_device_completion_keeps_an_op_in_flight_until_its_work_completes(
    tmp_path: Path, native_module: ModuleType
) -> None:
    """NCCL semantics on the CPU: the host call returns and wait() returns (the kernel is only
    enqueued) while the Work is not complete; the ring, the counters, the stall check, the stall dump
    and the exporter's gauge must all show the op in flight until the Work completes."""
    stall_ns = 50_000_000
    identity = RankIdentity("held", 0, 0, 2, "node-0", os.getpid(), time.time_ns())
    writer = RingWriter(ring_path(tmp_path / "held", 0), identity, capacity=64, stall_threshold_ns=stall_ns)
    writer.set_capture("native")
    cid = comm_id(WORLD)
    writer.add_communicator(cid, WORLD)
    native_module.attach(str(writer.path))
    try:
        backend, release = native_module.held_backend(0, 2)
        traced = native_module.wrap(backend, cid, list(WORLD), True)
        work = traced.allreduce([torch.ones(4)])
        assert work.wait()
        header = wait_for(
            lambda: (h := read_header(writer.path)).oldest_inflight_enqueue_ns and h, what="publish"
        )
        snap = read_ring(writer.path)
        (record,) = snap.records
        assert OP_NAMES[int(record["op"])] == "all_reduce" and record["complete_ns"] == 0
        assert header.oldest_inflight_enqueue_ns == int(record["enqueue_ns"])
        assert header.oldest_inflight_op == "all_reduce"
        counters = header.comm_counters[cid]
        assert (counters.issued, counters.completed, counters.inflight_op, counters.inflight_seq) == (
            1, 0, "all_reduce", 0,
        )  # fmt: skip
        assert not work.is_completed()

        now_ns = int(record["enqueue_ns"]) + 2 * stall_ns
        assert is_stalled(writer.header, now_ns, stall_ns)
        dog = Watchdog(NativeRecorder(writer, 0, native_module), tmp_path / "held", 0, stall_ns)
        dump = read_dump(dog.dump("stall"))
        assert dump.records["complete_ns"].tolist() == [0] and dump.header.comm_counters[cid].completed == 0
        text = render(TracerCollector(tmp_path, clock=lambda: now_ns / 1e9))
        assert (
            value(text, "megatrace_tracer_oldest_inflight_seconds", job="held", rank="0", local_rank="0")
            > 0.05
        )

        release()
        done = wait_for(
            lambda: (h := read_header(writer.path)).oldest_inflight_enqueue_ns == 0 and h, what="completion"
        )
        assert work.is_completed()
        completed_ns = int(read_ring(writer.path).records["complete_ns"][0])
        assert completed_ns >= int(record["enqueue_ns"])
        assert (done.comm_counters[cid].completed, done.comm_counters[cid].inflight_seq) == (1, -1)
        # judged just after its completion: how long the test took to get here does not matter
        assert done.wait_ns_total > 0
        assert not is_stalled(writer.header, completed_ns + stall_ns // 2, stall_ns)
    finally:
        native_module.detach()
        writer.close()


def test_host_completion_is_recorded_when_wait_returns(tmp_path: Path, native_module: ModuleType) -> None:
    """Backends whose Work completes on the host (gloo): wait() returning is the completion."""
    identity = RankIdentity("host", 0, 0, 1, "node-0", os.getpid(), time.time_ns())
    writer = RingWriter(ring_path(tmp_path / "host", 0), identity, capacity=64)
    native_module.attach(str(writer.path))
    try:
        backend, _release = native_module.held_backend(0, 1)
        traced = native_module.wrap(backend, comm_id((0,)), [0], False)
        traced.allreduce([torch.ones(2)]).wait()
        assert read_ring(writer.path).records["complete_ns"][0] > 0
    finally:
        native_module.detach()
        writer.close()


BREAKAGES = {
    # a library file that is not one
    "library": """
        native.library_path().parent.mkdir(parents=True, exist_ok=True)
        native.library_path().write_bytes(b"not a shared library")
        """,
    # a library that loads but cannot record into this ring
    "attach": """
        real = native.load(build_missing=True)
        class CannotAttach:
            def __getattr__(self, name):
                return getattr(real, name)
            def attach(self, path):
                raise RuntimeError("no room")
        native.load = lambda wanted=True, build_missing=False: CannotAttach()
        """,
}


@pytest.mark.parametrize(("breakage", "reason"), [("library", "megatrace_capture.so"), ("attach", "no room")])
def test_native_capture_that_cannot_work_falls_back_to_python_with_one_log_line(
    tmp_path: Path, breakage: str, reason: str, native_module: ModuleType
) -> None:
    script = (
        textwrap.dedent(
            """
        import datetime, logging, os, sys
        import torch, torch.distributed as dist
        from megatrace.tracer import native, runtime
        from megatrace.tracer.ringfile import read_header
        from megatrace.tracer.settings import FaultSettings, TraceSettings
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        """
        )
        + textwrap.dedent(BREAKAGES[breakage])
        + textwrap.dedent(
            """
        settings = TraceSettings(enable=True, dir=sys.argv[1], job="broken", stall_ms=60000)
        assert runtime.install(settings, FaultSettings())
        store = dist.FileStore(os.path.join(sys.argv[1], "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dist.all_reduce(torch.ones(3))
        runtime.current().recorder.publish()
        header = read_header(runtime.current().recorder.writer.path)
        print(header.capture, header.calls_by_op["all_reduce"])
        dist.destroy_process_group()
        runtime.uninstall()
        """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRACE_")}
    if breakage == "library":
        env["MEGATRACE_NATIVE_DIR"] = str(tmp_path / "native")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["python", "1"]
    warnings = [line for line in done.stderr.splitlines() if "native capture unavailable" in line]
    assert len(warnings) == 1 and reason in warnings[0]


@pytest.mark.slow
def test_pipeline_stages_with_ddp_on_data_parallel_subgroups(
    tmp_path: Path, native_module: ModuleType
) -> None:
    trace_under_torchrun(tmp_path, "pp", HERE / "pipeline_job.py", 4)
    snaps = {rank: read_ring(tmp_path / "pp" / f"rank-{rank}.trace") for rank in range(4)}
    for rank, snap in snaps.items():
        dp, pp = (rank // 2 * 2, rank // 2 * 2 + 1), (rank % 2, rank % 2 + 2)
        assert {comm_id(dp): dp, comm_id(pp): pp}.items() <= snap.communicators.items()
        ops_of = ops_only(snap.records)
        step = ops_of[ops_of["step"] == 1]
        ops = [(OP_NAMES[int(r["op"])], snap.communicators[int(r["comm_id"])], int(r["peer"])) for r in step]
        gradients = [op for op in ops if op[0] == "all_reduce"]
        assert gradients == [("all_reduce", dp, -1)] * pipeline_job.BUCKETS
        p2p = [op for op in ops if op[0] in ("send", "recv")]
        assert p2p == ([("send", pp, rank + 2)] if rank < 2 else [("recv", pp, rank - 2)])
    assert assert_collectives_line_up(snaps) == 2 * 8
