"""Benchmark of the node agent: scrape latency, CPU time per scrape and resident memory.

Runs, in the same invocation and on the same generated sysfs tree (8 RoCE mlx5 ports):
  1. node_exporter with only its infiniband collector,
  2. `megatrace exporter --collectors=infiniband` (the sysfs part alone),
  3. the agent with 8 GPUs (the pynvml test double) + the same 8 ports.
Each server is scraped N times over HTTP; CPU time is the server process's utime+stime delta.

    .venv/bin/python bench/bench_exporter.py [--scrapes 300]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.services import free_port, wait_http  # noqa: E402

COUNTERS = [
    "VL15_dropped",
    "excessive_buffer_overrun_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "multicast_rcv_packets",
    "multicast_xmit_packets",
    "port_rcv_constraint_errors",
    "port_rcv_data",
    "port_rcv_errors",
    "port_rcv_packets",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_xmit_data",
    "port_xmit_discards",
    "port_xmit_packets",
    "port_xmit_wait",
    "symbol_error",
    "unicast_rcv_packets",
    "unicast_xmit_packets",
]
HW_COUNTERS = [
    "duplicate_request",
    "implied_nak_seq_err",
    "lifespan",
    "local_ack_timeout_err",
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "req_cqe_error",
    "req_cqe_flush_error",
    "req_remote_access_errors",
    "req_remote_invalid_request",
    "resp_cqe_error",
    "resp_cqe_flush_error",
    "resp_local_length_error",
    "resp_remote_access_errors",
    "rnr_nak_retry_err",
    "roce_adp_retrans",
    "roce_adp_retrans_to",
    "roce_slow_restart",
    "roce_slow_restart_cnps",
    "roce_slow_restart_trans",
    "rp_cnp_handled",
    "rp_cnp_ignored",
    "rx_atomic_requests",
    "rx_icrc_encapsulated",
    "rx_read_requests",
    "rx_write_requests",
]


def make_sysfs(root: Path, hcas: int = 8) -> None:
    """A kernel-like tree: devices/<pci>/infiniband/mlx5_N with class/infiniband symlinks."""
    (root / "class" / "infiniband").mkdir(parents=True)
    for n in range(hcas):
        rel = f"devices/pci0000:00/0000:00:{n + 1:02x}.0/0000:{0x18 + n:02x}:00.0/infiniband/mlx5_{n}"
        device = root / rel
        port = device / "ports" / "1"
        for sub in ("counters", "hw_counters"):
            (port / sub).mkdir(parents=True)
        for name, text in (
            ("board_id", "MT_0000000838"),
            ("fw_ver", "28.39.1002"),
            ("hca_type", "MT4129"),
            ("node_guid", f"a088:c203:00{n:02x}:6b40"),
        ):
            (device / name).write_text(text + "\n")
        for name, text in (
            ("state", "4: ACTIVE"),
            ("phys_state", "5: LinkUp"),
            ("rate", "400 Gb/sec (4X NDR)"),
            ("link_layer", "Ethernet"),
        ):
            (port / name).write_text(text + "\n")
        for i, name in enumerate(COUNTERS):
            (port / "counters" / name).write_text(f"{(n + 1) * 1_000_003 * (i + 1)}\n")
        for i, name in enumerate(HW_COUNTERS):
            (port / "hw_counters" / name).write_text(f"{(n + 1) * 17 * (i + 1)}\n")
        (root / "class" / "infiniband" / f"mlx5_{n}").symlink_to(Path("../..") / rel)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(name: str, argv: list[str], port: int, scrapes: int, log: Path) -> dict[str, float | str]:
    url = f"http://127.0.0.1:{port}/metrics"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(url, timeout=60, proc=proc)
        session = requests.Session()
        for _ in range(5):
            session.get(url, timeout=30)
        series = sum(1 for line in session.get(url, timeout=30).text.splitlines() if line and line[0] != "#")
        cpu_before = cpu_seconds(proc.pid)
        latencies = []
        for _ in range(scrapes):
            start = time.perf_counter()
            response = session.get(url, timeout=30)
            latencies.append(time.perf_counter() - start)
            response.raise_for_status()
        cpu = (cpu_seconds(proc.pid) - cpu_before) / scrapes
        latencies.sort()
        return {
            "name": name,
            "series": series,
            "p50_ms": statistics.median(latencies) * 1e3,
            "p95_ms": latencies[int(0.95 * (len(latencies) - 1))] * 1e3,
            "cpu_ms": cpu * 1e3,
            "rss_mib": rss_mib(proc.pid),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def serve_with_fake_gpus(listen: str, sysfs: str) -> None:
    """The agent with 8 double GPUs and the infiniband collector (run as a child of the benchmark)."""
    from megatrace.exporters.cli import build_registry
    from megatrace.exporters.gpu import GpuCollector
    from megatrace.exporters.guard import GuardedCollectors
    from megatrace.exporters.infiniband import InfinibandCollector
    from megatrace.exporters.server import MetricsServer
    from megatrace.listen import parse_host_port
    from tests.support.fake_pynvml import FakeGpu, FakeNvml

    gpus = [
        FakeGpu(
            uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
            bus_id=f"00000000:{0x18 + i:02X}:00.0",
            nvlinks=[1] * 18,
        )
        for i in range(8)
    ]
    guarded = GuardedCollectors(
        {"gpu": GpuCollector(FakeNvml(gpus)), "infiniband": InfinibandCollector(sysfs)}
    )
    MetricsServer(parse_host_port(listen), build_registry(guarded)).serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--serve-fake-gpus", nargs=2, metavar=("LISTEN", "SYSFS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake_gpus:
        serve_with_fake_gpus(*args.serve_fake_gpus)
        return 0
    node_exporter = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if node_exporter is None:
        print("node_exporter is not installed (Debian package prometheus-node-exporter)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="megatrace-bench-") as tmp:
        work = Path(tmp)
        sysfs = work / "sys"
        make_sysfs(sysfs)
        runs = []
        port = free_port()
        runs.append(
            measure(
                "node_exporter --collector.infiniband (8 ports)",
                [
                    node_exporter,
                    f"--path.sysfs={sysfs}",
                    "--collector.disable-defaults",
                    "--collector.infiniband",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                port,
                args.scrapes,
                work / "node_exporter.log",
            )
        )
        port = free_port()
        agent = [sys.executable, "-m", "megatrace.cli", "exporter", f"--listen=127.0.0.1:{port}"]
        runs.append(
            measure(
                "megatrace exporter --collectors=infiniband (8 ports)",
                [*agent, f"--sysfs-root={sysfs}", "--collectors=infiniband"],
                port,
                args.scrapes,
                work / "agent.log",
            )
        )
        port = free_port()
        runs.append(
            measure(
                "megatrace agent, 8 GPUs (double) + 8 ports",
                [sys.executable, __file__, "--serve-fake-gpus", f"127.0.0.1:{port}", str(sysfs)],
                port,
                args.scrapes,
                work / "agent-gpus.log",
            )
        )
    print(f"{args.scrapes} scrapes each, same generated sysfs tree, {os.cpu_count()} CPUs")
    print(f"{'server':55} {'series':>6} {'p50 ms':>8} {'p95 ms':>8} {'CPU ms/scrape':>14} {'RSS MiB':>8}")
    for run in runs:
        print(
            f"{run['name']:55} {run['series']:>6} {run['p50_ms']:>8.2f} {run['p95_ms']:>8.2f} "
            f"{run['cpu_ms']:>14.2f} {run['rss_mib']:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
