"""docs/metrics.md documents every metric the agent exports: every collector in the collectors table
is built through the table (so a collector added to it is checked too) and scraped."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from megatrace.exporters.collectors import COLLECTORS, build
from megatrace.exporters.guard import Collector, GuardedCollectors
from megatrace.exporters.settings import load
from megatrace.tracer.format import HOST_SAMPLE_FIELDS
from megatrace.tracer.host_signals import CgroupDirs, HostSampler
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import OP_CODES, HostSample, RankIdentity, RingWriter, comm_id, ring_path
from tests.exporters.exposition import names, render
from tests.support.fake_pynvml import FakeGpu, FakeNvml
from tests.support.kubelet import kubelet, list_response, pod
from tests.support.services import free_port

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "sysfs"
HW_PATTERN = "megatrace_infiniband_hw_<counter>_total"
# Documented mappings for files the fixture HCAs (mlx4, mlx5) do not have.
NOT_IN_FIXTURES = {
    "megatrace_infiniband_port_discards_received_total",
    "megatrace_infiniband_rx_dct_connect_requests_total",
}
# Collectors built more than once, each time with these settings over the common ones.
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "infiniband": [{"sysfs_root": str(FIXTURES / "infiniband")}, {"sysfs_root": str(FIXTURES / "roce")}],
}


def documented_names(doc: str) -> set[str]:
    """Metric names (and name patterns) a metric reference mentions."""
    return set(re.findall(r"`(megatrace_[a-z0-9_<>]+)`", doc))


def undocumented(exported: set[str], doc: str) -> list[str]:
    """The exported metrics `doc` does not mention."""
    documented = documented_names(doc)
    return sorted(
        name
        for name in exported
        if name not in documented
        and not (name.startswith("megatrace_infiniband_hw_") and HW_PATTERN in documented)
    )


def write_rank(trace_dir: Path) -> RingWriter:
    """One traced rank that ran one all-reduce and one step."""
    identity = RankIdentity("pretrain-42", 0, 0, 1, "node-a", os.getpid(), time.time_ns())
    ring = ring_path(trace_dir / "pretrain-42", 0)
    writer = RingWriter(ring, identity, capacity=16, comm_table_bytes=4096, stall_threshold_ns=3_000_000_000)
    recorder = Recorder(writer, 0)
    recorder.end(recorder.begin(comm_id((0,)), OP_CODES["all_reduce"], 1024, 1, -1, 0))
    recorder.mark_step()
    recorder.publish()
    # one host sample with every signal available, so every host series is exported
    HostSampler(writer, 10**9, cgroup=CgroupDirs(version=2), delayacct=True).write(
        HostSample(**dict.fromkeys(HOST_SAMPLE_FIELDS, 1))
    )
    return writer


def exercise(collector: Collector) -> None:
    """Make a collector serving its own port (the trace endpoint) answer one request, so that its
    request counters exist."""
    address = getattr(collector, "address", None)
    if address is not None:
        conn = http.client.HTTPConnection(*address[:2], timeout=30)
        conn.request("GET", "/v1/jobs")
        conn.getresponse().read()
        conn.close()


def build_all(settings: Mapping[str, Any], nvml: FakeNvml) -> Iterator[tuple[str, Collector]]:
    """Every collector of the table, through the table, once per variant of its settings."""
    for name in COLLECTORS:
        for number, variant in enumerate(VARIANTS.get(name, [{}])):
            config = load(None, {**settings, **variant, "collectors": [name]}, environ={})
            collector = build(name, config, nvml)
            yield f"{name}-{number}", collector
            exercise(collector)


def everything_exported(tmp_path: Path, settings: Mapping[str, Any] | None = None) -> set[str]:
    """Names of every metric the table's collectors export, on fixture data, with `settings` added."""
    writer = write_rank(tmp_path / "trace")
    (tmp_path / "token").write_text("doc-test-token\n")
    gpu = FakeGpu(uuid="GPU-1", nvlinks=[1], remapped_rows=(1, 0, 0, 0))
    nvml = FakeNvml([gpu])
    common = {
        "trace_dir": str(tmp_path / "trace"),
        "podresources_socket": str(tmp_path / "kubelet.sock"),
        "xid_wait_ms": 20,
        "trace_listen": f"127.0.0.1:{free_port()}",
        "trace_token_file": str(tmp_path / "token"),
        **(settings or {}),
    }
    collectors: dict[str, Collector] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(writer.close)
        stack.enter_context(
            kubelet(tmp_path / "kubelet.sock", list_response(pod("ns", "pod", "c", ["GPU-1"])))
        )
        stack.callback(lambda: GuardedCollectors(collectors).close())
        for key, collector in build_all(common, nvml):
            collectors[key] = collector
        assert [key.rsplit("-", 1)[0] for key in collectors if key.endswith("-0")] == list(COLLECTORS)
        exported = names(render(GuardedCollectors(collectors)))
    assert nvml.init_count == 0
    return exported


def test_every_exported_metric_is_documented(tmp_path: Path) -> None:
    exported = everything_exported(tmp_path)
    assert len(exported) > 90
    assert "megatrace_gpu_pod_info" in exported  # attribution through the configured kubelet socket
    assert undocumented(exported, (ROOT / "docs" / "metrics.md").read_text()) == []


def test_documented_metrics_exist(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(megatrace_[a-z0-9_]+)`", doc, flags=re.MULTILINE))
    exported = everything_exported(tmp_path)
    assert sorted(documented - exported - NOT_IN_FIXTURES) == []
