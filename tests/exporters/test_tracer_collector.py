"""Tracer collector on ring files written by the tracer's own writer and recorder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrace.exporters.tracer_files import TracerCollector, process_exists
from megatrace.tracer.format import (
    HEADER_SIZE_V3,
    HOST_SAMPLE_FIELDS,
    HOST_SIGNALS_OFFSET,
    HS_GC_COLLECTIONS,
    HS_GC_NS,
    W_HEADER_SIZE,
    W_VERSION,
)
from megatrace.tracer.host_signals import CgroupDirs, HostSampler
from megatrace.tracer.pauses import Pauses
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import (
    OP_CODES,
    W_FINISHED,
    W_WRITER_FLAGS,
    HostSample,
    RankIdentity,
    RingWriter,
    comm_id,
    read_header,
    ring_path,
)
from tests.exporters.exposition import names, promtool_check, render, samples, value
from tests.support.gloo_job import start_traced_job
from tests.support.services import require_binary
from tests.tracer.test_ringfile import as_older_version


def start_rank(
    trace_dir: Path, job: str, rank: int, pid: int, local_rank: int | None = None, stall_ns: int = 0
) -> Recorder:
    identity = RankIdentity(
        job=job,
        rank=rank,
        local_rank=rank % 8 if local_rank is None else local_rank,
        world_size=16,
        host="gpu-node-07",
        pid=pid,
        start_time_ns=time.time_ns(),
    )
    ring = ring_path(trace_dir / job, rank)
    writer = RingWriter(ring, identity, capacity=64, comm_table_bytes=4096, stall_threshold_ns=stall_ns)
    writer.add_communicator(comm_id(tuple(range(16))), tuple(range(16)))
    return Recorder(writer, rank)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_live_rank_counters(tmp_path: Path) -> None:
    recorder = start_rank(tmp_path, "pretrain-42", 9, os.getpid(), stall_ns=45_000_000_000)
    cid = comm_id(tuple(range(16)))
    for _ in range(3):
        recorder.end(recorder.begin(cid, OP_CODES["all_reduce"], 1 << 20, 1, -1, 0))
    recorder.end(recorder.begin(cid, OP_CODES["all_gather"], 4096, 1, -1, 0))
    recorder.mark_step()
    stuck = recorder.begin(cid, OP_CODES["reduce_scatter"], 512, 1, -1, 0)
    assert stuck
    recorder.publish()  # the watchdog's tick
    now = time.time() + 30

    text = render(TracerCollector(tmp_path, clock=lambda: now))

    rank = {"job": "pretrain-42", "rank": "9", "local_rank": "1"}
    assert value(text, "megatrace_tracer_collective_calls_total", **rank, op="all_reduce") == 3
    assert value(text, "megatrace_tracer_collective_bytes_total", **rank, op="all_reduce") == 3 << 20
    assert value(text, "megatrace_tracer_collective_calls_total", **rank, op="reduce_scatter") == 1
    assert "broadcast" not in {dict(ls).get("op") for ls in (k[1] for k in samples(text))}
    assert value(text, "megatrace_tracer_collective_wait_seconds_total", **rank) > 0
    assert value(text, "megatrace_tracer_steps_total", **rank) == 1
    assert value(text, "megatrace_tracer_last_step_duration_seconds", **rank) > 0
    assert 30 <= value(text, "megatrace_tracer_oldest_inflight_seconds", **rank) < 60
    assert now - 60 < value(text, "megatrace_tracer_last_progress_timestamp_seconds", **rank) <= now - 30
    assert value(text, "megatrace_tracer_rank_alive", **rank) == 1
    assert value(text, "megatrace_tracer_stall_threshold_seconds", **rank) == 45
    assert value(text, "megatrace_tracer_rank_info", **rank, world_size="16", pid=str(os.getpid())) == 1
    comm = {**rank, "comm": str(cid)}
    assert value(text, "megatrace_tracer_comm_ops_issued_total", **comm) == 5
    assert value(text, "megatrace_tracer_comm_ops_completed_total", **comm) == 4
    assert 30 <= value(text, "megatrace_tracer_comm_oldest_inflight_seconds", **comm) < 60
    result = promtool_check(text)
    assert result.returncode == 0, result.stdout + result.stderr
    recorder.writer.close()


def test_finished_rank_is_not_alive_and_dropped_after_the_grace_period(tmp_path: Path) -> None:
    recorder = start_rank(tmp_path, "sft-7", 0, os.getpid())
    recorder.header[W_FINISHED] = 1
    live = start_rank(tmp_path, "sft-8", 0, os.getpid())
    clock = [1_000.0]
    collector = TracerCollector(tmp_path, grace_seconds=60, clock=lambda: clock[0])

    text = render(collector)
    assert value(text, "megatrace_tracer_rank_alive", job="sft-7", rank="0") == 0
    assert value(text, "megatrace_tracer_rank_finished", job="sft-7", rank="0") == 1
    assert value(text, "megatrace_tracer_rank_finished", job="sft-8", rank="0") == 0
    assert value(text, "megatrace_tracer_oldest_inflight_seconds", job="sft-7", rank="0") == 0
    clock[0] += 60
    assert value(render(collector), "megatrace_tracer_rank_alive", job="sft-7", rank="0") == 0
    clock[0] += 1
    text = render(collector)
    assert not [ls for (n, ls) in samples(text) if ("job", "sft-7") in ls]
    assert value(text, "megatrace_tracer_rank_alive", job="sft-8", rank="0") == 1
    recorder.writer.close()
    live.writer.close()


def test_file_from_a_writer_that_does_not_lock_falls_back_to_the_pid(tmp_path: Path) -> None:
    pid = dead_pid()
    assert not process_exists(pid)
    recorder = start_rank(tmp_path, "pretrain-43", 3, pid)
    recorder.header[W_WRITER_FLAGS] = 0  # as written by tracers before the liveness lock
    text = render(TracerCollector(tmp_path))
    assert value(text, "megatrace_tracer_rank_alive", job="pretrain-43", rank="3") == 0
    assert value(text, "megatrace_tracer_rank_finished", job="pretrain-43", rank="3") == 0
    assert "megatrace_tracer_stall_threshold_seconds" not in names(text)  # file does not say: absent
    recorder.writer.close()


# A rank in another PID namespace: the pid in its file means nothing here (`recorded_pid`), and an
# optional forked child (a data loader worker) outlives it. Prints "ready" once the file is in place.
WRITER_SCRIPT = """
import os, sys, time
from pathlib import Path
from megatrace.tracer.ringfile import RankIdentity, RingWriter, ring_path
identity = RankIdentity("ns-job", 5, 5, 8, "node-b", int(sys.argv[2]), time.time_ns())
writer = RingWriter(ring_path(Path(sys.argv[1]), 5), identity, capacity=16, comm_table_bytes=4096)
started_r, started_w = os.pipe()
child = os.fork() if sys.argv[3] == "fork" else -1
if child == 0:  # fork handlers (the lock's release among them) have run by now
    os.write(started_w, b"x")
    time.sleep(600)
    os._exit(0)
if child > 0:
    os.read(started_r, 1)
print("ready", child, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("recorded", "fork"), [("gone", "nofork"), ("exists", "nofork"), ("exists", "fork")])
def test_liveness_follows_the_writer_lock_not_the_recorded_pid(
    tmp_path: Path, recorded: str, fork: str
) -> None:
    pid = dead_pid() if recorded == "gone" else os.getpid()
    argv = [sys.executable, "-c", WRITER_SCRIPT, str(tmp_path / "ns-job"), str(pid), fork]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    child = -1
    try:
        word, child_text = proc.stdout.readline().split()
        assert word == "ready"
        child = int(child_text)
        collector = TracerCollector(tmp_path)
        assert value(render(collector), "megatrace_tracer_rank_alive", job="ns-job", rank="5") == 1
        proc.kill()  # SIGKILL: no exit handler runs, the kernel drops the lock
        proc.wait(timeout=30)
        text = render(collector)
        assert value(text, "megatrace_tracer_rank_alive", job="ns-job", rank="5") == 0
        assert value(text, "megatrace_tracer_rank_finished", job="ns-job", rank="5") == 0
        if child > 0:
            assert process_exists(child), "the forked child must outlive the rank for this test"
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if child > 0:
            os.kill(child, signal.SIGKILL)


# The exporter as the Helm chart runs it: its own PID namespace, where the rank's recorded pid means
# nothing, and the trace directory bind-mounted read-only. Prints what it sees of the rank.
EXPORTER_VIEW_SCRIPT = """
import os, sys
from pathlib import Path
from megatrace.exporters.tracer_files import TracerCollector, process_exists
from megatrace.tracer.ringfile import read_header, ring_path
view = Path(sys.argv[1])
header = read_header(ring_path(view / "ns-job", 5))
readonly = bool(os.statvfs(view).f_flag & os.ST_RDONLY)
families = TracerCollector(view).collect()
(alive,) = [s.value for f in families for s in f.samples if s.name == "megatrace_tracer_rank_alive"]
print(f"alive={int(alive)} readonly={readonly} pid_visible={process_exists(header.pid)}")
"""
# Mounts the trace directory ($1) read-only at $2 in a new mount namespace, then runs the script.
READ_ONLY_VIEW = 'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && exec "$3" -c "$4" "$2"'


def exporter_view(trace_dir: Path, view: Path) -> str:
    unshare = require_binary("unshare")
    namespaces = ["--user", "--map-root-user", "--pid", "--fork", "--mount", "--mount-proc"]
    mount_then_run = ["sh", "-c", READ_ONLY_VIEW, "sh", str(trace_dir), str(view)]
    argv = [unshare, *namespaces, *mount_then_run, sys.executable, EXPORTER_VIEW_SCRIPT]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_liveness_through_a_read_only_mount_in_another_pid_namespace(tmp_path: Path) -> None:
    """flock needs no write access: the lock test works on the chart's read-only hostPath mount."""
    traces, view = tmp_path / "traces", tmp_path / "view"
    view.mkdir()
    argv = [sys.executable, "-c", WRITER_SCRIPT, str(traces / "ns-job"), str(os.getpid()), "nofork"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split()[0] == "ready"
        assert exporter_view(traces, view) == "alive=1 readonly=True pid_visible=False"
        proc.kill()
        proc.wait(timeout=30)
        assert exporter_view(traces, view) == "alive=0 readonly=True pid_visible=False"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_files_that_are_not_ring_files_are_skipped(tmp_path: Path) -> None:
    recorder = start_rank(tmp_path, "pretrain-44", 1, os.getpid())
    (tmp_path / "pretrain-44" / "rank-2.trace").write_bytes(b"not a ring file")
    (tmp_path / "pretrain-44" / "rank-3.trace").write_bytes(b"")
    (tmp_path / "pretrain-44" / "rank-1.stall-1.txt").write_text("a dump, not a ring\n")
    text = render(TracerCollector(tmp_path))
    assert {dict(ls)["rank"] for (n, ls) in samples(text)} == {"1"}
    recorder.writer.close()


def test_missing_trace_dir_means_no_series(tmp_path: Path) -> None:
    assert names(render(TracerCollector(tmp_path / "absent"))) == set()


@pytest.mark.parametrize("pid", [0, -5])
def test_impossible_pids_are_not_processes(pid: int) -> None:
    assert not process_exists(pid)


@pytest.mark.slow
def test_real_gloo_job_live_then_finished(tmp_path: Path) -> None:
    """Files written by the real tracer in a 4-rank gloo job: alive with progress, then finished."""
    steps = 40
    collector = TracerCollector(tmp_path)
    with start_traced_job(tmp_path, nprocs=4, steps=steps) as (proc, job_dir):
        deadline = time.monotonic() + 120
        live: dict = {}
        while proc.poll() is None and time.monotonic() < deadline:
            text = render(collector)
            alive = [
                ls for (n, ls), v in samples(text).items() if n == "megatrace_tracer_rank_alive" and v == 1
            ]
            steps_seen = [v for (n, _), v in samples(text).items() if n == "megatrace_tracer_steps_total"]
            if len(alive) == 4 and steps_seen and min(steps_seen) >= 1:
                live = samples(text)
                break
            time.sleep(0.1)
        assert live, "never saw all four ranks alive and stepping"
        assert proc.wait(timeout=120) == 0

    text = render(collector)
    job = job_dir.name
    for rank in range(4):
        labels = {"job": job, "rank": str(rank)}
        assert value(text, "megatrace_tracer_rank_alive", **labels) == 0
        assert value(text, "megatrace_tracer_rank_finished", **labels) == 1
        assert value(text, "megatrace_tracer_steps_total", **labels) == steps
        assert value(text, "megatrace_tracer_collective_calls_total", **labels, op="all_reduce") > 0
        assert value(text, "megatrace_tracer_collective_bytes_total", **labels, op="all_reduce") > 0
        assert value(text, "megatrace_tracer_oldest_inflight_seconds", **labels) == 0
        assert value(text, "megatrace_tracer_rank_info", **labels, world_size="4") == 1
        assert value(text, "megatrace_tracer_stall_threshold_seconds", **labels) == 1.5  # the job's STALL_MS
    result = promtool_check(text)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_ring_file_cannot_claim_another_jobs_labels(tmp_path: Path) -> None:
    """The job and rank come from where the file is, not from what it says: a file in folder
    "intruder" that says it is rank 3 of "victim-job" is exported as what its place makes it."""
    victim = start_rank(tmp_path, "victim-job", 3, os.getpid())
    identity = RankIdentity("victim-job", 3, 3, 16, "gpu-node-07", os.getpid(), time.time_ns())
    forged = RingWriter(ring_path(tmp_path / "intruder", 0), identity, capacity=64, comm_table_bytes=4096)
    try:
        text = render(TracerCollector(tmp_path))
        assert value(text, "megatrace_tracer_rank_alive", job="victim-job", rank="3") == 1
        assert value(text, "megatrace_tracer_rank_alive", job="intruder", rank="0") == 1
        jobs = {dict(labels)["job"] for (_, labels) in samples(text)}
        assert jobs == {"victim-job", "intruder"}
    finally:
        forged.close()
        victim.writer.close()


def test_pause_series_while_a_pause_lasts_and_after(tmp_path: Path) -> None:
    recorder = start_rank(tmp_path, "pretrain-42", 3, os.getpid())
    pauses = Pauses(lambda: recorder)
    pauses.end(pauses.begin("dataloader"))
    checkpoint = pauses.begin("checkpoint")
    since = read_header(recorder.writer.path).pauses["checkpoint"].since_ns
    now = since * 1e-9 + 90
    rank = {"job": "pretrain-42", "rank": "3", "local_rank": "3"}

    text = render(TracerCollector(tmp_path, clock=lambda: now))
    assert value(text, "megatrace_tracer_pause_seconds", **rank, kind="checkpoint") == pytest.approx(90)
    assert value(text, "megatrace_tracer_pause_seconds", **rank, kind="eval") == 0
    assert value(text, "megatrace_tracer_pause_seconds", **rank, kind="dataloader") == 0
    assert value(text, "megatrace_tracer_pauses_total", **rank, kind="dataloader") == 1
    assert value(text, "megatrace_tracer_pauses_total", **rank, kind="checkpoint") == 0
    result = promtool_check(text)
    assert result.returncode == 0, result.stdout + result.stderr

    pauses.end(checkpoint)
    text = render(TracerCollector(tmp_path, clock=lambda: now))
    took = read_header(recorder.writer.path).pauses["checkpoint"].total_ns
    assert value(text, "megatrace_tracer_pause_seconds", **rank, kind="checkpoint") == 0
    assert value(text, "megatrace_tracer_pauses_total", **rank, kind="checkpoint") == 1
    assert value(text, "megatrace_tracer_pause_seconds_total", **rank, kind="checkpoint") == pytest.approx(
        took * 1e-9
    )
    recorder.writer.close()


def test_a_version_2_file_exports_its_counters_without_durations_or_pauses(tmp_path: Path) -> None:
    recorder = start_rank(tmp_path, "old", 1, os.getpid())
    cid = comm_id(tuple(range(16)))
    recorder.end(recorder.begin(cid, OP_CODES["all_reduce"], 64, 1, -1, 0))
    recorder.publish()
    recorder.writer.close()
    ring = ring_path(tmp_path / "old", 1)
    as_older_version(ring, 2).replace(ring)
    text = render(TracerCollector(tmp_path, is_alive=lambda *_: True))
    rank = {"job": "old", "rank": "1", "local_rank": "1"}
    assert value(text, "megatrace_tracer_comm_ops_completed_total", **rank, comm=str(cid)) == 1
    assert not {name for name in names(text) if "pause" in name or "op_duration" in name}


HOST_SERIES = {
    "megatrace_tracer_schedstat_running_seconds_total": ("cpu_ns", 1e-9, {}),
    "megatrace_tracer_schedstat_waiting_seconds_total": ("runq_ns", 1e-9, {}),
    "megatrace_tracer_context_switches_total": ("nonvoluntary_switches", 1, {"type": "involuntary"}),
    "megatrace_tracer_major_page_faults_total": ("major_faults", 1, {}),
    "megatrace_tracer_fs_reads_bytes_total": ("read_bytes", 1, {}),
    "megatrace_tracer_main_thread_io_wait_samples_total": ("main_io_wait_samples", 1, {}),
    "megatrace_tracer_cpu_cfs_periods_total": ("cfs_periods", 1, {}),
    "megatrace_tracer_cpu_cfs_throttled_periods_total": ("cfs_throttled_periods", 1, {}),
    "megatrace_tracer_cpu_cfs_throttled_seconds_total": ("cfs_throttled_ns", 1e-9, {}),
    "megatrace_tracer_memory_failcnt_total": ("memory_limit_hits", 1, {}),
    "megatrace_tracer_oom_events_total": ("oom_kills", 1, {}),
}


def test_host_signal_series_come_from_the_newest_sample_and_unavailable_ones_are_absent(
    tmp_path: Path,
) -> None:
    recorder = start_rank(tmp_path, "pretrain-42", 5, os.getpid())
    writer = recorder.writer
    sampler = HostSampler(writer, 10**9, cgroup=CgroupDirs(version=1), delayacct=False)
    fields = dict.fromkeys(HOST_SAMPLE_FIELDS, 0)
    sampler.write(HostSample(**fields))
    newest = {
        **fields, "time_ns": 1_700_000_000_000_000_000, "cpu_ns": 40_000_000_000, "runq_ns": 2_500_000_000,
        "voluntary_switches": 900, "nonvoluntary_switches": 77, "major_faults": 3, "read_bytes": 8192,
        "main_io_wait_samples": 2, "cfs_periods": 500, "cfs_throttled_periods": 120,
        "cfs_throttled_ns": 6 * 10**9,
        "memory_limit_hits": 4, "oom_kills": 1, "blkio_delay_ns": -1, "memory_high_events": -1,
        "cpu_pressure_ns": -1, "memory_pressure_ns": -1, "io_pressure_ns": -1,
    }  # fmt: skip
    sampler.write(HostSample(**newest))
    header = writer.header
    gc_words = HOST_SIGNALS_OFFSET // 8
    header[gc_words + HS_GC_COLLECTIONS], header[gc_words + HS_GC_NS] = 31, 250_000_000
    text = render(TracerCollector(tmp_path))
    rank = {"job": "pretrain-42", "rank": "5", "local_rank": "5"}
    for name, (field, scale, extra) in HOST_SERIES.items():
        assert value(text, name, **rank, **extra) == pytest.approx(newest[field] * scale), name
    assert value(text, "megatrace_tracer_context_switches_total", **rank, type="voluntary") == 900
    assert value(text, "megatrace_tracer_host_sample_timestamp_seconds", **rank) == pytest.approx(1.7e9)
    assert value(text, "megatrace_tracer_gc_collections_total", **rank) == 31
    assert value(text, "megatrace_tracer_gc_pause_seconds_total", **rank) == pytest.approx(0.25)
    exported = names(text)
    for absent in ("blkio_delay", "memory_high_events", "pressure_"):
        assert not {name for name in exported if absent in name}, absent
    result = promtool_check(text)
    assert result.returncode == 0, result.stdout + result.stderr
    writer.close()


def test_a_rank_without_samples_exports_gc_counters_only_and_a_version_3_file_neither(tmp_path: Path) -> None:
    recorder = start_rank(tmp_path, "j", 2, os.getpid())
    text = render(TracerCollector(tmp_path))
    exported = names(text)
    assert {"megatrace_tracer_gc_collections_total", "megatrace_tracer_gc_pause_seconds_total"} <= exported
    assert not {name for name in exported if "schedstat" in name or "cfs" in name}
    recorder.writer.header[W_VERSION] = 3
    recorder.writer.header[W_HEADER_SIZE] = HEADER_SIZE_V3
    exported = names(render(TracerCollector(tmp_path)))
    assert "megatrace_tracer_steps_total" in exported and not {name for name in exported if "gc_" in name}
    recorder.writer.close()
