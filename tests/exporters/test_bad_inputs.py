"""The agent with hostile or missing inputs: FIFOs, huge or negative counters, no sysfs, no NVML.

One bad input must cost at most its own collector, say so once, and never hang or fail a scrape.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
import requests

from megatrace.exporters.cli import build_registry
from megatrace.exporters.gpu import GpuCollector
from megatrace.exporters.guard import GuardedCollectors
from megatrace.exporters.infiniband import InfinibandCollector
from megatrace.exporters.server import MetricsServer
from megatrace.exporters.tracer_files import TracerCollector
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import (
    OP_CODES,
    W_STEP_COUNT,
    W_WAIT_NS_TOTAL,
    RankIdentity,
    RingWriter,
    comm_id,
    ring_path,
)
from tests.exporters.exposition import render, samples, value
from tests.support.fake_pynvml import FakeGpu, FakeNvml

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
PORT_DIR = "devices/pci0000:00/0000:00:02.0/0000:3b:00.0/infiniband/mlx5_0/ports/1"
SYMBOL_ERRORS = "megatrace_infiniband_symbol_error_total"


@pytest.fixture
def serve() -> Iterator:
    started: list[MetricsServer] = []

    def start(guarded: GuardedCollectors) -> str:
        server = MetricsServer(("127.0.0.1", 0), build_registry(guarded))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURES / "infiniband", root, symlinks=True)
    return root


def live_rank(trace_dir: Path, job: str, rank: int) -> RingWriter:
    identity = RankIdentity(job, rank, rank, 2, "gpu-node-07", os.getpid(), time.time_ns())
    writer = RingWriter(ring_path(trace_dir / job, rank), identity, capacity=16, comm_table_bytes=4096)
    recorder = Recorder(writer, rank)
    recorder.end(recorder.begin(comm_id((0, 1)), OP_CODES["all_reduce"], 1024, 1, -1, 0))
    recorder.publish()
    return writer


def test_fifos_in_the_trace_dir_and_the_sysfs_tree_never_hang_a_scrape(
    serve, sysfs: Path, tmp_path: Path
) -> None:
    trace_dir = tmp_path / "trace"
    writer = live_rank(trace_dir, "pretrain-42", 0)
    os.mkfifo(trace_dir / "pretrain-42" / "rank-1.trace")
    symbol_error = sysfs / PORT_DIR / "counters" / "symbol_error"
    symbol_error.unlink()
    os.mkfifo(symbol_error)
    guarded = GuardedCollectors(
        {"infiniband": InfinibandCollector(sysfs), "tracer": TracerCollector(trace_dir)}
    )
    url = serve(guarded)
    try:
        for _ in range(2):
            text = requests.get(f"{url}/metrics", timeout=20).text
            assert value(text, "megatrace_tracer_rank_alive", job="pretrain-42", rank="0") == 1
            assert value(text, "megatrace_infiniband_link_downed_total", device="mlx5_0", port="1") == 1
            port = {("device", "mlx5_0"), ("port", "1")}
            assert not [n for n, labels in samples(text) if n == SYMBOL_ERRORS and port <= set(labels)]
            assert value(text, "megatrace_exporter_collector_up", collector="tracer") == 1
            assert value(text, "megatrace_exporter_collector_up", collector="infiniband") == 1
    finally:
        writer.close()
        guarded.close()


def found(text: str, metric: str, /, **labels: str) -> list[float]:
    """Values of the samples `metric` whose labels include `labels` (none when it was left out)."""
    return [v for (n, ls), v in samples(text).items() if n == metric and set(labels.items()) <= set(ls)]


def test_a_counter_no_float_holds_costs_only_its_own_series(
    serve, sysfs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (sysfs / PORT_DIR / "counters" / "symbol_error").write_text("9" * 400 + "\n")
    trace_dir = tmp_path / "trace"
    writer = live_rank(trace_dir, "pretrain-42", 0)
    url = serve(
        GuardedCollectors({"infiniband": InfinibandCollector(sysfs), "tracer": TracerCollector(trace_dir)})
    )
    caplog.set_level(logging.DEBUG, logger="megatrace")
    try:
        for _ in range(2):
            response = requests.get(f"{url}/metrics", timeout=20)
            assert response.status_code == 200
            text = response.text
            assert value(text, "megatrace_exporter_collector_up", collector="infiniband") == 1
            assert value(text, "megatrace_exporter_collector_up", collector="tracer") == 1
            assert value(text, "megatrace_tracer_rank_alive", job="pretrain-42", rank="0") == 1
            assert found(text, SYMBOL_ERRORS, device="mlx5_0", port="1") == []  # only it is left out
            assert len(found(text, "megatrace_infiniband_link_downed_total", device="mlx5_0", port="1")) == 1
            assert value(text, "megatrace_infiniband_state_id", device="mlx5_0", port="1") == 4
        openmetrics = requests.get(
            f"{url}/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=20
        )
        assert openmetrics.status_code == 200
        assert 'symbol_error_total{device="mlx5_0",port="1"}' not in openmetrics.text
        assert 'symbol_error_total{device="mlx4_0",port="1"}' in openmetrics.text
    finally:
        writer.close()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and SYMBOL_ERRORS in said[0] and "cannot be exported" in said[0], said


def test_a_negative_counter_is_left_out_not_exported(sysfs: Path, tmp_path: Path) -> None:
    (sysfs / PORT_DIR / "counters" / "symbol_error").write_text("-7\n")
    trace_dir = tmp_path / "trace"
    writer = live_rank(trace_dir, "pretrain-42", 0)
    writer.header[W_WAIT_NS_TOTAL] = -7
    writer.header[W_STEP_COUNT] = -7
    guarded = GuardedCollectors(
        {"infiniband": InfinibandCollector(sysfs), "tracer": TracerCollector(trace_dir)}
    )
    try:
        text = render(guarded)
    finally:
        writer.close()
    negative = [key for key, number in samples(text).items() if key[0].endswith("_total") and number < 0]
    assert negative == []
    assert found(text, SYMBOL_ERRORS, device="mlx5_0", port="1") == []
    assert found(text, "megatrace_tracer_steps_total", job="pretrain-42", rank="0") == []
    assert found(text, "megatrace_tracer_collective_wait_seconds_total", job="pretrain-42") == []
    calls = found(text, "megatrace_tracer_collective_calls_total", job="pretrain-42", op="all_reduce")
    assert calls == [1]
    assert value(text, "megatrace_exporter_collector_up", collector="infiniband") == 1
    assert value(text, "megatrace_exporter_collector_up", collector="tracer") == 1


@pytest.mark.parametrize("make_root", ["missing", "a file"])
def test_a_sysfs_root_that_cannot_be_read_is_down_with_one_log_line(
    make_root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "sys"
    if make_root == "a file":
        root.write_text("not a directory\n")
    guarded = GuardedCollectors({"infiniband": InfinibandCollector(root)})
    caplog.set_level(logging.DEBUG)
    for scrape in (1, 2, 3):
        text = render(guarded)
        assert value(text, "megatrace_exporter_collector_up", collector="infiniband") == 0
        assert value(text, "megatrace_exporter_collector_errors_total", collector="infiniband") == scrape
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1
    assert str(root) in loud[0].getMessage() or str(root) in str(loud[0].exc_info[1])


def test_gpu_collector_without_nvml_says_so_in_one_warning_line_then_exports_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CPU node is normal, not an error: one warning line (no traceback), collector_up 0."""
    nvml = FakeNvml([FakeGpu(uuid="GPU-0", bus_id="00000000:18:00.0")])
    nvml.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    collector = GpuCollector(nvml, xid_wait_ms=20)
    guarded = GuardedCollectors({"gpu": collector})
    caplog.set_level(logging.DEBUG)
    try:
        collector.start()
        for _ in range(3):
            assert value(render(guarded), "megatrace_exporter_collector_up", collector="gpu") == 0
        loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [(r.levelname, r.exc_info) for r in loud] == [("WARNING", None)], caplog.text
        assert "NVML not available" in loud[0].getMessage() and "\n" not in loud[0].getMessage()
        nvml.init_error = None
        assert value(render(guarded), "megatrace_exporter_collector_up", collector="gpu") == 1
        assert any("recovered" in r.getMessage() for r in caplog.records)
    finally:
        guarded.close()
