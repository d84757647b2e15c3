"""docs/metrics.md documents every metric the agent exports."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from megatrace.exporters.gpu import GpuCollector
from megatrace.exporters.guard import GuardedCollectors
from megatrace.exporters.infiniband import InfinibandCollector
from megatrace.exporters.tracer_files import TracerCollector
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import OP_CODES, RankIdentity, RingWriter, comm_id, ring_path
from tests.exporters.exposition import names, render
from tests.support.fake_pynvml import FakeGpu, FakeNvml

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "sysfs"
HW_PATTERN = "megatrace_infiniband_hw_<counter>_total"
# Documented mappings for files the fixture HCAs (mlx4, mlx5) do not have.
NOT_IN_FIXTURES = {
    "megatrace_infiniband_port_discards_received_total",
    "megatrace_infiniband_rx_dct_connect_requests_total",
}


def everything_exported(tmp_path: Path) -> set[str]:
    identity = RankIdentity("pretrain-42", 0, 0, 1, "node-a", os.getpid(), time.time_ns())
    ring = ring_path(tmp_path / "pretrain-42", 0)
    writer = RingWriter(ring, identity, capacity=16, comm_table_bytes=4096, stall_threshold_ns=3_000_000_000)
    recorder = Recorder(writer, 0)
    recorder.end(recorder.begin(comm_id((0,)), OP_CODES["all_reduce"], 1024, 1, -1, 0))
    recorder.mark_step()
    recorder.publish()
    gpu = FakeGpu(uuid="GPU-1", nvlinks=[1], remapped_rows=(1, 0, 0, 0))
    nvml = FakeNvml([gpu])
    gpu_collector = GpuCollector(nvml, pods=lambda: {"GPU-1": ("ns", "pod", "c")}, xid_wait_ms=20)
    guarded = GuardedCollectors(
        {
            "gpu": gpu_collector,
            "infiniband": InfinibandCollector(FIXTURES / "infiniband"),
            "roce": InfinibandCollector(FIXTURES / "roce"),
            "tracer": TracerCollector(tmp_path),
        }
    )
    try:
        exported = names(render(guarded))
    finally:
        guarded.close()
        writer.close()
    assert nvml.init_count == 0
    return exported


def test_every_exported_metric_is_documented(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(megatrace_[a-z0-9_<>]+)`", doc))
    exported = everything_exported(tmp_path)
    assert len(exported) > 90
    missing = sorted(
        name
        for name in exported
        if name not in documented
        and not (name.startswith("megatrace_infiniband_hw_") and HW_PATTERN in documented)
    )
    assert missing == []


def test_documented_metrics_exist(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(megatrace_[a-z0-9_]+)`", doc, flags=re.MULTILINE))
    exported = everything_exported(tmp_path)
    assert sorted(documented - exported - NOT_IN_FIXTURES) == []
