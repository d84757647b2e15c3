"""Host signals sampled by the rank itself (`megatrace.tracer.host_signals`): cgroup v1 and v2 fixture
trees laid out as the kernel lays them out, this machine's real /proc and a real cgroup v1 CPU quota,
the header's sample ring, dumps and agent windows that carry it, and the GC hook."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from megatrace.exporters.trace_window import Window, dump_window, ring_window
from megatrace.tracer.dumpfile import read_dump, write_dump
from megatrace.tracer.format import (
    HEADER_SIZE_V3,
    HOST_SAMPLE_CHECK,
    HOST_SAMPLE_FIELDS,
    HOST_SAMPLES,
    OP_GC,
    SPAN_NAMES,
    W_HEADER_SIZE,
    W_VERSION,
)
from megatrace.tracer.gc_spans import GcSpans
from megatrace.tracer.host_signals import HostSampler, pressure_some_total_ns, resolve_cgroup
from megatrace.tracer.pauses import Pauses
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import (
    HostSample,
    RankIdentity,
    RingWriter,
    host_sample_word,
    read_header,
    read_ring,
    ring_path,
)
from megatrace.tracer.watchdog import Watchdog

IDENTITY = RankIdentity(job="j", rank=1, local_rank=1, world_size=2, host="h", pid=9, start_time_ns=1)
TID = 4242
TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def writer_in(tmp_path: Path) -> RingWriter:
    return RingWriter(ring_path(tmp_path / "job", 1), IDENTITY, capacity=64, comm_table_bytes=4096)


def stat_line(state: str, majflt: int, blkio_ticks: int) -> str:
    """A /proc/<pid>/stat line (proc(5)): 52 fields, the command in parentheses (spaces and a ')' in it)."""
    after = [state] + ["0"] * 49
    after[9] = str(majflt)  # field 12
    after[39] = str(blkio_ticks)  # field 42
    return f"{TID} (python) x) " + " ".join(after) + "\n"


def proc_tree(root: Path, cgroup: str, mountinfo: str, state: str = "S", blkio_ticks: int = 0) -> Path:
    """A /proc/self of a process whose main thread is TID, laid out as the kernel does."""
    proc = root / "proc" / "self"
    task = proc / "task" / str(TID)
    task.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    (proc / "stat").write_text(stat_line("S", 17, 0))
    (proc / "io").write_text(
        "rchar: 900\nwchar: 10\nsyscr: 3\nsyscw: 1\nread_bytes: 4096\nwrite_bytes: 0\n"
        "cancelled_write_bytes: 0\n"
    )
    (task / "schedstat").write_text("5000000 700000 31\n")
    (task / "status").write_text(
        "Name:\tpython\nState:\tS (sleeping)\nvoluntary_ctxt_switches:\t120\n"
        "nonvoluntary_ctxt_switches:\t45\n"
    )
    (task / "stat").write_text(stat_line(state, 3, blkio_ticks))
    return proc


def mount(mount_id: int, root: str, point: Path, fstype: str, options: str) -> str:
    fields = f"{mount_id} 31 0:{mount_id} {root} {point} rw,nosuid,nodev,noexec,relatime"
    return f"{fields} - {fstype} {fstype} {options}\n"


def v1_tree(tmp_path: Path, path: str = "/kubepods/pod7/c1") -> tuple[Path, Path, Path]:
    cpu = tmp_path / "cg" / "cpu,cpuacct"
    memory = tmp_path / "cg" / "memory"
    for top in (cpu, memory):
        (top / path.lstrip("/")).mkdir(parents=True)
    (cpu / path.lstrip("/") / "cpu.stat").write_text(
        "nr_periods 1500\nnr_throttled 300\nthrottled_time 4200000000\nnr_bursts 0\nburst_time 0\n"
    )
    (memory / path.lstrip("/") / "memory.failcnt").write_text("12\n")
    (memory / path.lstrip("/") / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
    )
    cgroup = f"12:pids:{path}\n4:memory:{path}\n3:cpu,cpuacct:{path}\n1:name=systemd:{path}\n"
    mountinfo = (
        "23 1 0:21 / /sys rw - sysfs sysfs rw\n"
        + mount(32, "/", cpu, "cgroup", "rw,cpu,cpuacct")
        + mount(35, "/", memory, "cgroup", "rw,memory")
    )
    return proc_tree(tmp_path, cgroup, mountinfo), cpu / path.lstrip("/"), memory / path.lstrip("/")


def v2_tree(tmp_path: Path, path: str, mount_root: str = "/", state: str = "S") -> tuple[Path, Path]:
    unified = tmp_path / "cg2"
    folder = unified / path.lstrip("/")[len(mount_root.lstrip("/")) :].lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.stat").write_text(
        "usage_usec 99000\nuser_usec 80000\nsystem_usec 19000\nnr_periods 800\nnr_throttled 120\n"
        "throttled_usec 2500000\nnr_bursts 0\nburst_usec 0\n"
    )
    (folder / "memory.events").write_text("low 0\nhigh 31\nmax 7\noom 1\noom_kill 1\noom_group_kill 0\n")
    for name, some in (("cpu", 1200), ("memory", 340), ("io", 56)):
        (folder / f"{name}.pressure").write_text(
            f"some avg10=1.50 avg60=0.80 avg300=0.20 total={some}\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=9\n"
        )
    proc = proc_tree(
        tmp_path, f"0::{path}\n", mount(29, mount_root, unified, "cgroup2", "rw,nsdelegate"), state
    )
    return proc, folder


def sampler(writer: RingWriter, proc: Path, **kwargs) -> HostSampler:
    return HostSampler(writer, 10**9, proc_self=proc, main_tid=TID, **kwargs)


def test_cgroup_v1_signals_from_the_v1_controllers(tmp_path: Path) -> None:
    proc, cpu, memory = v1_tree(tmp_path)
    dirs = resolve_cgroup(proc)
    assert (dirs.version, dirs.cpu, dirs.memory, dirs.pressure, dirs.memory_v2) == (
        1,
        cpu,
        memory,
        None,
        False,
    )
    writer = writer_in(tmp_path)
    sample = sampler(writer, proc, delayacct=False).sample()
    assert (sample.cpu_ns, sample.runq_ns, sample.voluntary_switches, sample.nonvoluntary_switches) == (
        5000000, 700000, 120, 45,
    )  # fmt: skip
    assert (sample.major_faults, sample.read_bytes, sample.main_io_wait_samples) == (17, 4096, 0)
    assert (sample.cfs_periods, sample.cfs_throttled_periods, sample.cfs_throttled_ns) == (
        1500,
        300,
        4200000000,
    )
    assert (sample.memory_limit_hits, sample.memory_high_events, sample.oom_kills) == (12, -1, 2)
    pressure = (sample.cpu_pressure_ns, sample.memory_pressure_ns, sample.io_pressure_ns)
    assert pressure == (-1, -1, -1) and sample.blkio_delay_ns == -1
    header = read_header(writer.path)
    assert header.cgroup_version == 1 and header.host_samples == (sample,)
    notes = "\n".join(header.host_notes)
    assert "cgroup v1 has no per-cgroup pressure" in notes
    assert "task_delayacct is 0" in notes and "cgroup v1 has no memory.high" in notes


def test_cgroup_v2_signals_from_the_unified_hierarchy(tmp_path: Path) -> None:
    proc, folder = v2_tree(tmp_path, "/kubepods.slice/pod7/c1", state="D")
    dirs = resolve_cgroup(proc)
    assert (dirs.version, dirs.cpu, dirs.memory, dirs.pressure, dirs.memory_v2) == (
        2,
        folder,
        folder,
        folder,
        True,
    )
    writer = writer_in(tmp_path)
    rank = sampler(writer, proc, delayacct=True)
    rank.sample()
    sample = rank.sample()
    assert (sample.cfs_periods, sample.cfs_throttled_periods, sample.cfs_throttled_ns) == (
        800,
        120,
        2500000000,
    )
    assert (sample.memory_limit_hits, sample.memory_high_events, sample.oom_kills) == (7, 31, 1)
    assert (sample.cpu_pressure_ns, sample.memory_pressure_ns, sample.io_pressure_ns) == (
        1200000,
        340000,
        56000,
    )
    assert sample.main_io_wait_samples == 2  # the main thread was in state D at both samples
    assert sample.blkio_delay_ns == 0
    header = read_header(writer.path)
    assert header.cgroup_version == 2 and header.host_notes == () and len(header.host_samples) == 2


def test_delay_accounting_ticks_become_ns(tmp_path: Path) -> None:
    unified = tmp_path / "cg2"
    unified.mkdir()
    proc = proc_tree(tmp_path, "0::/\n", mount(29, "/", unified, "cgroup2", "rw"), blkio_ticks=250)
    sample = sampler(writer_in(tmp_path), proc, delayacct=True).read()
    assert sample.blkio_delay_ns == 250 * TICK_NS


@pytest.mark.parametrize(
    ("path", "mount_root", "found"),
    [
        ("/", "/", ""),  # a cgroup namespace: the rank's cgroup is its namespace's root
        ("/kubepods/pod7/c1", "/kubepods/pod7", "c1"),  # a bind mount of a subtree
        ("/kubepods/pod7", "/kubepods/pod7", ""),
    ],
)
def test_the_cgroup_is_found_under_the_mount_that_shows_it(
    tmp_path: Path, path: str, mount_root: str, found: str
) -> None:
    proc, folder = v2_tree(tmp_path, path, mount_root)
    assert folder == tmp_path / "cg2" / found if found else tmp_path / "cg2"
    assert resolve_cgroup(proc).cpu == folder


def test_a_cgroup_outside_the_mount_is_unavailable_and_said_so(tmp_path: Path) -> None:
    unified = tmp_path / "cg2"
    unified.mkdir()
    proc = proc_tree(tmp_path, "0::/../../system.slice\n", mount(29, "/", unified, "cgroup2", "rw"))
    dirs = resolve_cgroup(proc)
    assert (dirs.version, dirs.cpu, dirs.memory, dirs.pressure) == (0, None, None, None)
    assert any("not visible under the mounted unified hierarchy" in note for note in dirs.notes)
    sample = sampler(writer_in(tmp_path), proc, delayacct=False).read()
    assert (sample.cfs_throttled_periods, sample.oom_kills, sample.cpu_pressure_ns) == (-1, -1, -1)
    assert sample.cpu_ns == 5000000  # the process's own signals do not depend on the cgroup


def test_a_missing_file_is_minus_one_with_a_note_not_an_error(tmp_path: Path) -> None:
    proc, cpu, _ = v1_tree(tmp_path)
    (cpu / "cpu.stat").unlink()
    (proc / "io").unlink()
    rank = sampler(writer_in(tmp_path), proc, delayacct=False)
    sample = rank.read()
    assert (sample.cfs_periods, sample.read_bytes, sample.cpu_ns) == (-1, -1, 5000000)
    assert any(note.startswith("cgroup_cpu: cannot read") for note in rank.notes)
    assert any(note.startswith("io: cannot read") for note in rank.notes)


def test_pressure_lines_are_parsed_and_a_file_without_some_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cpu.pressure"
    path.write_text(
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=3\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=1\n"
    )
    assert pressure_some_total_ns(path) == 3000
    path.write_text("full avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")
    with pytest.raises(ValueError, match="no 'some"):
        pressure_some_total_ns(path)


def test_this_machine_real_proc_and_cgroup(tmp_path: Path) -> None:
    """The sampler on the real /proc/self of this test process (cgroup v1 controllers here)."""
    writer = writer_in(tmp_path)
    rank = HostSampler(writer, 10**9)
    first = rank.sample()
    sum(range(2_000_000))
    second = rank.sample()
    assert second.cpu_ns > first.cpu_ns > 0 and second.runq_ns >= first.runq_ns >= 0
    assert second.voluntary_switches >= 0 and second.major_faults >= 0 and second.read_bytes >= 0
    header = read_header(writer.path)
    assert header.main_thread_id == threading.main_thread().ident
    assert header.cgroup_version == resolve_cgroup().version
    if Path("/proc/sys/kernel/task_delayacct").read_text().strip() == "0":
        assert second.blkio_delay_ns == -1 and any("task_delayacct is 0" in n for n in header.host_notes)
    if resolve_cgroup().cpu is not None:
        assert second.cfs_periods >= 0 and second.cfs_throttled_periods >= 0


QUOTA_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from megatrace.tracer.host_signals import HostSampler
    from megatrace.tracer.ringfile import RankIdentity, RingWriter, read_header

    sys.stdin.readline()  # the test has moved this process into the quota'd cgroup
    writer = RingWriter(Path(sys.argv[1]), RankIdentity("q", 0, 0, 1, "h", 1, 1), capacity=16)
    sampler = HostSampler(writer, 10**9)
    print(sampler.cgroup.cpu, flush=True)
    for _ in range(600):  # burn CPU until the quota throttles this cgroup
        sum(range(200_000))
        if sampler.sample().cfs_throttled_periods > 0:
            break
    writer.close()
    """
)


@contextlib.contextmanager
def sampled_in_cgroup(
    group: Path, child_code: str, trace: Path, setup: dict[str, str]
) -> Iterator[HostSample]:
    """Make cgroup `group` (its files `setup` written), run `child_code` in it (it samples into
    `trace` once this test moved it in, and prints the cgroup folder its sampler found, which must be
    `group`), and yield the child's last sample while the cgroup still exists; the cgroup always goes."""
    group.mkdir()
    child = None
    try:
        for name, value in setup.items():
            (group / name).write_text(value)
        child = subprocess.Popen(
            [sys.executable, "-c", child_code, str(trace)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        (group / "cgroup.procs").write_text(str(child.pid))
        out, _ = child.communicate("go\n", timeout=300)
        assert child.returncode == 0
        assert out.split()[0] == str(group)
        yield read_header(trace).host_samples[-1]
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        group.rmdir()


def test_a_real_cgroup_v1_cpu_quota_moves_the_throttle_counters(tmp_path: Path) -> None:
    """A cgroup made here under the v1 cpu controller with a 10 % quota; a process in it burning CPU."""
    controller = Path("/sys/fs/cgroup/cpu")
    assert (controller / "cpu.cfs_quota_us").exists(), "this machine mounts the cgroup v1 cpu controller"
    group = controller / f"megatrace-test-{os.getpid()}"
    quota = {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "10000"}
    with sampled_in_cgroup(group, QUOTA_CHILD, tmp_path / "q.trace", quota) as last:
        # the cgroup was made by this test, so its counters started at 0; the kernel's own file agrees
        stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
        assert 0 < last.cfs_throttled_periods <= int(stat["nr_throttled"])
        assert 0 < last.cfs_throttled_ns <= int(stat["throttled_time"])
        assert last.cfs_throttled_periods <= last.cfs_periods <= int(stat["nr_periods"])


PRESSURE_CHILD = textwrap.dedent(
    """
    import subprocess, sys
    from pathlib import Path
    from megatrace.tracer.host_signals import HostSampler
    from megatrace.tracer.ringfile import RankIdentity, RingWriter

    sys.stdin.readline()  # the test has moved this process into its cgroup v2
    writer = RingWriter(Path(sys.argv[1]), RankIdentity("p", 0, 0, 1, "h", 1, 1), capacity=16)
    sampler = HostSampler(writer, 10**9)
    print(sampler.cgroup.pressure, flush=True)
    burn = [sys.executable, "-c", "while True: pass"]
    burners = [subprocess.Popen(burn) for _ in range(4)]  # more runnable tasks than this machine's CPUs
    try:
        for _ in range(600):
            if sampler.sample().cpu_pressure_ns > 0:
                break
            __import__("time").sleep(0.05)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    writer.close()
    """
)


def test_a_real_cgroup_v2_gives_its_own_pressure(tmp_path: Path) -> None:
    """A cgroup made here in the unified hierarchy (this machine mounts it beside the v1 controllers,
    with no controller, but every v2 cgroup has its pressure files): a process in it whose children
    contend for the CPUs reads the pressure of its own cgroup, not of the root's."""
    unified = Path("/sys/fs/cgroup/unified")
    assert (unified / "cpu.pressure").exists(), "this machine mounts cgroup2 with pressure accounting"
    group = unified / f"megatrace-test-{os.getpid()}"
    with sampled_in_cgroup(group, PRESSURE_CHILD, tmp_path / "p.trace", {}) as last:
        first_line = (group / "cpu.pressure").read_text().split("\n")[0]
        some = dict(item.split("=") for item in first_line.split()[1:])
        # the cgroup was made by this test, so its pressure started at 0; the kernel's own file agrees
        assert 0 < last.cpu_pressure_ns <= int(some["total"]) * 1000


def test_the_sample_ring_keeps_the_newest_and_skips_a_slot_caught_mid_write(tmp_path: Path) -> None:
    writer = writer_in(tmp_path)
    rank = sampler(writer, v1_tree(tmp_path)[0], delayacct=False)
    base = rank.read()
    for n in range(1, HOST_SAMPLES + 7):
        rank.write(dataclasses.replace(base, time_ns=n))
    samples = read_header(writer.path).host_samples
    assert [s.time_ns for s in samples] == list(range(7, HOST_SAMPLES + 7))
    # the sampler zeroes a slot's check word first: a reader then leaves the slot out
    newest = host_sample_word((HOST_SAMPLES + 6 - 1) % HOST_SAMPLES)
    writer.header[newest + HOST_SAMPLE_CHECK] = 0
    assert [s.time_ns for s in read_header(writer.path).host_samples] == list(range(7, HOST_SAMPLES + 6))


def test_dataloader_wait_counts_the_ended_pauses_and_the_one_in_progress(tmp_path: Path) -> None:
    writer = writer_in(tmp_path)
    recorder = Recorder(writer, rank=1)
    pauses = Pauses(lambda: recorder)
    rank = sampler(writer, v1_tree(tmp_path)[0], delayacct=False)
    pauses.end(pauses.begin("dataloader"))
    ended = read_ring(writer.path).header.pauses["dataloader"].total_ns
    assert rank.read().dataloader_ns == ended
    token = pauses.begin("dataloader")
    since = read_ring(writer.path).header.pauses["dataloader"].since_ns
    assert rank.read(now_ns=since + 5_000_000).dataloader_ns == ended + 5_000_000
    pauses.end(token)


def cyclic_garbage(n: int = 20000) -> None:
    nodes = [[] for _ in range(n)]
    for node in nodes:
        node.append(node)


def test_every_collection_is_counted_and_long_ones_become_gc_spans(tmp_path: Path) -> None:
    writer = writer_in(tmp_path)
    recorder = Recorder(writer, rank=1)
    hook = GcSpans(lambda: recorder, span_ns=0)
    hook.install()
    try:
        gc.collect()
        cyclic_garbage()
        collected = gc.collect()
    finally:
        hook.uninstall()
    snap = read_ring(writer.path)
    spans = snap.records[snap.records["op"] == OP_GC]
    assert snap.header.gc_collections == len(spans) >= 2 and snap.header.gc_ns > 0
    last = spans[-1]
    assert (int(last["peer"]), int(last["nbytes"]), int(last["comm_id"])) == (2, collected, 0)
    assert collected >= 20000 and list(spans["seq"]) == list(range(len(spans)))
    assert int((spans["complete_ns"] - spans["enqueue_ns"]).sum()) == snap.header.gc_ns
    assert SPAN_NAMES[OP_GC] == "gc"
    count = snap.header.gc_collections
    gc.collect()
    assert read_header(writer.path).gc_collections == count  # uninstalled: no longer counted


def test_short_collections_are_counted_without_a_span(tmp_path: Path) -> None:
    writer = writer_in(tmp_path)
    recorder = Recorder(writer, rank=1)
    hook = GcSpans(lambda: recorder, span_ns=10**15)
    hook.install()
    try:
        gc.collect()
        gc.collect()
    finally:
        hook.uninstall()
    snap = read_ring(writer.path)
    assert snap.header.gc_collections >= 2 and not (snap.records["op"] == OP_GC).any()


def test_the_watchdog_samples_and_its_dumps_and_agent_windows_carry_the_block(tmp_path: Path) -> None:
    proc, _, _ = v1_tree(tmp_path)
    writer = writer_in(tmp_path)
    recorder = Recorder(writer, rank=1)
    rank = HostSampler(writer, 10**6, proc_self=proc, main_tid=TID, delayacct=False)
    dog = Watchdog(recorder, tmp_path / "job", 1, 10**12, rank)
    dog.start_thread()
    try:
        deadline_samples = 3
        for _ in range(2000):
            if len(read_header(writer.path).host_samples) >= deadline_samples:
                break
            threading.Event().wait(0.01)
        path = dog.dump("signal")
    finally:
        dog.stop()
    assert path is not None
    dumped = read_dump(path)
    live = read_header(writer.path)
    h = dumped.header
    assert (
        len(h.host_samples) >= deadline_samples and h.host_samples == live.host_samples[: len(h.host_samples)]
    )
    assert (h.cgroup_version, h.host_notes, h.main_thread_id) == (1, live.host_notes, live.main_thread_id)
    assert (h.gc_collections, h.gc_ns) == (live.gc_collections, live.gc_ns)
    text = path.read_bytes()
    assert dump_window(text, 0).count(b"\n# host ") == len(h.host_samples)
    body, _ = ring_window(writer.path, Window(last=1), 10, writer_alive=True)
    window = tmp_path / "window.trace"
    window.write_bytes(body)
    assert read_header(window).host_samples == read_header(writer.path).host_samples


def test_a_dump_round_trips_every_host_field(tmp_path: Path) -> None:
    writer = writer_in(tmp_path)
    rank = sampler(writer, v1_tree(tmp_path)[0], delayacct=False)
    rank.write(HostSample(*range(1, len(HOST_SAMPLE_FIELDS) + 1)))
    rank.write(HostSample(*(-1 for _ in HOST_SAMPLE_FIELDS)))
    writer.set_host_notes(("cpu.pressure: cgroup v1 has no per-cgroup pressure", "a note = with spaces"))
    snap = read_ring(writer.path)
    back = read_dump(write_dump(tmp_path / "d.dump", snap, "test")).header
    for key in ("host_samples", "host_notes", "cgroup_version", "main_thread_id", "gc_collections", "gc_ns"):
        assert getattr(back, key) == getattr(snap.header, key), key
    assert len(back.host_samples) == 2 and back.host_notes[1] == "a note = with spaces"


def test_version_3_files_read_with_no_host_block(tmp_path: Path) -> None:
    """A version 3 writer's file: a three-page header, the communicator table and records after it."""
    writer = writer_in(tmp_path)
    recorder = Recorder(writer, rank=1)
    recorder.end(recorder.begin(5, 1, 8, 1, -1, 0))
    sampler(writer, v1_tree(tmp_path)[0], delayacct=False).sample()
    recorder.publish()
    raw = bytearray(writer.path.read_bytes())
    words = np.frombuffer(raw, dtype="<i8", count=HEADER_SIZE_V3 // 8).copy()
    shift = int(words[5]) - HEADER_SIZE_V3
    words[W_VERSION], words[W_HEADER_SIZE], words[5], words[7] = (
        3,
        HEADER_SIZE_V3,
        HEADER_SIZE_V3,
        words[7] - shift,
    )
    old = tmp_path / "v3.trace"
    old.write_bytes(words.tobytes() + bytes(raw[HEADER_SIZE_V3 + shift :]))
    snap = read_ring(old)
    assert snap.header.version == 3 and snap.header.host_samples == () and snap.header.cgroup_version == 0
    assert snap.records.tolist() == read_ring(writer.path).records.tolist()
