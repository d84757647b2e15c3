"""The cluster's control plane, in its own network namespace: Prometheus (scrape jobs and rules taken
from the rendered chart, as the Prometheus Operator would load them), an Alertmanager HA pair
gossiping on loopback and routing as the chart's AlertmanagerConfig says, alert-bot replicas, and the
PostgreSQL and Feishu stand-in they use. Each program is a `Program` that can be killed and started
again, which is what the fault helpers do."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from megatrace.stack_files import compress_rules, evaluated_at_least_every
from tests.alertbot.conftest import TOKEN as WEBHOOK_TOKEN
from tests.cluster.network import inside
from tests.cluster.operator_scrape import exporter_scrape_jobs, exporter_targets
from tests.support.feishu_server import FeishuServer
from tests.support.helm_chart import of_kind, only
from tests.support.postgres import PostgresServer
from tests.support.services import alertmanager_argv, prometheus_argv, wait_http

PROMETHEUS_PORT = 9090
ALERTMANAGER_PORTS = (9093, 9193)
GOSSIP_PORTS = (9094, 9194)
BOT_PORTS = (9451, 9461)
CHATS = {"P0": "oc_p0", "P1": "oc_p1", "P2": "oc_p2", "P3": "oc_p3"}


@dataclasses.dataclass
class Program:
    """One control-plane program: how to start it, where it says it is ready, its log."""

    name: str
    argv: list[str]
    ready_url: str
    log: Path
    namespace: str
    proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> Program:
        with inside(self.namespace), open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                wait_http(self.ready_url, timeout=timeout, proc=self.proc)
            except (RuntimeError, TimeoutError) as exc:
                self.kill()
                raise RuntimeError(
                    f"{self.name}: {exc}\n{self.log.read_text(errors='replace')[-3000:]}"
                ) from exc
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the program's process group and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ControlPlane:
    """Programs of the control namespace; everything it started is stopped by `close()`."""

    def __init__(self, namespace: str, objects: list[dict[str, Any]], root: Path) -> None:
        self.namespace = namespace
        self.objects = objects
        self.root = root
        self.programs: list[Program] = []
        self.postgres: PostgresServer | None = None
        with inside(namespace):
            self.feishu = FeishuServer().start()

    def url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def get(self, url: str, **kwargs: Any) -> Any:
        """requests.get from the control namespace."""
        import requests

        with inside(self.namespace):
            return requests.get(url, timeout=kwargs.pop("timeout", 10), **kwargs)

    def post(self, url: str, **kwargs: Any) -> Any:
        """requests.post from the control namespace."""
        import requests

        with inside(self.namespace):
            return requests.post(url, timeout=kwargs.pop("timeout", 10), **kwargs)

    def program(self, name: str, argv: list[str], ready_url: str) -> Program:
        program = Program(name, argv, ready_url, self.root / f"{name}.log", self.namespace)
        self.programs.append(program)
        return program.start()

    # -- Prometheus -----------------------------------------------------------------------------------

    def write_targets(self, pods: list[tuple[str, str, str]]) -> Path:
        """What Kubernetes discovery would list for the exporter Service (file_sd)."""
        path = self.root / "exporter-endpoints.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(exporter_targets(self.objects, pods)))
        tmp.replace(path)
        return path

    def rule_files(self, factor: float) -> list[Path]:
        """The chart's PrometheusRule groups as rule files, `for:`, windows and time literals divided by
        `factor`, every group evaluated each second (the global interval here) like the local stack's."""
        paths = []
        for rule in of_kind(self.objects, "PrometheusRule"):
            path = self.root / f"rules-{rule['metadata']['name']}.yml"
            document = compress_rules({"groups": rule["spec"]["groups"]}, factor, 5)
            path.write_text(yaml.safe_dump(evaluated_at_least_every(document, "1s")))
            paths.append(path)
        return paths

    def start_prometheus(
        self, pods: list[tuple[str, str, str]], rules_factor: float | None = None, alerting: bool = False
    ) -> Program:
        sd_file = self.write_targets(pods)
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": exporter_scrape_jobs(self.objects, sd_file),
        }
        if rules_factor is not None:
            config["rule_files"] = [str(p) for p in self.rule_files(rules_factor)]
        if alerting:
            targets = [f"127.0.0.1:{port}" for port in ALERTMANAGER_PORTS]
            config["alerting"] = {
                "alertmanagers": [{"api_version": "v2", "static_configs": [{"targets": targets}]}]
            }
        path = self.root / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = prometheus_argv(path, self.root / "prometheus-data", PROMETHEUS_PORT)
        return self.program("prometheus", argv, f"{self.url(PROMETHEUS_PORT)}/-/ready")

    def query(self, promql: str) -> list[dict[str, Any]]:
        answer = self.get(f"{self.url(PROMETHEUS_PORT)}/api/v1/query", params={"query": promql}).json()
        return answer["data"]["result"]

    # -- the alert path ---------------------------------------------------------------------------------

    def start_postgres(self) -> str:
        """A real PostgreSQL in the control namespace; the bots' database URL."""
        with inside(self.namespace):
            self.postgres = PostgresServer().start()
            return self.postgres.database()

    def alertmanager_config(self, index: int) -> Path:
        """Member `index`'s alertmanager.yml: the chart's AlertmanagerConfig route and its sub-routes
        (the P0 one), its webhook sent to bot replica `index`, as the bot's Service would hand it to one
        replica (the top route's group waits shortened for the test)."""
        spec = only(self.objects, "AlertmanagerConfig")["spec"]
        route = spec["route"]
        receiver = spec["receivers"][0]
        hook = receiver["webhookConfigs"][0]
        config = {
            "route": {
                "receiver": receiver["name"],
                "group_by": route["groupBy"],
                "group_wait": "1s",
                "group_interval": "5s",
                "repeat_interval": route["repeatInterval"],
                "routes": [
                    {
                        "matchers": [f'{m["name"]}{m["matchType"]}"{m["value"]}"' for m in sub["matchers"]],
                        "group_wait": sub["groupWait"],
                    }
                    for sub in route.get("routes", [])
                ],
            },
            "receivers": [
                {
                    "name": receiver["name"],
                    "webhook_configs": [
                        {
                            "url": f"{self.url(BOT_PORTS[index])}/alertmanager",
                            "send_resolved": hook["sendResolved"],
                            "http_config": {
                                "authorization": {"type": "Bearer", "credentials": WEBHOOK_TOKEN}
                            },
                        }
                    ],
                }
            ],
        }
        path = self.root / f"alertmanager-{index}.yml"
        path.write_text(yaml.safe_dump(config))
        return path

    def alertmanager_program(self, index: int) -> Program:
        """Member `index` of the HA pair, gossiping with the other on loopback."""
        config = self.alertmanager_config(index)
        port, gossip = ALERTMANAGER_PORTS[index], GOSSIP_PORTS[index]
        peers = [f"127.0.0.1:{p}" for p in GOSSIP_PORTS if p != gossip]
        argv = alertmanager_argv(config, self.root / f"am{index}-data", port, f"127.0.0.1:{gossip}", peers)
        return self.program(f"alertmanager-{index}", argv, f"{self.url(port)}/-/ready")

    def bot_config(self, index: int, store: dict[str, Any], drilldown: dict[str, Any] | None = None) -> Path:
        """Replica `index`'s alertbot.yaml: the chart's listen/webhook token, Feishu app, `store`."""
        settings: dict[str, Any] = {
            "listen": f"127.0.0.1:{BOT_PORTS[index]}",
            "auth": {"bearer_token": WEBHOOK_TOKEN},
            "store": store,
            "dedupe": {"storm_threshold": 0},
            "delivery": {"chat_per_second": 1000, "app_per_second": 1000, "app_per_minute": 100000},
            "feishu": {
                "base_url": self.feishu.url,
                "timeout_s": 2,
                "app": {"app_id": self.feishu.app_id, "app_secret": self.feishu.app_secret, "chats": CHATS},
            },
            "report": {"directory": str(self.root / f"bot{index}-reports")},
        }
        if drilldown is not None:
            settings["drilldown"] = drilldown
        path = self.root / f"bot{index}.yaml"
        path.write_text(yaml.safe_dump(settings))
        return path

    def bot_program(self, index: int, config: Path) -> Program:
        argv = [sys.executable, "-m", "megatrace.cli", "alertbot", "--config", str(config)]
        return self.program(f"bot-{index}", argv, f"{self.url(BOT_PORTS[index])}/healthz")

    def close(self) -> None:
        for program in reversed(self.programs):
            program.kill(signal.SIGTERM)
        if self.postgres is not None:
            self.postgres.stop()
        self.feishu.stop()
