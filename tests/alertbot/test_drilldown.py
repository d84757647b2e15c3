"""Drill-down: trace directories confined to the configured roots, the analyzer run off the alert's
path, Prometheus hints from a real Prometheus, and the verdict from real tracer dumps."""

from __future__ import annotations

import http.server
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from megatrace.alertbot.drilldown import DrilldownRunner, resolve_trace_dir
from megatrace.alertbot.node_findings import Finding, cause_from_nodes, node_findings, prometheus_hints
from megatrace.alertbot.service import Service
from tests.alertbot.conftest import Bot, alert, config, wait_until, webhook
from tests.support.blackhole import blackholed
from tests.support.gloo_job import run_traced_job
from tests.support.services import free_port, prometheus_argv, running

T0 = 1_790_000_000.0
STUB = """
import json, pathlib, sys, time
gate, report = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
while not gate.exists():
    time.sleep(0.05)
print(json.dumps({**json.loads(report.read_text()), "analyzed": sys.argv[3]}))
"""


def test_trace_dir_is_confined_to_the_roots(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    (root / "llm-7").mkdir(parents=True)
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    (root / "inside-link").symlink_to(root / "llm-7")
    roots = [str(root)]
    assert resolve_trace_dir(roots, "llm-7") == (root / "llm-7").resolve()
    assert resolve_trace_dir(roots, "inside-link") == (root / "llm-7").resolve()
    for job in ("..", ".", "../secret", "/etc", "llm-7/../..", "", "a\x00b", "escape", "missing"):
        assert resolve_trace_dir(roots, job) is None, job
    assert resolve_trace_dir([str(tmp_path / "none"), str(root)], "llm-7") == (root / "llm-7").resolve()


def stub_config(tmp_path: Path, report: dict, wait: float = 5.0) -> tuple:
    root = tmp_path / "traces"
    (root / "llm-7").mkdir(parents=True)
    gate = tmp_path / "gate"
    (tmp_path / "report.json").write_text(json.dumps(report))
    stub = tmp_path / "stub_analyzer.py"
    stub.write_text(STUB)
    command = [sys.executable, str(stub), str(gate), str(tmp_path / "report.json")]
    drilldown = {
        "trace_roots": [str(root)],
        "analyzer_command": command,
        "timeout_s": 30,
        "verdict_wait_s": wait,
    }
    return config(tmp_path, drilldown=drilldown), gate


HUNG_5 = {
    "verdict": "hang",
    "suspects": [
        {"rank": 5, "kind": "hang", "confidence": 0.9, "evidence": "rank 5 never joined.", "host": "gpu-9"}
    ],
}


def text(line: dict) -> str:
    return line["card"]["elements"][0]["text"]["content"]


def title(line: dict) -> str:
    return line["card"]["header"]["title"]["content"]


def test_the_first_card_waits_for_a_quick_verdict_and_names_the_culprit(tmp_path: Path) -> None:
    cfg, gate = stub_config(tmp_path, HUNG_5, wait=60)
    gate.touch()
    bot = Bot(cfg)
    runner = DrilldownRunner(bot.pipeline, cfg.drilldown, bot.metrics)
    bot.receive(webhook(alert(job="llm-7", rank="0"), alert(job="llm-7", rank="1")))
    assert bot.delivery.deliver_due() == 0  # the card waits for the verdict
    runner.submit_pending()
    bot.drain(timeout=60)
    (card,) = bot.console()  # one card for the job's hang, not one per rank, and no follow-up
    assert card["kind"] == "firing"
    assert title(card) == "[P0] FIRING: rank 5 hung on gpu-9 — job llm-7"
    body = text(card)
    assert "**Culprit**: rank **5** on node **gpu-9** (confidence 90%)" in body
    assert "**Seen**: rank 5 never joined." in body
    assert "**Do first**: Drain node gpu-9, then restart job llm-7 from its last checkpoint." in body
    assert "**Also alerting**: ranks 0-1" in body
    result = json.loads(bot.store.db.query("SELECT result FROM drilldowns")[0]["result"])
    assert result["analyzed"] == str((tmp_path / "traces" / "llm-7").resolve())
    runner.shutdown()


def test_a_late_verdict_updates_the_card_that_went_out_without_it(tmp_path: Path) -> None:
    cfg, gate = stub_config(tmp_path, HUNG_5, wait=0.3)
    bot = Bot(cfg)
    runner = DrilldownRunner(bot.pipeline, cfg.drilldown, bot.metrics)
    bot.receive(webhook(alert(job="llm-7", rank="0"), alert(job="llm-7", rank="1")))
    runner.submit_pending()
    bot.drain()  # the analyzer is blocked on the gate: the card goes out after its bounded wait
    (first,) = bot.console()
    assert title(first) == "[P0] FIRING: job llm-7 hangs — culprit not known yet"
    assert "**Culprit**: not known yet; the drill-down's verdict follows" in text(first)
    gate.touch()
    wait_until(lambda: bot.store.outbox.queue_depth(), what="the verdict queued")
    bot.drain()
    first, update = bot.console()
    assert update["kind"] == "verdict" and update["replaces"] == first["card"]["elements"][-1]["elements"][0][
        "content"
    ].removeprefix("megatrace ref ")
    assert title(update) == "[P0] FIRING: rank 5 hung on gpu-9 — job llm-7"
    bot.receive(webhook(*(alert(job="llm-7", rank=r, status="resolved", ends_at=T0 + 60) for r in "01")))
    bot.drain()
    resolved = bot.console()[-1]
    assert (
        resolved["kind"] == "resolved"
        and title(resolved) == "[P0] RESOLVED: rank 5 hung on gpu-9 — job llm-7"
    )
    assert "**Resolved** after 1m" in text(resolved) and "Ranks stopped making progress" not in text(resolved)
    assert len(bot.console()) == 3
    runner.shutdown()


def test_one_drilldown_per_job_and_alert_within_the_rerun_window(tmp_path: Path) -> None:
    """Ranks of one hang share a drill-down; a slow rank in the same job later gets its own."""
    cfg, _ = stub_config(tmp_path, {"verdict": "healthy", "suspects": []})
    bot = Bot(cfg)
    bot.receive(webhook(alert(job="llm-7", rank="0"), alert(job="llm-7", rank="1")))
    bot.receive(webhook(alert("MegatraceSlowRank", severity="P1", job="llm-7", rank="3")))
    bot.receive(webhook(alert(job="llm-7", rank="2", starts_at=1_790_000_060.0)))
    bot.receive(webhook(alert(job="llm-8", rank="0")))
    rows = bot.store.db.query("SELECT job, alertname FROM drilldowns ORDER BY id")
    assert [tuple(row) for row in rows] == [
        ("llm-7", "MegatraceRankHang"),
        ("llm-7", "MegatraceSlowRank"),
        ("llm-8", "MegatraceRankHang"),
    ]


def test_failing_analyzer_and_unknown_job_are_reported_not_raised(tmp_path: Path) -> None:
    cfg, gate = stub_config(tmp_path, {"no": "verdict"})
    gate.touch()
    bot = Bot(cfg)
    runner = DrilldownRunner(bot.pipeline, cfg.drilldown, bot.metrics)
    bot.receive(webhook(alert(job="llm-7"), alert("MegatraceJobStalled", job="../../etc")))
    for row in bot.store.incidents.pending_drilldowns():
        runner.run(row.id)
    bot.drain()
    texts = [text(line) for line in bot.console()]
    assert "not named: the drill-down failed (the analyzer's report has no verdict/suspects)" in texts[0]
    assert "no trace directory for job '../../etc' under the configured trace roots" in texts[1]
    assert bot.metrics.drilldowns.labels("error")._value.get() == 2


def test_a_crashing_drilldown_still_answers_the_alert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, _ = stub_config(tmp_path, {"verdict": "healthy", "suspects": []})
    bot = Bot(cfg)
    runner = DrilldownRunner(bot.pipeline, cfg.drilldown, bot.metrics)

    def crash(job: str) -> dict:
        raise KeyError("suspects")

    monkeypatch.setattr(runner, "investigate", crash)
    bot.receive(webhook(alert(job="llm-7")))
    (row,) = bot.store.incidents.pending_drilldowns()
    runner.run(row.id)
    bot.drain()
    (card,) = bot.console()
    assert title(card) == "[P0] FIRING: job llm-7 hangs — culprit not known yet"
    assert "the drill-down crashed (KeyError); the bot's log has the details" in text(card)
    assert bot.store.incidents.drilldown(row.id).state == "done"
    assert "suspects" not in text(card)


class Exposition(http.server.BaseHTTPRequestHandler):
    """Serves GPU and IB series of one node whose XID and link-down counters rise on every scrape."""

    scrapes = 0

    def body(self) -> bytes:
        Exposition.scrapes += 1
        n = Exposition.scrapes
        return (
            f'megatrace_gpu_xid_errors_total{{gpu="3",uuid="GPU-3",xid="79"}} {n}\n'
            'megatrace_gpu_clock_event_active{gpu="3",uuid="GPU-3",reason="hw_thermal_slowdown"} 1\n'
            'megatrace_gpu_clock_event_active{gpu="3",uuid="GPU-3",reason="sw_power_cap"} 0\n'
            f'megatrace_infiniband_link_downed_total{{device="mlx5_1",port="1"}} {2 * n}\n'
        ).encode()

    def do_GET(self) -> None:
        body = self.body()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def prometheus_with_node(tmp_path: Path) -> Iterator[str]:
    node = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Exposition)
    threading.Thread(target=node.serve_forever, daemon=True).start()
    port = free_port()
    cfg = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "node", "static_configs": [{"targets": [f"127.0.0.1:{node.server_address[1]}"]}]}
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    argv = prometheus_argv(tmp_path / "prometheus.yml", tmp_path / "prom-data", port)
    with running(argv, f"http://127.0.0.1:{port}/-/ready", tmp_path / "prometheus.log"):
        yield f"http://127.0.0.1:{port}"
    node.shutdown()


class CleanNode(Exposition):
    """A node whose GPU 3 and IB port are healthy: no clock event, no XID, no link errors."""

    def body(self) -> bytes:
        return (
            b'megatrace_gpu_xid_errors_total{gpu="3",uuid="GPU-3b",xid="79"} 0\n'
            b'megatrace_gpu_clock_event_active{gpu="3",uuid="GPU-3b",reason="hw_thermal_slowdown"} 0\n'
            b'megatrace_infiniband_link_downed_total{device="mlx5_1",port="1"} 0\n'
        )


@pytest.mark.slow
def test_a_fault_on_the_culprits_node_alone_names_its_class(tmp_path: Path) -> None:
    """Two nodes scraped by a real Prometheus, the culprit's (127.0.0.1) with XIDs, thermal throttling
    and link errors, its peer's (127.0.0.2) clean: the culprit's GPU is named, not its peer's."""
    faulty = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Exposition)
    clean = http.server.ThreadingHTTPServer(("127.0.0.2", 0), CleanNode)
    for server in (faulty, clean):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    targets = [f"127.0.0.1:{faulty.server_address[1]}", f"127.0.0.2:{clean.server_address[1]}"]
    cfg = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "node", "static_configs": [{"targets": targets}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    argv = prometheus_argv(tmp_path / "prometheus.yml", tmp_path / "prom-data", port)
    url = f"http://127.0.0.1:{port}"
    try:
        with running(argv, f"{url}/-/ready", tmp_path / "prometheus.log"):
            findings: list[Finding] = []
            deadline = time.monotonic() + 60
            while len(findings) < 3 and time.monotonic() < deadline:
                findings, error = node_findings(url, ["127.0.0.1", "127.0.0.2"], 300)
                time.sleep(0.5)
    finally:
        faulty.shutdown()
        clean.shutdown()
    assert error == ""
    assert {(f.host, f.kind) for f in findings} == {("127.0.0.1", "gpu"), ("127.0.0.1", "network")}
    culprit, peer = {"host": "127.0.0.1", "gpu": 3}, {"host": "127.0.0.2", "gpu": 3}
    named = cause_from_nodes(culprit, [peer], findings)
    assert named is not None and named["class"] == "gpu"
    assert named["evidence"].startswith("GPU 3: clock event hw_thermal_slowdown")
    assert cause_from_nodes(peer, [culprit], findings) is None


@pytest.mark.slow
def test_prometheus_hints_for_the_suspect_node(prometheus_with_node: str) -> None:
    hints: list[str] = []
    deadline = time.monotonic() + 60
    while len(hints) < 3 and time.monotonic() < deadline:
        hints = prometheus_hints(prometheus_with_node, "127.0.0.1", 300)
        time.sleep(0.5)
    assert hints[0] == "GPU 3: clock event hw_thermal_slowdown in the last 5 min"
    assert hints[1].startswith("GPU 3: ") and hints[1].endswith("XID 79 error(s) in the last 5 min")
    assert hints[2].startswith("mlx5_1 port 1: link_downed_total +")
    assert len(hints) == 3
    assert prometheus_hints(prometheus_with_node, "gpu-unknown", 300) == []
    assert prometheus_hints(prometheus_with_node, 'x"} or vector(1) #', 300) == []
    unreachable = prometheus_hints(f"http://127.0.0.1:{free_port()}", "127.0.0.1", 300)
    assert unreachable == ["Prometheus could not be asked about 127.0.0.1: ConnectionError"]


@pytest.mark.timeout(60)
def test_prometheus_that_never_answers_costs_one_timeout() -> None:
    """A Prometheus that accepts connections and never replies must not hold the drill-down."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        hints = prometheus_hints(url, "127.0.0.1", 300, timeout=1.0)
    assert hints == ["Prometheus could not be asked about 127.0.0.1: ReadTimeout"]


@pytest.mark.timeout(60)
def test_prometheus_partitioned_away_costs_one_connect_timeout() -> None:
    """A Prometheus whose packets are dropped (no refusal) costs the connect timeout, not the timeout."""
    with blackholed("127.0.0.6") as port:
        hints = prometheus_hints(f"http://127.0.0.6:{port}", "127.0.0.1", 300, timeout=40, connect_timeout=1)
    assert hints == ["Prometheus could not be asked about 127.0.0.1: ConnectTimeout"]


@pytest.mark.slow
def test_drilldown_names_the_hung_rank_from_real_tracer_dumps(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    run_traced_job(
        traces,
        nprocs=4,
        steps=6,
        env={
            "MEGATRACE_FAULT_HANG_RANK": "2",
            "MEGATRACE_FAULT_HANG_AT_STEP": "3",
            "MEGATRACE_TRACE_JOB": "llm-7",
        },
    )
    drilldown = {"trace_roots": [str(traces)], "timeout_s": 120, "verdict_wait_s": 120}
    bot = Service(config(tmp_path, drilldown=drilldown))
    bot.start()
    try:
        bot.store.inbox.add(
            "webhook", json.dumps(webhook(alert("MegatraceJobStalled", job="llm-7"))), time.time()
        )
        bot.wake()
        console = Path(bot.cfg.delivery.console_path)
        wait_until(console.exists, timeout=150, what="the first card")
        lines = [json.loads(x) for x in console.read_text().splitlines()]
    finally:
        bot.stop()
    assert [line["kind"] for line in lines] == ["firing"]
    assert re.fullmatch(r"\[P0\] FIRING: rank 2 hung on \S+ — job llm-7", title(lines[0])), title(lines[0])
    assert "**Culprit**: rank **2** on node **" in text(lines[0])
