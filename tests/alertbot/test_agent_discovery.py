"""How the drill-down finds and reaches the node agents, against a real agent serving a real traced job:
through the ``agent_address`` label when Prometheus's series carry one (the node name in ``instance``
does not resolve); from a static list or a DNS name when Prometheus is down; and, with one agent
partitioned away (its packets dropped), within the gathering's deadline, naming the agent it could not
reach and leaving that agent's ranks uncollected rather than blamed."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from megatrace.alertbot.config import AgentFallbackConfig, AgentsConfig
from megatrace.alertbot.discovery import GatherError, resolve_all
from megatrace.alertbot.drilldown import DrilldownRunner
from megatrace.alertbot.gather import gather
from megatrace.analyzer.loader import load
from megatrace.config import ConfigError
from megatrace.tracer.stack_fallback import read_stacks_file
from megatrace.tracer.stacks import main_stack
from tests.alertbot.conftest import Bot, alert, config, webhook
from tests.support.blackhole import blackholed
from tests.support.gloo_job import run_traced_job
from tests.support.services import free_port, prometheus_argv, running, serving
from tests.support.stuck_rank import held_gil_stacks

JOB = "llm-9"
TOKEN = "agent-token-for-tests"


@pytest.fixture(scope="module")
def job_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trace root holding a finished real 2-rank gloo job."""
    root = tmp_path_factory.mktemp("root")
    run_traced_job(root, nprocs=2, steps=3, env={"MEGATRACE_TRACE_JOB": JOB})
    return root


@contextlib.contextmanager
def agent(tmp_path: Path, address: str, root: Path, node: str) -> Iterator[tuple[int, int]]:
    """`megatrace exporter` serving `root` on `address`; yields (metrics port, trace port)."""
    ports = free_port(), free_port()
    (tmp_path / "token").write_text(TOKEN)
    settings = {
        "listen": f"{address}:{ports[0]}",
        "collectors": ["tracer", "traces"],
        "trace_dir": str(root),
        "trace_listen": f"{address}:{ports[1]}",
        "trace_token_file": str(tmp_path / "token"),
        "node_name": node,
        "podresources_socket": str(tmp_path / "no-kubelet.sock"),
    }
    path = tmp_path / f"agent-{address}.yml"
    path.write_text(yaml.safe_dump(settings))
    argv = [sys.executable, "-m", "megatrace.cli", "exporter", "--config", str(path)]
    with running(argv, f"http://{address}:{ports[0]}/healthz", tmp_path / f"agent-{address}.log"):
        yield ports


def agents_config(tmp_path: Path, port: int, **settings: object) -> AgentsConfig:
    (tmp_path / "token").write_text(TOKEN)
    return AgentsConfig(port=port, token_file=str(tmp_path / "token"), retries=1, **settings)  # type: ignore[arg-type]


@contextlib.contextmanager
def exposition(text: str) -> Iterator[str]:
    """A /metrics endpoint on loopback serving `text`: series as a chart-scraped agent's carry them."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    with serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as address:
        yield address


@contextlib.contextmanager
def prometheus_scraping(tmp_path: Path, series: str, count: int) -> Iterator[str]:
    """A real Prometheus scraping `series` (honor_labels, as the chart's monitor does); yields its URL
    once it holds `count` tracer series of the job."""
    port = free_port()
    with exposition(series) as target:
        scrape = {"job_name": "megatrace", "honor_labels": True, "static_configs": [{"targets": [target]}]}
        (tmp_path / "prometheus.yml").write_text(
            yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [scrape]})
        )
        url = f"http://127.0.0.1:{port}"
        argv = prometheus_argv(tmp_path / "prometheus.yml", tmp_path / "prom-data", port)
        with running(argv, f"{url}/-/ready", tmp_path / "prometheus.log"):
            deadline = time.monotonic() + 60
            query = f'megatrace_tracer_rank_info{{job="{JOB}"}}'
            while time.monotonic() < deadline:
                answer = requests.get(f"{url}/api/v1/query", params={"query": query}, timeout=5)
                if len(answer.json()["data"]["result"]) == count:
                    break
                time.sleep(0.3)
            yield url


def rank_info(rank: int, instance: str, agent_address: str) -> str:
    """The tracer series of a rank as the chart's relabeling leaves it: `instance` the node's name (which
    does not resolve), `agent_address` the pod's IP:port."""
    return (
        f'megatrace_tracer_rank_info{{job="{JOB}",rank="{rank}",world_size="2",instance="{instance}",'
        f'agent_address="{agent_address}"}} 1\n'
    )


def test_series_with_agent_address_are_reached_there_and_named_by_node(
    job_root: Path, tmp_path: Path
) -> None:
    with agent(tmp_path, "127.0.0.2", job_root, "node-a") as (metrics_port, trace_port):
        series = rank_info(0, "node-a", f"127.0.0.2:{metrics_port}") + rank_info(
            1, "node-a", f"127.0.0.2:{metrics_port}"
        )
        with prometheus_scraping(tmp_path, series, 2) as prometheus:
            found = gather(JOB, prometheus, agents_config(tmp_path, trace_port), tmp_path / "out")
    assert found.no_data == {} and found.uncollected == set()
    assert sorted(p.name for p in found.directory.glob("rank-*.trace")) == ["rank-0.trace", "rank-1.trace"]
    assert {r: (p["node"], p["agent"]) for r, p in found.placement.items()} == {
        0: ("node-a", "node-a"),
        1: ("node-a", "node-a"),
    }


def test_prometheus_down_the_drill_down_completes_from_the_static_list(
    job_root: Path, tmp_path: Path
) -> None:
    """Prometheus does not answer; the static list names three agents: one holds rank 0 only, one holds
    no file of the job, one is down. Rank 1 may be on the one that is down, so it is not collected
    (never blamed)."""
    half = one_rank(job_root, tmp_path / "half")
    nobody = free_port()
    (tmp_path / "other-jobs").mkdir()
    with (
        agent(tmp_path, "127.0.0.2", half, "node-a") as (_, trace_port),
        agent(tmp_path, "127.0.0.3", tmp_path / "other-jobs", "node-c") as (_, other_port),
    ):
        # node-c's agent answers 404 for the job: it holds none of its ranks, which is no failure
        static = [f"127.0.0.2:{trace_port}", f"127.0.0.3:{other_port}", f"127.0.0.4:{nobody}"]
        _, runner = drill_down(
            tmp_path, f"http://127.0.0.1:{free_port()}", trace_port, fallback={"static": static}
        )
        report = runner.investigate(JOB)
    runner.shutdown()
    assert "error" not in report and report["verdict"] in ("healthy", "inconclusive"), json.dumps(report)[
        :2000
    ]
    assert report["uncollected_ranks"] == [1]
    (missing,) = report["no_data"]
    assert missing["ranks"] == [1]
    assert missing["reason"] == (
        f"on none of the agents that answered; these did not: agent 127.0.0.4:{nobody}: connection refused "
        "or lost after 3 tries"
    )
    assert "Prometheus could not be asked" in report["gather_notes"][0]

    without = agents_config(tmp_path, trace_port)
    with pytest.raises(GatherError, match="Prometheus could not be asked"):
        gather(JOB, f"http://127.0.0.1:{nobody}", without, tmp_path / "out2")


def test_prometheus_down_a_dns_name_finds_every_agent_it_resolves_to(job_root: Path, tmp_path: Path) -> None:
    assert "127.0.0.1" in resolve_all("localhost")
    with agent(tmp_path, "127.0.0.1", job_root, "node-a") as (_, trace_port):
        cfg = agents_config(tmp_path, trace_port, fallback=AgentFallbackConfig(dns_name="localhost"))
        found = gather(JOB, "", cfg, tmp_path / "out")
    assert sorted(found.placement) == [0, 1] and found.no_data == {}


def test_a_partitioned_agent_costs_the_deadline_at_most_and_is_named(job_root: Path, tmp_path: Path) -> None:
    """The blackholed agent drops every SYN; a request's timeout alone (20 s, three tries) would take a
    minute, the connect timeout (1 s) and the gathering's deadline (15 s) bound it."""
    with (
        agent(tmp_path, "127.0.0.2", job_root, "node-a") as (_, trace_port),
        blackholed("127.0.0.5") as dropped,
    ):
        fallback = AgentFallbackConfig(static=[f"127.0.0.2:{trace_port}", f"127.0.0.5:{dropped}"])
        cfg = agents_config(
            tmp_path, trace_port, fallback=fallback, timeout_s=20, connect_timeout_s=1, deadline_s=20
        )
        cfg.retries = 2
        started = time.monotonic()
        found = gather(JOB, "", cfg, tmp_path / "out")
        took = time.monotonic() - started
    assert took < cfg.deadline_s, took
    assert sorted(found.placement) == [0, 1] and found.no_data == {}


def test_a_partitioned_agent_holding_ranks_leaves_them_uncollected(job_root: Path, tmp_path: Path) -> None:
    """Prometheus places rank 1 on an agent that is partitioned away: the drill-down ends within the
    gathering's deadline plus the analysis, its card names the agent and why, and rank 1 is passed to
    the analyzer as not collected, while rank 0 comes from the agent that answers. Without a connect
    timeout, three tries at the 20 s request timeout would take a minute."""
    half = one_rank(job_root, tmp_path / "half")
    with agent(tmp_path, "127.0.0.2", half, "node-a") as (metrics_port, trace_port):
        series = rank_info(0, "node-a", f"127.0.0.2:{metrics_port}") + rank_info(
            1, "node-b", f"127.0.0.5:{metrics_port}"
        )
        with prometheus_scraping(tmp_path, series, 2) as prometheus, blackholed("127.0.0.5", trace_port):
            limits = {"timeout_s": 20, "connect_timeout_s": 1, "deadline_s": 20}
            bot, runner = drill_down(tmp_path, prometheus, trace_port, **limits)
            started = time.monotonic()
            report = runner.investigate(JOB)
            took = time.monotonic() - started
    runner.shutdown()
    # the gathering's deadline plus the analysis (a 2-rank job: seconds), below the minute it took before
    assert took < limits["deadline_s"] + 30, took
    reason = (
        f"agent on node-b (127.0.0.5:{trace_port}): no connection within 1 s (unreachable or partitioned) "
        "after 3 tries"
    )
    assert report["no_data"] == [{"reason": reason, "ranks": [1]}]
    assert report["uncollected_ranks"] == [1]
    bot.store.incidents.update(1, verdict=json.dumps(report))
    row = bot.store.outbox.find(kind="firing")[0]
    card = bot.delivery.render(row, time.time())["card"]["elements"][0]["text"]["content"]
    assert f"- rank 1: {reason}" in card


def one_rank(job_root: Path, to: Path) -> Path:
    """A trace root holding rank 0's files of the job only."""
    (to / JOB).mkdir(parents=True)
    for path in (job_root / JOB).glob("rank-0.*"):
        (to / JOB / path.name).write_bytes(path.read_bytes())
    return to


def drill_down(
    tmp_path: Path, prometheus: str, trace_port: int, fallback: dict | None = None, **limits: float
) -> tuple[Bot, DrilldownRunner]:
    """A bot holding a hang alert of the job, and its drill-down from the agents."""
    (tmp_path / "token").write_text(TOKEN)
    agents = {"port": trace_port, "token_file": str(tmp_path / "token"), "retries": 2, **limits}
    if fallback:
        agents["fallback"] = fallback
    cfg = config(tmp_path, drilldown={"source": "agents", "prometheus_url": prometheus, "agents": agents})
    bot = Bot(cfg)
    bot.receive(webhook(alert(job=JOB)))
    return bot, DrilldownRunner(bot.pipeline, cfg.drilldown, bot.metrics)


@pytest.mark.parametrize(
    ("agents", "prometheus", "message"),
    [
        ({}, "", "key 'drilldown.prometheus_url': source agents finds the agents through Prometheus"),
        (
            {"fallback": {"static": ["10.0.0.1:x"]}},
            "",
            "key 'drilldown.agents.fallback.static': '10.0.0.1:x'",
        ),
        ({"fallback": {"static": ["a:70000"]}}, "", "key 'drilldown.agents.fallback.static': 'a:70000'"),
        ({"fallback": {"dns_name": "bad name"}}, "", "key 'drilldown.agents.fallback.dns_name'"),
        ({"connect_timeout_s": 0}, "http://p:9090", "key 'drilldown.agents.connect_timeout_s'"),
        ({"deadline_s": 5, "timeout_s": 10}, "http://p:9090", "key 'drilldown.agents.deadline_s'"),
    ],
)
def test_bad_discovery_settings_are_refused_naming_the_key(
    tmp_path: Path, agents: dict, prometheus: str, message: str
) -> None:
    drilldown = {"source": "agents", "prometheus_url": prometheus, "agents": {"token_file": "t", **agents}}
    with pytest.raises(ConfigError, match=re.escape(message)):
        config(tmp_path, drilldown=drilldown)


def test_a_fallback_alone_is_enough_to_find_the_agents(tmp_path: Path) -> None:
    fallback = {"static": ["10.0.0.1", "[fd00::1]:9452"], "dns_name": "megatrace-exporter-headless.ml.svc"}
    cfg = config(
        tmp_path, drilldown={"source": "agents", "agents": {"token_file": "t", "fallback": fallback}}
    )
    assert cfg.drilldown.agents.fallback.static == ["10.0.0.1", "[fd00::1]:9452"]


def test_the_drill_down_fetches_the_stacks_faulthandler_wrote_for_a_rank(tmp_path: Path) -> None:
    """A rank that held the GIL past its stall threshold has only faulthandler's stacks file to say
    where it was: the gathering fetches it beside the ring, and the analyzer reads it."""
    root = tmp_path / "root"
    held_gil_stacks(root / "held-gil")
    with agent(tmp_path, "127.0.0.1", root, "node-a") as (_, trace_port):
        cfg = agents_config(tmp_path, trace_port, fallback=AgentFallbackConfig(dns_name="localhost"))
        found = gather("held-gil", "", cfg, tmp_path / "out")
    assert found.no_data == {} and not any("stacks" in note for note in found.notes)
    # the stall dump the watchdog wrote once the GIL was free again comes too
    fetched = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert fetched == ["rank-0.dump", "rank-0.stacks", "rank-0.trace"]
    main = main_stack(read_stacks_file(tmp_path / "out" / "rank-0.stacks").stacks)
    assert main is not None and main.frames[0].function == "hold_the_gil"
    _, report = load([tmp_path / "out"])
    assert report.files_by_format == {"ring": 1, "dump": 1, "stacks": 1}
