"""The fault harness writes and reads the files each cgroup version documents (v2 cannot be mounted
here: these check its file texts on a folder laid out as the kernel lays out a cgroup)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.host_faults import RankCgroup, cgroup_version


def cgroup_folder(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_v2_limits_are_cpu_max_memory_high_and_io_max(tmp_path: Path) -> None:
    folder = cgroup_folder(
        tmp_path,
        {
            "cpu.stat": "usage_usec 912\nuser_usec 500\nsystem_usec 412\nnr_periods 40\nnr_throttled 31\n"
            "throttled_usec 250000\n",
            "memory.events": "low 0\nhigh 17\nmax 4\noom 0\noom_kill 0\n",
            "memory.current": "104857600\n",
            "memory.stat": "anon 73400320\nfile 31457280\nworkingset_refault_anon 0\n"
            "workingset_refault_file 900\n",
            "io.stat": "8:16 rbytes=1459200 wbytes=314773504 rios=192 wios=353 dbytes=0 dios=0\n"
            "7:0 rbytes=65536 wbytes=0 rios=1 wios=0 dbytes=0 dios=0\n",
        },
    )
    group = RankCgroup(2, dict.fromkeys(("cpu", "memory", "io"), folder))
    group.limit_cpu(10_000)
    group.limit_memory(64 << 20)
    group.throttle_reads("7:0", 262144)
    assert (folder / "cpu.max").read_text() == "10000 100000"
    assert (folder / "memory.high").read_text() == str(64 << 20)
    assert (folder / "io.max").read_text() == "7:0 rbps=262144"
    assert group.cpu_stat()["nr_throttled"] == 31
    assert group.memory_limit_hits() == 21
    assert group.memory_used() == (104857600, 31457280)
    assert group.memory_refaults() == 900
    assert group.bytes_read("7:0") == 65536 and group.bytes_read("8:0") == 0


def test_v1_limits_are_cfs_quota_limit_in_bytes_and_throttle_files(tmp_path: Path) -> None:
    cpu, memory, blkio = (tmp_path / name for name in ("cpu", "memory", "blkio"))
    for folder in (cpu, memory, blkio):
        folder.mkdir()
    cgroup_folder(cpu, {"cpu.stat": "nr_periods 40\nnr_throttled 31\nthrottled_time 250000000\n"})
    cgroup_folder(
        memory,
        {
            "memory.failcnt": "12\n",
            "memory.usage_in_bytes": "104857600\n",
            "memory.stat": "cache 31457280\nrss 73400320\nworkingset_refault 700\n",
        },
    )
    cgroup_folder(blkio, {"blkio.throttle.io_service_bytes": "7:0 Read 65536\n7:0 Write 0\nTotal 65536\n"})
    group = RankCgroup(1, {"cpu": cpu, "memory": memory, "io": blkio})
    group.limit_cpu(10_000)
    group.limit_memory(64 << 20)
    group.throttle_reads("7:0", 262144)
    assert (cpu / "cpu.cfs_quota_us").read_text() == "10000"
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (memory / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (blkio / "blkio.throttle.read_bps_device").read_text() == "7:0 262144"
    assert group.cpu_stat()["nr_throttled"] == 31
    assert group.memory_limit_hits() == 12
    assert group.memory_used() == (104857600, 31457280)
    assert group.memory_refaults() == 700
    assert group.bytes_read("7:0") == 65536


@pytest.mark.parametrize(("files", "version"), [({"cgroup.controllers": "cpu io memory\n"}, 2), ({}, 1)])
def test_the_version_is_2_where_the_unified_hierarchy_is_the_root(
    tmp_path: Path, files: dict[str, str], version: int
) -> None:
    assert cgroup_version(cgroup_folder(tmp_path, files)) == version
