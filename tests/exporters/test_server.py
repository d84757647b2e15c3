"""The agent over HTTP: isolation of failing collectors, concurrent scrapes, the command, real Prometheus."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from megatrace.exporters.cli import build_registry, own_path_registries
from megatrace.exporters.gpu import GpuCollector
from megatrace.exporters.guard import GuardedCollectors
from megatrace.exporters.infiniband import InfinibandCollector
from megatrace.exporters.server import MetricsServer
from megatrace.exporters.tracer_files import TracerCollector
from megatrace.exporters.xid import XidCounts
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import OP_CODES, RankIdentity, RingWriter, comm_id, ring_path
from tests.exporters.exposition import samples, value
from tests.support.fake_pynvml import FakeGpu, FakeNvml
from tests.support.services import free_port, prometheus_argv, running

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
AGENT = [sys.executable, "-m", "megatrace.cli", "exporter"]


class Broken:
    def collect(self):
        yield from ()
        raise OSError("sysfs went away")


@pytest.fixture
def serve() -> Iterator:
    started: list[tuple[MetricsServer, GuardedCollectors]] = []

    def start(guarded: GuardedCollectors) -> str:
        server = MetricsServer(("127.0.0.1", 0), build_registry(guarded), paths=own_path_registries(guarded))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append((server, guarded))
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server, guarded in started:
        server.shutdown()
        server.server_close()
        guarded.close()


def test_a_failing_collector_never_breaks_the_scrape(serve) -> None:
    url = serve(GuardedCollectors({"infiniband": InfinibandCollector(FIXTURES / "roce"), "tracer": Broken()}))
    for scrape in (1, 2):
        response = requests.get(f"{url}/metrics", timeout=10)
        assert response.status_code == 200
        text = response.text
        assert value(text, "megatrace_infiniband_state_id", device="mlx5_2", port="1") == 4
        assert value(text, "megatrace_exporter_collector_up", collector="infiniband") == 1
        assert value(text, "megatrace_exporter_collector_up", collector="tracer") == 0
        assert value(text, "megatrace_exporter_collector_errors_total", collector="tracer") == scrape
        assert value(text, "megatrace_exporter_collector_errors_total", collector="infiniband") == 0
        assert value(text, "megatrace_exporter_collector_duration_seconds", collector="infiniband") >= 0


def test_health_index_openmetrics_and_unknown_paths(serve) -> None:
    url = serve(GuardedCollectors({"infiniband": InfinibandCollector(FIXTURES / "roce")}))
    health = requests.get(f"{url}/healthz", timeout=10)
    assert (health.status_code, health.text) == (200, "ok\n")
    assert "/metrics" in requests.get(url, timeout=10).text
    assert requests.get(f"{url}/nope", timeout=10).status_code == 404
    om = requests.get(f"{url}/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=10)
    assert om.headers["Content-Type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")
    prometheus_accept = (
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
        "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    )
    text = requests.get(f"{url}/metrics", headers={"Accept": prometheus_accept}, timeout=10)
    assert text.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# EOF" not in text.text
    assert "megatrace_infiniband_state_id{" in text.text
    refused = requests.get(
        f"{url}/metrics", headers={"Accept": "text/plain;q=0, application/openmetrics-text"}, timeout=10
    )
    assert refused.headers["Content-Type"].startswith("application/openmetrics-text")


def test_concurrent_scrapes_while_xid_events_arrive(serve) -> None:
    nvml = FakeNvml([FakeGpu(uuid=f"GPU-{i:08x}", bus_id=f"00000000:{0x18 + i:02X}:00.0") for i in range(8)])
    gpu = GpuCollector(nvml, xid_wait_ms=20)
    gpu.start()  # as the agent does: XIDs before the first scrape count too
    guarded = GuardedCollectors({"gpu": gpu, "infiniband": InfinibandCollector(FIXTURES / "infiniband")})
    url = serve(guarded)
    failures: list[str] = []
    seen_xids: list[list[float]] = [[] for _ in range(6)]

    def scrape(worker: int) -> None:
        with requests.Session() as session:
            for _ in range(8):
                response = session.get(f"{url}/metrics", timeout=30)
                if response.status_code != 200:
                    failures.append(f"HTTP {response.status_code}")
                    continue
                got = samples(response.text)
                ups = [v for (n, ls), v in got.items() if n == "megatrace_gpu_up"]
                if ups != [1.0] * 8:
                    failures.append(f"gpu_up {ups}")
                seen_xids[worker].append(
                    got[
                        (
                            "megatrace_gpu_xid_errors_total",
                            (("gpu", "3"), ("uuid", "GPU-00000003"), ("xid", "79")),
                        )
                    ]
                )

    workers = [threading.Thread(target=scrape, args=(i,)) for i in range(6)]
    for worker in workers:
        worker.start()
    for _ in range(5):
        assert nvml.inject_xid(3, 79) == 1
        time.sleep(0.01)
    for worker in workers:
        worker.join(timeout=120)
    assert failures == []
    for series in seen_xids:
        assert series == sorted(series), "an XID counter went backwards"
    deadline = time.monotonic() + 10
    while sum(gpu.xid.snapshot().get(3, XidCounts()).by_xid.values()) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert (
        value(
            requests.get(f"{url}/metrics", timeout=10).text,
            "megatrace_gpu_xid_errors_total",
            gpu="3",
            xid="79",
        )
        == 5
    )


def test_the_tracer_collector_alone_on_its_own_path(serve, tmp_path: Path) -> None:
    writer = live_rank(tmp_path, "pretrain-42", 0)
    url = serve(
        GuardedCollectors(
            {"infiniband": InfinibandCollector(FIXTURES / "roce"), "tracer": TracerCollector(tmp_path)}
        )
    )
    everything = requests.get(f"{url}/metrics", timeout=10)
    tracer = requests.get(f"{url}/metrics/tracer", timeout=10)
    assert (everything.status_code, tracer.status_code) == (200, 200)
    assert tracer.headers["Content-Type"] == everything.headers["Content-Type"]
    tracer_names = {name for name, _ in samples(tracer.text)}
    all_names = {name for name, _ in samples(everything.text)}
    assert any(name.startswith("megatrace_infiniband_") for name in all_names)
    assert not any(name.startswith("megatrace_infiniband_") for name in tracer_names)
    ours = {name for name in all_names if name.startswith("megatrace_tracer_")}
    assert ours and {name for name in tracer_names if name.startswith("megatrace_tracer_")} == ours
    rank = {"job": "pretrain-42", "rank": "0"}
    assert value(tracer.text, "megatrace_tracer_comm_op_duration_seconds_count", **rank) == 1
    assert value(tracer.text, "megatrace_tracer_pause_seconds", **rank, kind="eval") == 0
    assert value(tracer.text, "megatrace_exporter_collector_up", collector="tracer") == 1
    assert requests.get(f"{url}/metrics/nope", timeout=10).status_code == 404
    without = serve(GuardedCollectors({"infiniband": InfinibandCollector(FIXTURES / "roce")}))
    assert requests.get(f"{without}/metrics/tracer", timeout=10).status_code == 404
    writer.close()


def live_rank(trace_dir: Path, job: str, rank: int) -> RingWriter:
    identity = RankIdentity(job, rank, rank, 2, "node-a", os.getpid(), time.time_ns())
    writer = RingWriter(ring_path(trace_dir / job, rank), identity, capacity=16, comm_table_bytes=4096)
    recorder = Recorder(writer, rank)
    recorder.end(recorder.begin(comm_id((0, 1)), OP_CODES["all_reduce"], 1024, 1, -1, 0))
    recorder.publish()  # the watchdog's tick
    return writer


@pytest.mark.slow
def test_the_command_serves_until_sigterm(tmp_path: Path) -> None:
    writer = live_rank(tmp_path / "trace", "pretrain-42", 1)
    port = free_port()
    argv = [
        *AGENT,
        f"--listen=127.0.0.1:{port}",
        f"--sysfs-root={FIXTURES / 'infiniband'}",
        f"--trace-dir={tmp_path / 'trace'}",
        "--collectors=infiniband,tracer",
    ]
    with running(argv, f"http://127.0.0.1:{port}/healthz", tmp_path / "agent.log") as proc:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert value(text, "megatrace_infiniband_link_downed_total", device="mlx5_0", port="1") == 1
        assert value(text, "megatrace_tracer_rank_alive", job="pretrain-42", rank="1") == 1
        assert {
            dict(ls)["collector"] for (n, ls) in samples(text) if n == "megatrace_exporter_collector_up"
        } == {
            "infiniband",
            "tracer",
        }
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    writer.close()


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--collectors=gpu,bogus"], "collectors"),
        (["--listen=nowhere"], "listen"),
        (["--tracer-grace=-1"], "tracer_grace_seconds"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(flags: list[str], key: str) -> None:
    result = subprocess.run([*AGENT, *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"key '{key}'" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_environment_value_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "MEGATRACE_EXPORTER_XID_WAIT_MS": "soon"}
    result = subprocess.run(AGENT, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert "xid_wait_ms" in result.stderr


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with MetricsServer(("127.0.0.1", 0), build_registry(GuardedCollectors({}))) as taken:
        port = taken.server_address[1]
        result = subprocess.run(
            [*AGENT, f"--listen=127.0.0.1:{port}", "--collectors=infiniband"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert "cannot listen" in result.stderr


@pytest.mark.slow
def test_prometheus_keeps_the_training_job_label_with_honor_labels(tmp_path: Path) -> None:
    writer = live_rank(tmp_path / "trace", "pretrain-42", 0)
    agent_port, prom_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: megatrace-exporter\n"
        "    honor_labels: true\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{agent_port}']}}]\n"
    )
    agent = [
        *AGENT,
        f"--listen=127.0.0.1:{agent_port}",
        f"--trace-dir={tmp_path / 'trace'}",
        "--collectors=tracer",
    ]
    with (
        running(agent, f"http://127.0.0.1:{agent_port}/healthz", tmp_path / "agent.log"),
        running(
            prometheus_argv(config, tmp_path / "data", prom_port),
            f"http://127.0.0.1:{prom_port}/-/ready",
            tmp_path / "prometheus.log",
        ),
    ):
        deadline = time.monotonic() + 60
        result: list = []
        while not result:
            assert time.monotonic() < deadline, "Prometheus never scraped the agent"
            time.sleep(0.5)
            answer = requests.get(
                f"http://127.0.0.1:{prom_port}/api/v1/query",
                params={"query": "megatrace_tracer_rank_alive"},
                timeout=10,
            ).json()
            result = answer["data"]["result"]
        assert result[0]["metric"]["job"] == "pretrain-42"
        assert result[0]["metric"]["rank"] == "0"
        assert result[0]["value"][1] == "1"
    writer.close()
