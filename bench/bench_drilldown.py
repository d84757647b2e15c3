"""Drill-down bench: RANKS ring files × RECORDS records served by AGENTS node agents on this machine.

Each agent is a real ``megatrace exporter`` (collectors tracer and traces) on its own loopback address
with its share of the ranks; a real Prometheus scrapes them. The bot's side runs in a child process
as the bot runs it (`from_agents`: Prometheus query, parallel fetches, then the analyzer as a
subprocess); printed: gather and analysis time, bytes fetched, peak RSS of the bot process and of the
analyzer it ran, and one agent's /metrics scrape time idle (before and after the drill-down, so a
change in the machine's load in between shows) and while the agents serve the gather, with the load
average at start and end (this machine may be shared).

In a cluster each agent has its node's CPUs and the bot runs elsewhere; here 16 agents, Prometheus and
the bot share this machine's. So that the scrape ratio measures what serving costs an agent's own
scrapes, and not how many other nodes' work this machine stands in for, the measured agent (with its
serving process) has CPU 0 to itself and everything else runs on the other CPUs (``--shared``: no
pinning, everything on every CPU). Usage:
python bench/bench_drilldown.py [--ranks 1024] [--records 10000] [--agents 16] [--shared]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_analyzer_scale import generate
from megatrace.alertbot.config import AgentsConfig, DrilldownConfig
from tests.support.services import free_port, prometheus_argv, running

TOKEN = "bench-token-0123456789"


def bot_side(cfg: DrilldownConfig, job: str, out: multiprocessing.Queue, nice: int = 0) -> None:
    """What the bot does for one alert: gather from the agents, run the analyzer; figures to `out`.
    `nice` lowers its priority (the bot runs on another machine than the agents in a cluster)."""
    from megatrace.alertbot.drilldown import from_agents, run_analyzer

    os.nice(nice)

    with tempfile.TemporaryDirectory() as scratch:
        started = time.time()
        found = from_agents(cfg, job, Path(scratch))
        ended = time.time()
        if isinstance(found, str):
            out.put({"error": found})
            return
        bot_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        t = time.perf_counter()
        report = run_analyzer(cfg.analyzer_command, found.directory, cfg.timeout_s)
        t_analyze = time.perf_counter() - t
    out.put(
        {
            "gather_s": ended - started,
            "gather_window": [started, ended],
            "analyze_s": t_analyze,
            "fetched_mib": found.fetched_bytes / 2**20,
            "ranks": len(found.placement),
            "no_data": len(found.no_data),
            "bot_rss_mib": max(bot_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10),
            "analyzer_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**10,
            "verdict": report.get("verdict", report.get("error")),
            "suspects": [s.get("rank") for s in report.get("suspects", [])][:3],
        }
    )


def scrape_times(url: str, count: int, stop: threading.Event | None = None) -> list[tuple[float, float]]:
    """(start, wall time) of /metrics scrapes, one after another (until `stop` is set, when given)."""
    times = []
    with requests.Session() as session:
        while len(times) < count if stop is None else not stop.is_set():
            started, t = time.time(), time.perf_counter()
            session.get(url, timeout=30).raise_for_status()
            times.append((started, time.perf_counter() - t))
            time.sleep(0.05)
    return times


def describe(times: list[float]) -> str:
    ordered = sorted(times) or [float("nan")]
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return (
        f"median {statistics.median(ordered) * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms ({len(ordered)} scrapes)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--records", type=int, default=10000)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument(
        "--parallel", type=int, default=AgentsConfig.parallel, help="drilldown.agents.parallel"
    )
    parser.add_argument(
        "--bot-nice", type=int, default=0, help="run the bot's side at this niceness (it and its analyzer)"
    )
    parser.add_argument("--shared", action="store_true", help="no CPU of its own for the measured agent")
    args = parser.parse_args()
    everything = os.sched_getaffinity(0)
    pin = not args.shared and len(everything) >= 2
    node_cpu = {min(everything)}
    load_at_start = f"{os.getloadavg()[0]:.1f}"
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        t = time.perf_counter()
        child = multiprocessing.get_context("spawn").Process(
            target=generate, args=(tmp / "all" / "sim", args.ranks, args.records, args.ranks // 3)
        )
        child.start()
        child.join()
        files = sorted((tmp / "all" / "sim").glob("rank-*.trace"), key=lambda p: int(p.stem[5:]))
        size = sum(f.stat().st_size for f in files)
        print(
            f"generated {len(files)} ring files ({size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s"
        )
        (tmp / "token").write_text(TOKEN)
        metrics_port, trace_port = free_port(), free_port()
        addresses = [f"127.0.1.{i + 1}" for i in range(args.agents)]
        for i, path in enumerate(files):
            root = tmp / f"agent-{i * args.agents // len(files)}" / "sim"
            root.mkdir(parents=True, exist_ok=True)
            path.rename(root / path.name)
        for i, address in enumerate(addresses):
            if pin:  # children inherit the affinity they are started with: agent 0 and its serving process
                os.sched_setaffinity(0, node_cpu if i == 0 else everything - node_cpu)
            settings = {
                "listen": f"{address}:{metrics_port}",
                "collectors": ["tracer", "traces"],
                "trace_dir": str(tmp / f"agent-{i}"),
                "trace_listen": f"{address}:{trace_port}",
                "trace_token_file": str(tmp / "token"),
                "trace_retention_hours": 0,
                "trace_max_bytes": 0,
                "node_name": f"node-{i}",
            }
            (tmp / f"agent-{i}.yml").write_text(yaml.safe_dump(settings))
            argv = [
                sys.executable,
                "-m",
                "megatrace.cli",
                "exporter",
                "--config",
                str(tmp / f"agent-{i}.yml"),
            ]
            stack.enter_context(
                running(argv, f"http://{address}:{metrics_port}/healthz", tmp / f"agent-{i}.log")
            )
        prometheus_port = free_port()
        scrape = {
            "job_name": "agents",
            "honor_labels": True,
            "static_configs": [{"targets": [f"{a}:{metrics_port}" for a in addresses]}],
        }
        (tmp / "prometheus.yml").write_text(
            yaml.safe_dump({"global": {"scrape_interval": "2s"}, "scrape_configs": [scrape]})
        )
        prometheus = f"http://127.0.0.1:{prometheus_port}"
        argv = prometheus_argv(tmp / "prometheus.yml", tmp / "prom", prometheus_port)
        stack.enter_context(running(argv, f"{prometheus}/-/ready", tmp / "prometheus.log"))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            query = {"query": 'count(megatrace_tracer_rank_info{job="sim"})'}
            result = requests.get(f"{prometheus}/api/v1/query", params=query, timeout=10).json()["data"][
                "result"
            ]
            if result and int(result[0]["value"][1]) == len(files):
                break
            time.sleep(1)
        agent_metrics = f"http://{addresses[0]}:{metrics_port}/metrics"
        idle = scrape_times(agent_metrics, 40)
        cfg = DrilldownConfig(
            source="agents",
            prometheus_url=prometheus,
            timeout_s=600,
            agents=AgentsConfig(
                port=trace_port,
                token_file=str(tmp / "token"),
                records_per_rank=args.records,
                parallel=args.parallel,
            ),
        )
        out: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
        bot = multiprocessing.get_context("spawn").Process(
            target=bot_side, args=(cfg, "sim", out, args.bot_nice)
        )
        stop = threading.Event()
        busy: list[tuple[float, float]] = []
        watcher = threading.Thread(target=lambda: busy.extend(scrape_times(agent_metrics, 0, stop)))
        t = time.perf_counter()
        bot.start()
        watcher.start()
        figures = out.get(timeout=900)
        stop.set()
        bot.join()
        watcher.join()
        total = time.perf_counter() - t
        idle_after = scrape_times(agent_metrics, 40)
        print(json.dumps(figures))
        if "error" in figures:
            return
        f = figures
        print(
            f"drill-down over {f['ranks']} ranks x {args.records} records from {args.agents} agents: "
            f"{total:.1f} s wall (gather {f['gather_s']:.1f} s, {f['fetched_mib']:.0f} MiB on the wire, "
            f"analyzer {f['analyze_s']:.1f} s), ranks without data {f['no_data']}; peak RSS: bot process "
            f"{f['bot_rss_mib']:.0f} MiB, the analyzer it ran {f['analyzer_rss_mib']:.0f} MiB; "
            f"verdict {f['verdict']} {f['suspects']} (injected slow rank {args.ranks // 3})"
        )
        idle_times = [wall for _, wall in idle + idle_after]
        start, end = figures["gather_window"]
        serving = [wall for at, wall in busy if start <= at <= end]
        print(
            f"load average at start {load_at_start}, at end {os.getloadavg()[0]:.1f} "
            f"({os.cpu_count()} CPUs); bot side at nice {args.bot_nice}, {args.parallel} requests in flight; "
            + (
                f"the measured agent alone on CPU {min(node_cpu)}, the rest on the other CPUs"
                if pin
                else "every process on every CPU"
            )
        )
        print(f"agent /metrics idle: {describe(idle_times)}")
        before, after = describe([w for _, w in idle]), describe([w for _, w in idle_after])
        print(f"  before the drill-down {before}; after {after}")
        print(f"agent /metrics while the agents serve the gather: {describe(serving)}")
        if serving:
            ratio = statistics.median(serving) / statistics.median(idle_times)
            print(f"ratio serving/idle (median): {ratio:.2f}x")


if __name__ == "__main__":
    main()
