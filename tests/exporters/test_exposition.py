"""The fast text exposition says exactly what prometheus_client's generate_latest says."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from megatrace.exporters.exposition import render_text
from megatrace.exporters.gpu import GpuCollector
from megatrace.exporters.infiniband import InfinibandCollector
from tests.support.fake_pynvml import FakeGpu, FakeNvml

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"


@pytest.mark.parametrize("fixture", ["infiniband", "roce"])
def test_infiniband_exposition_is_byte_identical(fixture: str) -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(InfinibandCollector(FIXTURES / fixture))
    assert render_text(registry) == generate_latest(registry)


def test_label_values_needing_escapes_are_byte_identical() -> None:
    gpu = FakeGpu(uuid="GPU-1", name='Odd "GPU" \\ with\nnewline', nvlinks=[1, 1])
    collector = GpuCollector(FakeNvml([gpu]), xid_wait_ms=20)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        fast = render_text(registry)
        assert b'name="Odd \\"GPU\\" \\\\ with\\nnewline"' in fast
        assert fast == generate_latest(registry)
    finally:
        collector.close()


def test_other_metric_types_fall_back_to_prometheus_client() -> None:
    registry = CollectorRegistry()
    Histogram("megatrace_test_seconds", "A histogram.", registry=registry).observe(0.3)
    assert render_text(registry) == generate_latest(registry)
